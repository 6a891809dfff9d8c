"""Retrieval drafting: the n-gram datastore, share-ranked tries, per-step sizing, prompt lookup
first, and lossless greedy decoding with it on every tiny family."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.cli import main
from headway.decode.generate import generate
from headway.decode.tree import ancestor_mask
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.datastore import NgramDatastore, RetrievalDrafter
from headway.drafters.eagle_drafter import EagleDrafter
from headway.drafters.lookup import PromptLookupDrafter, ranked_trie
from headway.drafters.merged import FirstDrafter
from headway.drafters.retrieval import corpus_index
from headway.drafters.specs import RetrievalSpec
from headway.errors import HeadwayError
from headway.target import load_target
from tests.loop_sized import LoopSized
from tests.test_eval import _tiny_target
from tests.test_formats import random_run
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

CORPUS = [[1, 2, 3, 4, 5], [9, 2, 3, 4, 6], [7, 2, 3, 8], [1, 2, 3, 4, 5]]


def as_lists(tree: object) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()  # type: ignore[attr-defined]


def test_datastore_prefers_the_longest_ngram_and_counts_continuations() -> None:
    store = NgramDatastore(CORPUS, min_ngram=1, max_ngram=3)
    # [2, 3, 4] occurred 3 times: followed by 5 (twice) and 6
    assert store.continuations([0, 2, 3, 4], 2) == [((5,), 2), ((6,), 1)]
    # [5, 2, 3] never occurred: falls back to [2, 3], seen 4 times
    assert store.continuations([5, 2, 3], 2) == [((4, 5), 2), ((8,), 1), ((4, 6), 1)]
    # min_hits skips n-grams seen too rarely: [7, 2] once, then [2] 4 times
    assert store.continuations([7, 2], 1, min_hits=2) == [((3,), 4)]
    assert store.continuations([42, 43], 3) == []
    assert store.tokens == sum(len(s) for s in CORPUS)
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        NgramDatastore(CORPUS, min_ngram=3, max_ngram=2)


def test_ranked_trie_puts_parents_first_and_gives_shares() -> None:
    found = [((4, 5), 2), ((8,), 1), ((4, 6), 1)]
    tree, shares = ranked_trie(found, max_nodes=10)
    assert as_lists(tree) == ([4, 5, 8, 6], [-1, 0, -1, 0])
    assert shares.tolist() == pytest.approx([0.75, 0.5, 0.25, 0.25])
    top, top_shares = ranked_trie(found, max_nodes=2)
    assert as_lists(top) == ([4, 5], [-1, 0]) and top_shares.numel() == 2
    empty, none = ranked_trie([], max_nodes=4)
    assert empty.size == 0 and none.numel() == 0


def test_retrieval_drafter_sends_what_the_corpus_or_the_costs_justify() -> None:
    store = NgramDatastore(CORPUS, min_ngram=1, max_ngram=3)
    sequence = torch.tensor([5, 2, 3])
    by_share = RetrievalDrafter(store, num_draft_tokens=2, min_hits=1, min_share=0.5)
    assert as_lists(by_share.propose(sequence)) == ([4, 5], [-1, 0])
    free = LoopSized(RetrievalDrafter(store, num_draft_tokens=2, min_hits=1), [0.01] * 9)
    tree = free.propose(sequence)
    assert tree.size == 4 and bool(ancestor_mask(tree.parents)[:, 0].all())
    steep = LoopSized(RetrievalDrafter(store, min_hits=1), [0.01] + [1.0] * 8)
    assert steep.propose(sequence).size == 0
    with pytest.raises(ValueError, match="verify_costs has 3 entries"):
        LoopSized(RetrievalDrafter(store), [0.01, 0.02, 0.03])


def test_first_drafter_takes_the_first_non_empty_tree() -> None:
    store = NgramDatastore(CORPUS, min_ngram=1, max_ngram=3)
    lookup = PromptLookupDrafter(min_ngram=2, max_ngram=3, num_draft_tokens=2)
    first = FirstDrafter([lookup, RetrievalDrafter(store, num_draft_tokens=2, min_hits=1)])
    context = torch.tensor([2, 3, 7, 1, 2, 3])  # [2, 3] occurred in the context: prompt lookup
    first.begin(context[:1])
    assert as_lists(first.propose(context)) == ([7, 1], [-1, 0])
    fresh = torch.tensor([6, 2, 3])  # no context match: the corpus answers
    first.begin(fresh[:1])
    assert as_lists(first.propose(fresh)) == ([4, 5], [-1, 0])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_is_unchanged_and_a_matching_corpus_is_accepted(family: str) -> None:
    model = tiny_model(family)
    prompt = torch.tensor([5, 17, 42, 8, 91, 23])
    truth = hf_greedy(model, prompt, 24, eos=None)
    other = hf_greedy(model, torch.tensor([7, 7, 30]), 24, eos=None)
    store = NgramDatastore([truth, other])
    drafter = FirstDrafter([PromptLookupDrafter(), RetrievalDrafter(store, min_hits=1)])
    result = generate(model, prompt, drafter=drafter, max_new_tokens=24, eos_token_ids=())
    assert result.tokens == truth
    assert result.tau > 1.5, result.accept_lengths
    wrong = NgramDatastore([[(t + 1) % TINY_VOCAB for t in truth]])
    result = generate(
        model,
        prompt,
        drafter=RetrievalDrafter(wrong, min_hits=1, min_share=0.0),
        max_new_tokens=24,
        eos_token_ids=(),
    )
    assert result.tokens == truth


def test_built_from_a_chat_corpus_and_run_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _tiny_target(tmp_path)
    answer = "Hello! How can I help you today?"
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"hi {i}"},
                {"role": "assistant", "content": answer},
            ]
        }
        for i in range(3)
    ]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    target = load_target(folder, device="cpu")
    drafter = build_drafter(RetrievalSpec(data=(str(data),), min_hits=1), target)
    store = drafter.drafters[1].datastore  # type: ignore[attr-defined]
    expected = target.tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert store.num_sequences == 3 and store.sequence(0)[:-1] == expected
    with pytest.raises(HeadwayError, match="needs a corpus"):
        RetrievalSpec()
    command = ["generate", "--target", str(folder), "--device", "cpu", "--drafter", "retrieval"]
    assert main([*command, "--max-new-tokens", "4", "hello"]) == 2
    assert "needs a corpus" in capsys.readouterr().err
    options = ["--draft-option", f"data={data}", "--draft-option", "min_hits=1"]
    assert main([*command, *options, "--max-new-tokens", "6", "--json", "hello"]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(printed["token_ids"]) <= 6 and printed["tau"] >= 1.0


def test_the_corpus_index_is_cached_by_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    target = load_target(_tiny_target(tmp_path), device="cpu")
    data = tmp_path / "chat.jsonl"

    def write(answer: str) -> None:
        rows = [
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": a}]}
            for a in (answer, answer + " again")
        ]
        data.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")

    write("Hello! How can I help you today?")
    spec = RetrievalSpec(data=(str(data),), min_hits=1)
    built, cached = corpus_index(target, spec)
    again, cached_again = corpus_index(target, spec)
    assert not cached and cached_again
    assert [again.sequence(i) for i in range(2)] == [built.sequence(i) for i in range(2)]
    entries = tmp_path / "cache" / "retrieval"
    write("Goodbye, see you soon.")  # other answers: another key, built anew
    assert not corpus_index(target, spec)[1] and len(list(entries.iterdir())) == 2
    for entry in entries.iterdir():
        (entry / "keys2.npy").unlink()  # damaged: rebuilt, with a warning
    with caplog.at_level("WARNING"):
        assert not corpus_index(target, spec)[1]
    assert "rebuilding the retrieval index" in caplog.text
    assert corpus_index(target, spec)[1]
    shutil.rmtree(entries)
    entries.write_text("not a folder", encoding="utf-8")  # the cache cannot be written
    store, cached = corpus_index(target, spec)
    assert not cached and store.num_sequences == 2


def test_trained_heads_draft_behind_prompt_lookup_and_the_corpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    target = load_target(_tiny_target(tmp_path), device="cpu")
    run = random_run(tmp_path / "run", "eagle1", target.model)  # EAGLE-3 needs 4+ layers
    data = tmp_path / "chat.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    data.write_text(json.dumps(row) + "\n", encoding="utf-8")
    spec = spec_for("retrieval", heads=run, options={"data": str(data)})
    assert isinstance(spec, RetrievalSpec) and spec.heads == str(run)
    drafter = build_drafter(spec, target)
    assert isinstance(drafter, FirstDrafter) and drafter.self_sized == 1
    lookup, corpus, behind = drafter.drafters
    assert isinstance(lookup, PromptLookupDrafter) and isinstance(corpus, RetrievalDrafter)
    assert isinstance(behind, EagleDrafter)
    proposed: list[int] = []
    own = behind.propose

    def counted(*args: Any) -> Any:
        proposed.append(1)
        return own(*args)

    monkeypatch.setattr(behind, "propose", counted)
    prompt = torch.tensor([1, 7, 23, 45, 12, 9, 60, 7, 23, 45])
    truth = hf_greedy(target.model, prompt, 16, None)
    result = generate(target.model, prompt, drafter=drafter, max_new_tokens=16, eos_token_ids=())
    assert result.tokens == truth
    assert proposed  # the heads drafted on steps the cheap guesses had nothing for
    with pytest.raises(HeadwayError, match="takes no heads folder"):
        spec_for("prompt-lookup", heads=run)
