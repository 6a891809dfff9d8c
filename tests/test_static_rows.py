"""Rows leaving and joining a batched static cache inside its one buffer
(headway.decode.static_cache): kept rows move to the buffer's front in place, new rows take the
rows after them and a join copies nothing, each row's columns as a copying cache would hold
them; an uncaptured forward attends over a window of the columns (headway.decode.batch_step).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from headway.decode.batch_step import BatchVerify
from headway.decode.captured import StaticForward
from headway.decode.static_cache import StaticCache
from tests.tiny import tiny_model

CPU = torch.device("cpu")
WIDTH = 8


def _written(cache: StaticCache, head_dims: tuple[int, ...], seed: int) -> list[Tensor]:
    """Write every column of every row of ``cache``; the keys written ``[B, 2, WIDTH, d]``
    per layer (values are keys + 1)."""
    generator = torch.Generator().manual_seed(seed)
    cache.columns[:, :WIDTH] = torch.arange(WIDTH)
    written = []
    for layer, dim in zip(cache.layers, head_dims, strict=True):
        keys = torch.randn(cache.batch, 2, WIDTH, dim, generator=generator)
        layer.update(keys, keys + 1)
        written.append(keys)
    return written


def _holds(cache: StaticCache, rows: list[Tensor], columns: int = WIDTH) -> None:
    """``cache``'s rows hold ``rows`` (per layer ``[B, 2, WIDTH, d]``) in their first
    ``columns`` columns, keys and values."""
    for layer, keys in zip(cache.layers, rows, strict=True):
        assert layer.keys.shape[0] == cache.batch == keys.shape[0]
        assert torch.equal(layer.keys[:, :, :columns], keys[:, :, :columns])
        assert torch.equal(layer.values[:, :, :columns], keys[:, :, :columns] + 1)


@pytest.mark.parametrize("head_dims", [(4, 4), (4, 8)], ids=["fused", "per-layer"])
@pytest.mark.parametrize("kept", [[0, 2], [1, 2], [2, 0], [], [0, 1, 2]])
def test_kept_and_joined_rows_hold_their_columns(
    head_dims: tuple[int, ...], kept: list[int]
) -> None:
    """Rows kept (in order, out of order, none, all), then two rows joining after them: every
    row holds what was written to it; in the one buffer nothing is allocated (the fused buffer
    stays the same storage), per-layer buffers are copied."""
    cache = StaticCache(len(head_dims), WIDTH, CPU, batch=3, room=5)
    written = _written(cache, head_dims, seed=0)
    store = cache.store
    left = cache.kept_rows(torch.tensor(kept, dtype=torch.long))
    _holds(left, [keys[kept] for keys in written])
    added = left.rows_after(2)
    joining = _written(added, head_dims, seed=1)
    joined = left.joined(added)
    _holds(
        joined, [torch.cat([keys[kept], new]) for keys, new in zip(written, joining, strict=True)]
    )
    fused = len(set(head_dims)) == 1
    assert (joined.store is store and store is not None) == fused
    if fused:  # views of the one buffer's front rows
        assert joined.fused is not None and store is not None
        assert joined.fused.data_ptr() == store.data_ptr()


def test_rows_past_the_buffers_room_join_by_copying() -> None:
    """More rows than the buffer has room for: the new rows get a buffer of their own and the
    join copies both into one that holds them all."""
    cache = StaticCache(1, WIDTH, CPU, batch=2)  # room: its two rows
    written = _written(cache, (4,), seed=0)
    added = cache.rows_after(3)
    assert added.store is None and added.room == 5
    joining = _written(added, (4,), seed=1)
    joined = cache.joined(added)
    assert joined.store is not cache.store and joined.store is not added.store
    _holds(joined, [torch.cat([written[0], joining[0]])])


def test_kept_rows_keep_the_columns_they_are_told() -> None:
    """``columns``: the kept rows' first columns moved (what their rows have written); a
    forward's window returns that many columns of the buffers."""
    cache = StaticCache(1, WIDTH, CPU, batch=3)
    written = _written(cache, (4,), seed=0)
    left = cache.kept_rows(torch.tensor([1, 2]), columns=3)
    _holds(left, [written[0][[1, 2]]], columns=3)
    left.window = 5
    keys, values = left.layers[0].update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4))
    assert keys.shape == values.shape == (2, 2, 5, 4)
    assert torch.equal(keys[:, :, 1:3], written[0][[1, 2], :, 1:3])


def test_a_batch_refilled_keeps_its_one_buffer() -> None:
    """BatchVerify: a finished row leaving and a prompt taking its place reuse the cache's
    buffer (no new one a refill), and the rows' next tokens are their own."""
    model = tiny_model("llama")
    forward = StaticForward(model, batch=3)
    steps = BatchVerify(forward, max_depth=2)
    prompts = [torch.arange(3, 3 + n) for n in (4, 7, 11)]
    with torch.no_grad():
        steps.prefill(prompts)
        store = forward.cache.store
        assert store is not None
        steps.keep_rows([0, 2])
        firsts = steps.add_rows([torch.arange(5, 14)])
        alone = BatchVerify(StaticForward(model, batch=1), max_depth=2)
        first_alone = alone.prefill([torch.arange(5, 14)])
    assert forward.cache.store is store and forward.cache.batch == 3
    assert torch.equal(firsts, first_alone)


