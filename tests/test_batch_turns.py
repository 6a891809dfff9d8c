"""A conversation's next turn on the batched decoder (headway.decode.batch_decoder): submitted
while the batch runs, it starts from the keys/values its turn before left (the shared tokens
copied, not prefilled again) and decodes what the target decodes for that prompt alone."""

from __future__ import annotations

import logging
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import Tensor

from headway.decode import batch_prefill
from headway.decode.batch_decoder import BatchDecoder, Ending, shared_prefix
from headway.decode.batch_drafting import RowDrafters
from headway.decode.sampling import SamplingParams
from headway.decode.static_cache import StaticCache
from headway.drafters.lookup import PromptLookupDrafter
from headway.errors import DataError, HeadwayError
from headway.target import Target
from headway.train import answering
from headway.train.prompts import PromptItem
from headway.train.regenerate import regenerate
from tests.test_generate import hf_greedy
from tests.test_regenerate import OPTIONS, items, read_all, tiny_chat_target  # noqa: F401
from tests.tiny import tiny_model

NEW = 6


def _first_turns() -> list[Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(3, 90, (size,), generator=generator) for size in (9, 4, 13)]


def _next_turn(prompt: Tensor, answer: list[int], extra: int) -> Tensor:
    """The turn after: the prompt, the answer, then ``extra`` new tokens (a user turn)."""
    tail = torch.arange(extra) % 50 + 5
    return torch.cat([prompt, torch.tensor(answer, dtype=torch.long), tail])


def _conversations(
    model: torch.nn.Module,
    reuse: bool,
    drafts: bool,
    sampling: SamplingParams | None = None,
    rows: int = 2,
) -> tuple[dict[int, list[int]], dict[int, Tensor], BatchDecoder]:
    """Three first turns, ``rows`` at a time; as each is answered its next turn is submitted
    after it (the first two turns only). The tokens and prompt of every request by index."""
    drafting = RowDrafters([PromptLookupDrafter() if drafts else None for _ in range(rows)])
    decoder = BatchDecoder(
        model,  # type: ignore[arg-type]
        drafting,
        rows,
        Ending(frozenset(), NEW),
        sampling=sampling or SamplingParams(),
        reuse=reuse,
    )
    prompts = {decoder.submit(p, seed=11 + i): p for i, p in enumerate(_first_turns())}
    out: dict[int, list[int]] = {}
    for index, result in decoder.completions():
        out[index] = result.tokens
        if index < 2:
            following = _next_turn(prompts[index], result.tokens, extra=3 + 4 * index)
            prompts[decoder.submit(following, seed=20 + index, after=index)] = following
    return out, prompts, decoder


@pytest.mark.parametrize("budget", [None, 6])
@pytest.mark.parametrize("drafts", [False, True])
def test_a_next_turn_continues_from_its_rows_keys_and_values(
    drafts: bool, budget: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every request, first turns and next turns, is transformers' greedy output for its prompt
    alone (fp32), with or without prompt lookup, the continued rows prefilled together or in
    runs of their own; each next turn's prompt and answer tokens up to its last committed one
    were copied, not prefilled."""
    if budget is not None:
        monkeypatch.setattr(batch_prefill, "PREFILL_TOKENS", budget)
    model = tiny_model("llama")
    out, prompts, decoder = _conversations(model, reuse=True, drafts=drafts)
    assert len(out) == 5
    for index, tokens in out.items():
        assert tokens == hf_greedy(model, prompts[index], NEW, eos=None), index
    firsts = sum(p.numel() for p in _first_turns())
    assert decoder.reused == sum(prompts[i].numel() + NEW - 1 for i in (0, 1))
    assert decoder.prefilled == firsts + 3 + 7 + 2  # the new tokens and each answer's last
    again, _, fresh = _conversations(model, reuse=False, drafts=drafts)
    assert again == out and fresh.reused == 0


def test_sampled_next_turns_are_what_their_seeds_sample_either_way() -> None:
    """Sampled (temperature 1), a continued turn draws what its seed draws prefilled whole."""
    model = tiny_model("qwen2")
    sampling = SamplingParams(temperature=1.0)
    out, _, decoder = _conversations(model, reuse=True, drafts=True, sampling=sampling)
    again, _, _ = _conversations(model, reuse=False, drafts=True, sampling=sampling)
    assert out == again and decoder.reused > 0


def test_no_reuse_for_drafting_that_reads_the_targets_states() -> None:
    """A drafter reading the target's states would need those of the copied columns too: such
    a batch prefills every prompt whole."""
    drafter = PromptLookupDrafter()
    drafter.hidden_layers = (1,)
    decoder = BatchDecoder(tiny_model("llama"), RowDrafters([drafter]), 1, Ending(frozenset(), 4))
    assert not decoder.reuse


def test_the_shared_prefix_leaves_the_new_prompt_one_token_to_run() -> None:
    assert shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert shared_prefix([1, 2, 3], [1, 2, 3]) == 2  # its last token runs again
    assert shared_prefix([], [1]) == 0


def test_a_prefix_is_a_copy_and_fills_a_row_of_a_cache_not_yet_written() -> None:
    """``row_prefix`` copies (later writes leave it); ``put_prefix`` into a cache whose layers
    hold no buffer yet makes them, keys and values of unlike shapes too (per-layer buffers)."""
    cpu = torch.device("cpu")
    source = StaticCache(2, 8, cpu, batch=2)
    source.columns[:, :4] = torch.arange(4)
    for layer in source.layers:
        keys = torch.randn(2, 2, 4, 3)
        layer.update(keys, torch.cat([keys, keys], dim=-1))  # values of head size 6
    prefix = source.row_prefix(1, 3)
    expected = [(keys.clone(), values.clone()) for keys, values in prefix]
    for layer in source.layers:
        layer.keys.zero_()
    target = StaticCache(2, 8, cpu, batch=3)
    target.put_prefix(2, prefix)
    for layer, (keys, values) in zip(target.layers, expected, strict=True):
        assert torch.equal(layer.keys[2, :, :3], keys) and torch.equal(
            layer.values[2, :, :3], values
        )
        assert not layer.keys[:2].any() and layer.values.shape[-1] == 6


def test_the_batch_engine_continues_later_turns_and_answers_alike(
    tiny_chat_target: Target,  # noqa: F811
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Regeneration's batch engine answers every turn as it does prefilling each whole, and
    takes later turns' histories from the turn before."""
    rows, taken = {}, {}
    for reuse in (True, False):
        options = replace(OPTIONS, engine="batch", max_new_tokens=12, reuse_history=reuse)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger=answering.__name__):
            regenerate(tiny_chat_target, items(), tmp_path / str(reuse), options, mix={"test": 8})
        rows[reuse] = read_all(tmp_path / str(reuse))
        found = [re.search(r"(\d+) taken from the turn before", r.message) for r in caplog.records]
        taken[reuse] = sum(int(match.group(1)) for match in found if match)  # over the shards
    assert rows[True] == rows[False]
    assert taken[True] > 0 and taken[False] == 0


