"""Every kind of bad input issue #7 (point 3) lists, in one table: each gives one headway error,
on one line, naming the file / row / key and saying what to do; with ``skip_bad_rows`` a bad row
is skipped and counted instead.

Row-level cases go through :func:`build_dataset`, the path training takes (read, validate,
render with the chat template, tokenize). Some of these inputs are also tested one by one
elsewhere (tests/test_data.py, test_config.py, test_heads_io.py); here they share one contract.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import datasets
import pytest
from transformers import PreTrainedModel

from headway.config import load_config
from headway.drafters.build import build_drafter, spec_for
from headway.errors import ConfigError, DataError, HeadwayError
from headway.heads.eagle import EagleConfig, EagleModel
from headway.heads.io import HeadsError, load_heads, save_heads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.run_config import RunConfig
from headway.target import Target, fingerprint
from headway.train.data import build_dataset
from headway.train.features import CachedFeatureDataset, cache_features
from tests.drafting import heads_drafter as load_drafter
from tests.tiny import TINY_VOCAB, tiny_model
from tests.tokenizers_fixture import byte_bpe_tokenizer, smollm2_tokenizer

GOOD = json.dumps(
    {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}]}
).encode()
LONG = json.dumps(
    {
        "messages": [
            {"role": "user", "content": "Tell me a joke about cats. " * 10},
            {"role": "assistant", "content": "No."},
        ]
    }
).encode()


@dataclass(frozen=True)
class BadRow:
    """A row that cannot be trained on, written as line 2 of a three-line ``.jsonl`` file."""

    line: bytes
    reason: str  # what skip_bad_rows counts it under
    fix: str  # regex of the advice the error gives


BAD_ROWS = {
    "malformed JSONL line": BadRow(
        b'{"messages": [{"role": "user"', "invalid JSON", r"must be one JSON object"
    ),
    "empty conversation": BadRow(b'{"conversations": []}', "empty conversation", "drop the row"),
    "no assistant turn": BadRow(
        b'{"messages": [{"role": "system", "content": "Be brief."}, '
        b'{"role": "user", "content": "hi"}]}',
        "no assistant turn",
        r"add the assistant's reply or drop the row",
    ),
    "non-UTF-8 bytes": BadRow(b'{"text": "caf\xe9 au lait"}', "not UTF-8", "re-save the file"),
    "unpaired surrogate escape": BadRow(
        b'{"text": "caf\\udce9"}', "invalid Unicode", r"replace the escape"
    ),
    "content that is not text": BadRow(
        b'{"messages": [{"role": "user", "content": ["hi"]}, '
        b'{"role": "assistant", "content": "x"}]}',
        "non-string content",
        "join its text parts into one string",
    ),
}


def jsonl(path: Path, *lines: bytes) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def assert_one_clear_line(error: HeadwayError, where: str, fix: str) -> None:
    """One line, naming `where`, with advice matching the regex `fix`."""
    message = str(error)
    assert "\n" not in message, message
    assert where in message, f"{where!r} not named in: {message}"
    assert re.search(fix, message), f"no advice /{fix}/ in: {message}"


@pytest.mark.parametrize("case", list(BAD_ROWS), ids=list(BAD_ROWS))
def test_bad_row_is_named_or_skipped_and_counted(tmp_path: Path, case: str) -> None:
    bad = BAD_ROWS[case]
    path = jsonl(tmp_path / "chat.jsonl", GOOD, bad.line, GOOD)
    with pytest.raises(DataError) as caught:
        build_dataset(smollm2_tokenizer(), path, max_length=64)
    assert_one_clear_line(caught.value, f"{path}:2: ", bad.fix)
    dataset, report = build_dataset(smollm2_tokenizer(), path, max_length=64, skip_bad_rows=True)
    assert len(dataset) == report.samples == 2
    assert dict(report.skipped) == {bad.reason: 1}
    assert report.first_skipped[bad.reason] == f"{path}:2"


# --- whole-input cases: each trigger makes its bad input under a folder and reads it ----------


def over_long_sample(tmp: Path) -> None:
    """A sample whose assistant turn starts beyond max_length is always skipped and counted; if
    it was the only one, the error says so and how to fix it."""
    mixed = jsonl(tmp / "mixed.jsonl", GOOD, LONG)
    _, report = build_dataset(smollm2_tokenizer(), mixed, max_length=40)
    assert dict(report.skipped) == {"no trained token within max_length": 1}
    build_dataset(smollm2_tokenizer(), jsonl(tmp / "long.jsonl", LONG), max_length=40)


def empty_after_filtering(tmp: Path) -> None:
    path = jsonl(tmp / "bad.jsonl", b'{"messages": []}', b"{oops", b'{"text": ""}')
    build_dataset(smollm2_tokenizer(), path, max_length=64, skip_bad_rows=True)


def empty_file(tmp: Path) -> None:
    build_dataset(smollm2_tokenizer(), jsonl(tmp / "empty.jsonl", b""), max_length=64)


def missing_chat_template(tmp: Path) -> None:
    build_dataset(byte_bpe_tokenizer(None), jsonl(tmp / "chat.jsonl", GOOD), max_length=64)


def unknown_config_key(tmp: Path) -> None:
    recipe = tmp / "recipe.yaml"
    recipe.write_text("data:\n  max_len: 512\n", encoding="utf-8")
    load_config(RunConfig, recipe)


def overriding(override: str) -> Callable[[Path], None]:
    def trigger(tmp: Path) -> None:
        load_config(RunConfig, None, [override])

    return trigger


def tiny_llama() -> PreTrainedModel:
    return cast(PreTrainedModel, tiny_model("llama"))


def tiny_run(tmp: Path, method: str) -> tuple[Path, PreTrainedModel]:
    """A saved run of untrained `method` heads for a tiny Llama, and that Llama."""
    model = tiny_llama()
    if method == "eagle1":
        eagle = EagleConfig.from_target(model)
        head_config, state = eagle.to_dict(), EagleModel(eagle).state_dict()
    else:
        medusa = MedusaConfig(num_heads=2, num_layers=1, hidden_size=32, vocab_size=TINY_VOCAB)
        head_config, state = medusa.to_dict(), MedusaHeads(medusa).state_dict()
    run = save_heads(
        tmp / method,
        method=method,
        head_config=head_config,
        state_dict=state,
        target_fingerprint=fingerprint(model),
        target_name="tiny",
    )
    return run, model


def eagle_depth_zero(tmp: Path) -> None:
    run, model = tiny_run(tmp, "eagle1")
    load_drafter(run, model, depth=0)


def eagle1_foreign_draft_vocab(tmp: Path) -> None:
    """A draft-vocabulary list of another tokenizer's ids for an EAGLE-1 drafter."""
    run, model = tiny_run(tmp, "eagle1")
    (tmp / "draft_vocab.json").write_text(json.dumps({"token_ids": [1, 2, 399]}))
    target = Target(model=model, tokenizer=smollm2_tokenizer(), source="test")
    options = {"draft_vocab": str(tmp / "draft_vocab.json")}
    build_drafter(spec_for(heads=str(run), options=options), target)


