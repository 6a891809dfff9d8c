"""The ragged KV cache: prefilled rows land at columns 0.., a step writes after each row's own
tokens, a finished row is replaced by the last one, and the step mask blocks what a row must
not see."""

from __future__ import annotations

import weakref

import pytest
import torch
from transformers import DynamicCache

from headway.generation.ragged_cache import RaggedCache, step_mask
from tests.tiny import tiny_model


def prefilled(keys: torch.Tensor) -> DynamicCache:
    """A one-layer DynamicCache holding ``keys`` (and their negatives as values)."""
    cache = DynamicCache()
    cache.update(keys, -keys, 0)
    return cache


def test_rows_are_placed_written_after_their_own_tokens_and_moved() -> None:
    cache = RaggedCache(num_layers=1, slots=3, capacity=4)
    # two left-padded prompts of 3 and 1 tokens: [rows, heads=1, width=3, dim=1]
    keys = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]])[:, None, :, None]
    cache.place(prefilled(keys), [3, 1])
    layer = cache.ragged_layers[0]
    assert cache.lengths == [3, 1]
    assert layer.key_buffer[0, 0, :3, 0].tolist() == [1.0, 2.0, 3.0]
    assert layer.key_buffer[1, 0, :1, 0].tolist() == [9.0]
    assert layer.value_buffer[1, 0, :1, 0].tolist() == [-9.0]

    columns = cache.begin_step(2, torch.device("cpu"))
    assert columns.tolist() == [[3, 4], [1, 2]]
    assert cache.width == 5 and cache.capacity >= 5  # grew to hold the step
    assert layer.get_seq_length() == 3
    new = torch.tensor([[10.0, 11.0], [20.0, 21.0]])[:, None, :, None]
    seen_keys, _ = layer.update(new, -new)
    assert seen_keys.shape == (2, 1, 5, 1)
    assert layer.key_buffer[0, 0, :5, 0].tolist() == [1.0, 2.0, 3.0, 10.0, 11.0]
    assert layer.key_buffer[1, 0, :3, 0].tolist() == [9.0, 20.0, 21.0]

    cache.advance([1, 2])  # row 0 keeps one of its two new tokens, row 1 both
    assert cache.lengths == [4, 3]
    cache.move(1, 0)  # row 0 finished: the last row takes its slot
    cache.drop_last()
    assert cache.lengths == [3]
    assert layer.key_buffer[0, 0, :3, 0].tolist() == [9.0, 20.0, 21.0]


def test_growing_frees_the_old_buffers_at_once() -> None:
    """A growth keeps the contents and leaves nothing holding the old buffers (the live views
    point into the new ones), so it needs one layer's extra memory, not the cache's twice."""
    cache = RaggedCache(num_layers=1, slots=2, capacity=4)
    keys = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]])[:, None, :, None]
    cache.place(prefilled(keys), [3, 1])
    layer = cache.ragged_layers[0]
    cache.begin_step(1, torch.device("cpu"))
    new = torch.tensor([[4.0], [8.0]])[:, None, :, None]
    layer.update(new, -new)  # the live views now exist
    old_keys, old_values = weakref.ref(layer.key_buffer), weakref.ref(layer.value_buffer)
    cache.reserve(40)
    assert old_keys() is None and old_values() is None
    assert layer.key_buffer.shape[2] >= 40
    assert layer.keys is not None
    assert layer.keys.untyped_storage().data_ptr() == layer.key_buffer.untyped_storage().data_ptr()
    assert layer.keys.shape == (2, 1, cache.width, 1)
    assert layer.key_buffer[0, 0, :4, 0].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert layer.value_buffer[1, 0, :2, 0].tolist() == [-9.0, -8.0]


def test_a_step_on_an_unprepared_shape_is_refused() -> None:
    cache = RaggedCache(num_layers=1, slots=2)
    cache.place(prefilled(torch.ones(1, 1, 2, 1)), [2])
    cache.begin_step(1, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="begin_step"):
        cache.ragged_layers[0].update(torch.ones(1, 1, 3, 1), torch.ones(1, 1, 3, 1))
    with pytest.raises(ValueError, match="exceed 2 slots"):
        cache.place(prefilled(torch.ones(2, 1, 2, 1)), [2, 2])


def test_step_mask_lets_each_query_see_its_row_and_itself_only() -> None:
    model = tiny_model("llama")
    columns = torch.tensor([[2, 3], [0, 1]])  # row 0 holds 2 tokens, row 1 none
    mask = step_mask(model, columns, width=4, dtype=torch.float32)
    assert isinstance(mask, torch.Tensor)
    visible = (mask == 0)[:, 0].tolist()
    assert visible[0] == [[True, True, True, False], [True, True, True, True]]
    assert visible[1] == [[True, False, False, False], [True, True, False, False]]


def test_a_growth_the_host_cannot_hold_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a CPU, growing past the memory available is a HeadwayError naming the slots, the
    columns and --batch-size (a process killed for memory says nothing); the cache is left as
    it was, and a growth that fits goes on."""
    from headway.errors import HeadwayError
    from headway.generation import ragged_cache

    cache = RaggedCache(num_layers=1, slots=2, capacity=4)
    keys = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 9.0]])[:, None, :, None]
    cache.place(prefilled(keys), [3, 1])
    layer = cache.ragged_layers[0]
    column = 2 * 2 * 1 * 1 * 4  # keys and values of 2 slots, 1 head, head_dim 1, fp32
    monkeypatch.setattr(ragged_cache, "available_memory", lambda: column * 100)
    with pytest.raises(HeadwayError, match=r"2 slots would grow to 1000 columns.*--batch-size"):
        cache.reserve(1000)
    assert cache.capacity == 4 and layer.key_buffer.shape[2] == 4
    cache.reserve(40)  # (40 - 4) + 40 columns' worth fits in 100
    assert cache.capacity == 40 and layer.key_buffer[0, 0, :3, 0].tolist() == [1.0, 2.0, 3.0]
    monkeypatch.setattr(ragged_cache, "available_memory", lambda: None)  # not Linux: no check
    cache.reserve(1000)
    assert cache.capacity == 1000
