"""Typed drafter specs: --draft-option values checked against the drafter's spec, one factory."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.specs import (
    EagleSpec,
    LookupMedusaSpec,
    MedusaSpec,
    PromptLookupSpec,
    describe_specs,
    parse_spec,
)
from headway.errors import ConfigError, HeadwayError
from headway.quickstart.calibrate import eval_command
from headway.target import Target
from tests.test_generate import hf_greedy
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

PROMPT = torch.tensor([5, 17, 42, 8, 91, 23, 5, 17, 42])


def test_options_are_typed_and_checked() -> None:
    spec = parse_spec(PromptLookupSpec, {"num_draft_tokens": "6", "adaptive": "false"})
    assert spec == PromptLookupSpec(num_draft_tokens=6, adaptive=False)
    assert parse_spec(MedusaSpec, {"heads": "x", "tree": [[0], [0, 0]]}).tree == ((0,), (0, 0))
    assert parse_spec(MedusaSpec, {"heads": "x", "tree": "mc_sim_7b_63"}).tree == "mc_sim_7b_63"
    with pytest.raises(ConfigError, match="did you mean 'max_nodes'"):
        parse_spec(PromptLookupSpec, {"max_node": 3})
    with pytest.raises(ConfigError, match="num_draft_tokens: 'many' is not int"):
        parse_spec(PromptLookupSpec, {"num_draft_tokens": "many"})
    with pytest.raises(ConfigError, match="need 1 <= min_ngram <= max_ngram"):
        parse_spec(PromptLookupSpec, {"min_ngram": 5})
    with pytest.raises(ConfigError, match="use --sizing cost"):
        parse_spec(EagleSpec, {"heads": "x", "sizing": "cost"})
    with pytest.raises(ConfigError, match="unknown drafter 'lookup'"):
        spec_for("lookup")
    with pytest.raises(ConfigError, match="takes no heads folder"):
        spec_for("prompt-lookup", heads="runs/x")
    for name in ("prompt-lookup:", "retrieval:", "eagle:", "medusa:", "lookup-medusa:"):
        assert name in describe_specs()


def test_the_factory_builds_what_the_spec_says_and_decoding_stays_exact() -> None:
    model = tiny_model("llama")
    target = Target(model=model, tokenizer=None, source="tiny")  # type: ignore[arg-type]
    drafter = build_drafter(PromptLookupSpec(min_ngram=1, max_nodes=3), target)
    assert isinstance(drafter, PromptLookupDrafter) and drafter.max_nodes == 3
    truth = hf_greedy(model, PROMPT, 16, eos=None)
    for sizing in ("drafter", "cost"):
        decoder = Decoder(model, drafter, DecodeOptions(sizing=sizing))
        assert decoder.generate(PROMPT, max_new_tokens=16, eos_token_ids=()).tokens == truth


def test_the_quickstart_prints_a_command_that_builds_its_drafter_again() -> None:
    spec = LookupMedusaSpec(heads="qs/export", confidence=0.42, draft_vocab="qs/data")
    command = eval_command(spec)
    assert command.startswith("headway eval --heads qs/export --drafter lookup-medusa")
    options = dict(part.split("=", 1) for part in command.split("--draft-option ")[1:])
    rebuilt = spec_for("lookup-medusa", heads="qs/export", options=options)
    assert rebuilt == spec


def test_a_draft_vocabulary_file_reads_back_without_tokenizing(tmp_path: Path) -> None:
    import gzip
    import json

    from headway.drafters.draft_vocab import (
        draft_vocabulary,
        frequent_answer_tokens,
        write_draft_vocabulary,
    )

    tokenizer = smollm2_tokenizer()
    data = tmp_path / "data"
    data.mkdir()
    rows = [
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": t}]}
        for t in ("the cat sat", "the cat ran", "the end")
    ]
    with gzip.open(data / "part-00000.jsonl.gz", "wt") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    ids = frequent_answer_tokens(data, tokenizer, 4)
    assert ids[0] == tokenizer("the", add_special_tokens=False)["input_ids"][0]  # most frequent
    path = write_draft_vocabulary(tmp_path / "draft_vocab.json", ids)
    assert torch.equal(draft_vocabulary(path, tokenizer, 4), draft_vocabulary(data, tokenizer, 4))
    assert draft_vocabulary(path, tokenizer, 1).tolist() == ids[:1]
    path.write_text(json.dumps({"token_ids": [1, 1]}))
    with pytest.raises(HeadwayError, match="distinct token ids in"):
        draft_vocabulary(path, tokenizer, 4)
    path.write_text("[1, 2]")
    with pytest.raises(HeadwayError, match="not a draft-vocabulary file"):
        draft_vocabulary(path, tokenizer, 4)