def medusa_rank_beyond_vocab(tmp: Path) -> None:
    """A Medusa tree asking for the top-(V+1) candidate of a V-token vocabulary."""
    run, model = tiny_run(tmp, "medusa1")
    load_drafter(run, model, choices=[[0], [TINY_VOCAB]])


def damaged(data: bytes, how: str) -> bytes:
    """The first half of `data`, or `data` with its header overwritten."""
    return data[: len(data) // 2] if how == "truncated" else b"\x07" * 64 + data[64:]


def heads_weights(how: str) -> Callable[[Path], None]:
    def trigger(tmp: Path) -> None:
        run, _ = tiny_run(tmp, "medusa1")
        weights = run / "model.safetensors"
        weights.write_bytes(damaged(weights.read_bytes(), how))
        load_heads(run)

    return trigger


def feature_shard(how: str) -> Callable[[Path], None]:
    def trigger(tmp: Path) -> None:
        rows = [{"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, 1, 1]}] * 3
        cache = tmp / "features"
        cache_features(tiny_llama(), datasets.Dataset.from_list(rows), cache, layers=(2,))
        shard = cache / "shard-00000.safetensors"
        shard.write_bytes(damaged(shard.read_bytes(), how))
        CachedFeatureDataset(cache)[1]

    return trigger


@dataclass(frozen=True)
class Case:
    """A bad input: how to trigger it, the error it must give, what that error must name (a
    path relative to the case's folder, or a key) and the advice it must give (a regex)."""

    trigger: Callable[[Path], None]
    error: type[HeadwayError]
    names: str
    fix: str
    is_path: bool = False


CASES = {
    "over-long sample": Case(
        over_long_sample, DataError, "long.jsonl", r"raise data\.max_length", is_path=True
    ),
    "empty dataset after filtering": Case(
        empty_after_filtering, DataError, "bad.jsonl", r"no usable samples .*; fix", is_path=True
    ),
    "empty file": Case(
        empty_file, DataError, "empty.jsonl", r"one JSON object per line", is_path=True
    ),
    "missing chat template": Case(
        missing_chat_template,
        DataError,
        "chat.jsonl",
        r"set tokenizer\.chat_template",
        is_path=True,
    ),
    "unknown config key": Case(
        unknown_config_key, ConfigError, "data.max_len", r"did you mean 'data\.max_length'"
    ),
    "zero Medusa heads (depth 0)": Case(
        overriding("medusa.num_heads=0"), ConfigError, "medusa.num_heads", "must be >= 1"
    ),
    "empty EAGLE-3 draft vocabulary": Case(
        overriding("eagle3.draft_vocab_size=0"), ConfigError, "eagle3.draft_vocab_size", ">= 1"
    ),
    "NaN learning rate": Case(
        overriding("train.lr=nan"), ConfigError, "train.lr", "must be a finite number"
    ),
    "infinite loss weight": Case(
        overriding("eagle.ce_loss_weight=inf"), ConfigError, "eagle.ce_loss_weight", "finite"
    ),
    "EAGLE tree of depth 0": Case(eagle_depth_zero, ConfigError, "depth=0", r"must be >= 1"),
    "draft vocabulary of another tokenizer": Case(
        eagle1_foreign_draft_vocab, HeadwayError, "399", "another tokenizer"
    ),
    "Medusa tree top-k beyond the vocabulary": Case(
        medusa_rank_beyond_vocab, HeadsError, f"rank {TINY_VOCAB}", r"change the tree"
    ),
    "corrupted heads safetensors": Case(
        heads_weights("corrupted"), HeadsError, "medusa1/model.safetensors", "re-save", is_path=True
    ),
    "truncated heads safetensors": Case(
        heads_weights("truncated"), HeadsError, "medusa1/model.safetensors", "re-save", is_path=True
    ),
    "corrupted feature shard": Case(
        feature_shard("corrupted"),
        DataError,
        "features/shard-00000.safetensors",
        "rerun",
        is_path=True,
    ),
    "truncated feature shard": Case(
        feature_shard("truncated"),
        DataError,
        "features/shard-00000.safetensors",
        "rerun",
        is_path=True,
    ),
}


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_bad_input_gives_one_clear_line(tmp_path: Path, name: str) -> None:
    case = CASES[name]
    with pytest.raises(case.error) as caught:
        case.trigger(tmp_path)
    assert_one_clear_line(
        caught.value, str(tmp_path / case.names) if case.is_path else case.names, case.fix
    )