def test_a_growth_the_free_memory_cannot_hold_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU the cache's new buffers are weighed against the free memory before they are
    made: one byte short is a one-line error naming --batch-size, not a process killed."""
    from headway.decode import static_cache

    cache = StaticCache(2, 8, torch.device("cpu"), batch=2)
    cache.columns[:, :4] = torch.arange(4)
    for layer in cache.layers:
        layer.update(torch.randn(2, 2, 4, 3), torch.randn(2, 2, 4, 3))
    needed = 2 * 2 * 2 * 2 * 16 * 3 * 4  # layers, keys and values, rows, heads, columns, dim
    monkeypatch.setattr(static_cache, "available_memory", lambda: needed - 1)
    with pytest.raises(HeadwayError, match="--batch-size") as refused:
        cache.grown(16, 4)
    assert "\n" not in str(refused.value) and "2 rows would grow to 16 columns" in str(
        refused.value
    )
    monkeypatch.setattr(static_cache, "available_memory", lambda: needed)
    assert cache.grown(16, 4).capacity == 16


def test_a_conversation_whose_next_turn_outgrows_the_context_ends_before_it(
    tiny_chat_target: Target,  # noqa: F811
    tmp_path: Path,
) -> None:
    """The tiny target holds 256 positions: a second turn of ~300 tokens is not asked (the row
    holds the first turn and its answer, the conversation cut there); a first turn that long
    is a one-line error naming the conversation and what to lower."""
    long_turn = "word " * 300
    fits = [PromptItem("t/0", "test", ["hi", long_turn]), PromptItem("t/1", "test", ["hello"])]
    options = replace(OPTIONS, engine="batch", max_new_tokens=6)
    regenerate(tiny_chat_target, fits, tmp_path / "cut", options, mix={"test": 2})
    rows = {row["id"]: row for row in read_all(tmp_path / "cut")}
    assert [m["role"] for m in rows["t/0"]["messages"]] == ["user", "assistant"]
    assert rows["t/0"]["messages"][0]["content"] == "hi"
    too_long = [PromptItem("t/2", "test", [long_turn])]
    with pytest.raises(DataError, match="t/2: user turn 1 makes a prompt of") as refused:
        regenerate(tiny_chat_target, too_long, tmp_path / "no", options, mix={"test": 1})
    assert "\n" not in str(refused.value) and "--max-new-tokens" in str(refused.value)


def test_bad_requests_are_refused() -> None:
    """No rows, no token, a sampled prompt without its seed, or a prompt and answer past the
    target's context (one line naming both lengths)."""
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="rows >= 1"):
        BatchDecoder(model, RowDrafters([]), 0, Ending(frozenset(), 4))
    decoder = BatchDecoder(
        model, RowDrafters([None]), 1, Ending(frozenset(), 4), sampling=SamplingParams(1.0)
    )
    with pytest.raises(ValueError, match="at least one token"):
        decoder.submit(torch.tensor([], dtype=torch.long))
    with pytest.raises(ValueError, match="needs its seed"):
        decoder.submit(torch.tensor([5, 6]))
    with pytest.raises(HeadwayError, match="a prompt of 300 tokens") as refused:
        decoder.submit(torch.full((300,), 5), seed=1)
    assert "\n" not in str(refused.value)
    assert list(decoder.completions()) == []  # nothing was queued
