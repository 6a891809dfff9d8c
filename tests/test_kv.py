"""Tree forward on stock HF models equals per-path decoding; compaction equals a fresh prefill."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.decode.kv import compact_cache, crop_cache, new_cache, prefill, tree_forward
from headway.decode.tree import root_to_leaf_paths
from tests.tiny import TINY_FAMILIES, tiny_model

PROMPT = torch.tensor([1, 7, 23, 45, 12, 9, 60])
ROOT = 50
#        root
#     /    |    \
#   30     31    37
#  /  \     |
# 32   33   35
#  |
# 34
#  |
# 36
PARENTS = torch.tensor([-1, -1, 0, 0, 2, 1, 4, -1])
TOKENS = torch.tensor([30, 31, 32, 33, 34, 35, 36, 37])
HIDDEN_LAYERS = (0, 1, -1)


@pytest.fixture(params=[(f, a) for f in TINY_FAMILIES for a in ("sdpa", "eager")], ids="-".join)
def model(request: pytest.FixtureRequest) -> Any:
    family, attn = request.param
    return tiny_model(family, attn_implementation=attn)


def _block() -> torch.Tensor:
    return torch.cat([torch.tensor([ROOT]), TOKENS])[None]


def _path_sequence(path: list[int]) -> torch.Tensor:
    """prompt + root + the tokens along a block path."""
    return torch.cat(
        [PROMPT, torch.tensor([ROOT]), TOKENS[torch.tensor(path[1:], dtype=torch.long) - 1]]
    )


@torch.no_grad()
def test_tree_logits_and_hidden_equal_each_path(model: Any) -> None:
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    logits, hidden = tree_forward(model, cache, _block(), PARENTS, PROMPT.numel(), HIDDEN_LAYERS)
    assert logits.shape == (TOKENS.numel() + 1, 96)
    assert cache.get_seq_length() == PROMPT.numel() + TOKENS.numel() + 1
    for path in root_to_leaf_paths(PARENTS):
        plain = model(_path_sequence(path)[None], output_hidden_states=True)
        rows = slice(PROMPT.numel(), None)
        torch.testing.assert_close(logits[path], plain.logits[0, rows], atol=1e-5, rtol=0)
        for got, layer in zip(hidden, HIDDEN_LAYERS, strict=True):
            expected = plain.hidden_states[layer][0, rows]
            torch.testing.assert_close(got[path], expected, atol=1e-5, rtol=0)


@torch.no_grad()
def test_prefill_returns_last_logits_and_all_hidden(model: Any) -> None:
    cache = new_cache(model)
    logits, hidden = prefill(model, cache, PROMPT[None], (-1,))
    plain = model(PROMPT[None], output_hidden_states=True)
    torch.testing.assert_close(logits, plain.logits[0, -1], atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden[0], plain.hidden_states[-1][0], atol=1e-5, rtol=0)
    assert cache.get_seq_length() == PROMPT.numel()


@pytest.mark.parametrize("path", [[0], [0, 2, 6], [0, 1, 3, 5, 7], [0, 8]])
@torch.no_grad()
def test_compacted_cache_equals_fresh_prefill(model: Any, path: list[int]) -> None:
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    tree_forward(model, cache, _block(), PARENTS, PROMPT.numel())
    compact_cache(cache, PROMPT.numel(), torch.tensor(path))
    accepted = _path_sequence(path)
    assert cache.get_seq_length() == accepted.numel()

    fresh = new_cache(model)
    prefill(model, fresh, accepted[None])
    layers: list[tuple[Any, Any]] = list(zip(cache.layers, fresh.layers, strict=True))
    for kept, reference in layers:
        torch.testing.assert_close(kept.keys, reference.keys, atol=1e-5, rtol=0)
        torch.testing.assert_close(kept.values, reference.values, atol=1e-5, rtol=0)

    next_token = torch.tensor([[11]])
    after_compaction, _ = prefill(model, cache, next_token)
    plain = model(torch.cat([accepted, next_token[0]])[None]).logits[0, -1]
    torch.testing.assert_close(after_compaction, plain, atol=1e-5, rtol=0)


@torch.no_grad()
def test_crop_rolls_back_to_an_earlier_state(model: Any) -> None:
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    first, _ = tree_forward(model, cache, _block(), PARENTS, PROMPT.numel())
    crop_cache(cache, PROMPT.numel())
    again, _ = tree_forward(model, cache, _block(), PARENTS, PROMPT.numel())
    torch.testing.assert_close(first, again, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="cannot crop"):
        crop_cache(cache, 10_000)


@torch.no_grad()
def test_tree_forward_refuses_a_stale_prefix() -> None:
    model = tiny_model("llama")
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    with pytest.raises(ValueError, match="cache holds 7 tokens"):
        tree_forward(model, cache, _block(), PARENTS, PROMPT.numel() - 1)
    with pytest.raises(ValueError, match="root followed by every node"):
        tree_forward(model, cache, _block()[:, :3], PARENTS, PROMPT.numel())


def test_the_cache_goes_by_the_name_each_forward_takes() -> None:
    """transformers renamed ``past_key_values`` to ``cache`` (5.2x; the old name warns until
    5.40): each module gets the name its own ``forward`` declares, so no deprecation warning is
    raised where the new name exists and older versions keep working."""
    import inspect
    import warnings

    from headway.decode.kv import cache_argument

    class OldStyle(torch.nn.Module):
        def forward(self, x: torch.Tensor, past_key_values: Any = None) -> torch.Tensor:
            return x

    class KeywordsOnly(torch.nn.Module):
        def forward(self, *args: Any, **kwargs: Any) -> None:
            return None

    model = tiny_model("llama")
    takes_cache = "cache" in inspect.signature(type(model).forward).parameters
    assert cache_argument(model, None) == {"cache" if takes_cache else "past_key_values": None}
    assert cache_argument(OldStyle(), None) == {"past_key_values": None}
    assert cache_argument(KeywordsOnly(), None) == {"past_key_values": None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # a deprecated name would raise here
        cache = new_cache(model)
        prefill(model, cache, torch.tensor([[1, 2, 3]]))
        tree_forward(model, cache, torch.tensor([[4, 5, 6]]), torch.tensor([-1, 0]), 3, ())