def test_rows_of_mixed_lengths_attend_each_over_their_own_columns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A batch of a 5-token and a 200-token prompt: its uncaptured steps attend row by row
    (the short row over 64 columns, not the long row's 256), and both rows decode to their own
    greedy outputs; one call for the whole batch where the rows are of like lengths."""
    from headway.decode import grouped_attention
    from headway.decode.batch_decode import decode_batch
    from tests.test_generate import hf_greedy

    model = tiny_model("llama")
    seen: list[list[int] | None] = []
    chosen = grouped_attention._rows_apart

    def recording(batch: int, columns: int) -> list[int] | None:
        seen.append(chosen(batch, columns))
        return seen[-1]

    monkeypatch.setattr(grouped_attention, "_rows_apart", recording)
    for lengths, apart in (((5, 200), True), ((150, 160), False)):
        prompts = [torch.arange(length) % 90 + 3 for length in lengths]
        seen.clear()
        with torch.no_grad():
            results = decode_batch(model, prompts, [None, None], max_new_tokens=12)
        for prompt, result in zip(prompts, results, strict=True):
            assert result.tokens == hf_greedy(model, prompt, 12, eos=None)
        per_row = [widths for widths in seen if widths is not None]
        assert bool(per_row) == apart
        if apart:
            assert all(widths[0] == 64 and widths[1] >= 256 for widths in per_row)


def test_row_by_row_attention_equals_the_batchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two rows whose masks close every column past 10 and 90: attended row by row (one SDPA
    call each, over 10 and 90 columns), the output is the one call's over all 100."""
    from headway.decode.grouped_attention import packed_sdpa, row_widths

    generator = torch.Generator().manual_seed(2)
    query = torch.randn(2, 6, 3, 8, generator=generator)
    key = torch.randn(2, 2, 100, 8, generator=generator)
    value = torch.randn(2, 2, 100, 8, generator=generator)
    mask = torch.zeros(2, 1, 3, 100)
    mask[0, ..., 10:] = mask[1, ..., 90:] = torch.finfo(torch.float32).min
    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 3, False  # type: ignore[assignment]
    with torch.no_grad():
        whole, _ = packed_sdpa(layer, query, key, value, mask)
        widths: list[int] = []
        stock = torch.nn.functional.scaled_dot_product_attention

        def recording(q: Tensor, k: Tensor, *args: object, **kwargs: object) -> Tensor:
            widths.append(k.shape[2])
            return stock(q, k, *args, **kwargs)  # type: ignore[arg-type]

        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        with row_widths([10, 90]):
            apart, _ = packed_sdpa(layer, query, key, value, mask)
    assert widths == [10, 90]
    torch.testing.assert_close(apart, whole)


def test_a_forwards_packed_mask_is_not_kept_past_its_last_layer() -> None:
    """The mask packed once for a forward's layers is dropped at its last layer (a prefill's
    can be hundreds of MB)."""
    from headway.decode import grouped_attention

    model = tiny_model("llama")
    with torch.no_grad():
        decode_batch_rows = BatchVerify(StaticForward(model, batch=2), max_depth=2)
        with grouped_attention.grouped_attention(model):
            decode_batch_rows.prefill([torch.arange(3, 9), torch.arange(3, 12)])
    assert not grouped_attention._last_mask


def _plain_step(steps: BatchVerify, roots: Tensor) -> list[list[int]]:
    """One step of every row with no tree (each row commits its next token)."""
    empty = torch.zeros(steps.batch, 0, dtype=torch.long)
    return steps.step(roots, empty, empty)


def test_a_batch_refilled_to_its_size_keeps_its_steps_plans() -> None:
    """Rows left and as many joined: the buffers a step's graph reads and writes (the rows'
    lengths and seeds, the cache's columns and keys/values) are where they were, so its plan,
    on CUDA its captured graph, is kept; a smaller batch makes its own. The new rows decode as
    they do alone."""
    model = tiny_model("llama")
    forward = StaticForward(model, batch=2)
    steps = BatchVerify(forward, max_depth=2)
    prompts = [torch.arange(3, 3 + n) for n in (4, 7, 9)]
    with torch.no_grad():
        roots = steps.prefill(prompts[:2])
        _plain_step(steps, roots)
        plan, signature = next(iter(steps._plans.values())), steps._signature()
        steps.keep_rows([1])
        joined = steps.add_rows([prompts[2]])
        after = _plain_step(steps, torch.tensor([0, int(joined[0])]))
        assert steps._signature() == signature and next(iter(steps._plans.values())) is plan
        steps.keep_rows([1])
        _plain_step(steps, joined)
        assert next(iter(steps._plans.values())) is not plan
        alone = BatchVerify(StaticForward(model, batch=1), max_depth=2)
        first = alone.prefill([prompts[2]])
        assert int(first[0]) == int(joined[0])
        assert after[1] == _plain_step(alone, first)[0]


def test_rows_joining_in_runs_of_their_own_keep_the_batchs_lengths(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two prompts of unlike lengths join, prefilled in two runs (a small prefill budget):
    the rows already there keep their lengths, the new ones get theirs."""
    from headway.decode import batch_prefill

    monkeypatch.setattr(batch_prefill, "PREFILL_TOKENS", 8)
    model = tiny_model("llama")
    steps = BatchVerify(StaticForward(model, batch=2), max_depth=2)
    with torch.no_grad():
        roots = steps.prefill([torch.arange(3, 8), torch.arange(3, 6)])
        _plain_step(steps, roots)
        steps.keep_rows([0])
        steps.add_rows([torch.arange(3, 5), torch.arange(3, 15)])
    assert len(batch_prefill.prefill_runs([2, 12])) == 2
    assert steps.lengths.tolist() == [6, 2, 12]
