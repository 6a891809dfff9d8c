"""Tree attention on a stock Hugging Face causal LM, and KV-cache compaction.

No modeling code is forked: the verify forward passes the unmodified model a 4-D additive
attention mask ``[1, 1, n + 1, prefix_len + n + 1]`` (0 = attend, ``finfo(dtype).min`` =
blocked) and ``position_ids = prefix_len + depth`` over its ``DynamicCache`` (transformers returns
a 4-D mask untouched, and both sdpa and eager add it to the attention scores). Afterwards the
cache still holds the keys/values of the *whole* block; :func:`compact_cache` keeps the prefix and
the accepted path only, so the next step sees exactly what a fresh prefill would have produced.

Exact in fp32: tree logits equal per-path logits to ~1e-6 (Llama, Qwen2, GPT-2; sdpa and eager).

Sliding-window targets (Mistral, Gemma 2/3, ...) decode past their window too, and chunked ones
(Llama 4) past their first chunk: the cache keeps every key of such a layer (a plain
``DynamicLayer``, never cropped), and the tree mask closes what the layer type leaves out
(:mod:`headway.decode.local_attention`).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
import transformers.cache_utils
from torch import Tensor
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from headway.decode.gemm import gemm_route, routed_linears
from headway.decode.local_attention import windowed_masks
from headway.decode.tree import ancestor_mask, depths
from headway.errors import TargetError

__all__ = [
    "DUMMY_LAYER",
    "cache_argument",
    "check_tree_decodable",
    "compact_cache",
    "context_limit",
    "crop_cache",
    "new_cache",
    "prefill",
    "recurrent_layer",
    "tree_attention_mask",
    "tree_forward",
]

DUMMY_LAYER: type | None = getattr(transformers.cache_utils, "DummyLayer", None)
"""transformers' layer that holds nothing (Gemma 3n's layers that reuse an earlier layer's
keys/values, which the forward hands them itself); None in a transformers without one."""

# Layers whose keys/values are plain `[batch, kv_heads, seq, head_dim]` tensors we may re-index
# (exact types: subclasses such as quantized or offloaded layers keep extra state), and dummies.
_SUPPORTED_LAYERS = tuple(
    kind for kind in (DynamicLayer, DynamicSlidingWindowLayer, DUMMY_LAYER) if kind is not None
)


def cache_argument(module: torch.nn.Module, cache: DynamicCache | None) -> dict[str, Any]:
    """``{"cache": cache}`` for modules whose ``forward`` names the KV cache ``cache``
    (transformers >= 5.2x, where ``past_key_values`` is deprecated and goes in 5.40), else
    ``{"past_key_values": cache}`` (earlier 5.x, GPT-2-style and remote-code models)."""
    forward = type(module).forward
    keyword = _CACHE_KEYWORDS.get(forward)
    if keyword is None:  # read once per forward function: this runs on every forward
        keyword = _CACHE_KEYWORDS[forward] = _cache_keyword(forward)
    return {keyword: cache}


_CACHE_KEYWORDS: dict[Callable[..., Any], str] = {}
"""The cache keyword of each forward function seen (a plain dict, not ``functools.cache``,
which ``torch.compile`` warns it traces through: the compiled draft forward calls this)."""


def _cache_keyword(forward: Callable[..., Any]) -> str:
    try:
        names = inspect.signature(forward).parameters
    except (TypeError, ValueError):  # a forward without a readable signature
        return "past_key_values"
    return "cache" if "cache" in names else "past_key_values"


def context_limit(model: PreTrainedModel) -> int:
    """Longest sequence (prompt + output) the model's position table allows; unbounded if the
    config names none."""
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit) if limit else sys.maxsize


def new_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty ``DynamicCache`` for ``model`` (:func:`check_tree_decodable`); its
    sliding-window layers keep every key, so the tree mask can index the whole prefix."""
    cache = DynamicCache(config=model.config)
    _check_layers(model, cache)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[index] = DynamicLayer()
    return cache


def check_tree_decodable(model: PreTrainedModel) -> None:
    """Refuse a target whose cache holds more than keys/values (Mamba and linear-attention
    layers: Qwen3-Next, Qwen3.5, Falcon-H1, Nemotron-H, ...; DeepSeek-V3.2's indexer keys): a
    tree verified in one forward needs every layer's state per block entry, re-indexed to the
    accepted path, and a recurrent state is one running summary of the sequence, which a tree's
    branches would share.

    Raises:
        TargetError: one line naming the first such layer and the model type.
    """
    _check_layers(model, DynamicCache(config=model.config))


def recurrent_layer(model: PreTrainedModel, cache: DynamicCache | None = None) -> str | None:
    """``"this <model type> target ... its layer i keeps a <kind> state"``: the first layer of
    ``model``'s cache (``cache``, default a new one) that holds more than keys/values, named for
    an error message; None when every layer holds keys/values alone."""
    layers = (cache if cache is not None else DynamicCache(config=model.config)).layers
    for index, layer in enumerate(layers):
        if type(layer) not in _SUPPORTED_LAYERS:
            kind = getattr(model.config, "model_type", type(model).__name__)
            return f"this {kind} target: its layer {index} keeps a {type(layer).__name__} state"
    return None


def _check_layers(model: PreTrainedModel, cache: DynamicCache) -> None:
    found = recurrent_layer(model, cache)
    if found is not None:
        raise TargetError(
            f"{found}, not keys/values alone, and headway verifies drafts as trees whose "
            "keys/values it re-indexes to the accepted path (a recurrent state cannot branch, "
            "and other states are not re-indexed): it cannot be tree-decoded; decode it "
            "without headway, or pick a target whose layers keep keys/values only"
        )


def tree_attention_mask(
    parents: Tensor, prefix_len: int, *, dtype: torch.dtype, device: torch.device
) -> Tensor:
    """Additive mask ``[1, 1, n + 1, prefix_len + n + 1]``: every block entry sees the prefix and
    its ancestors (:func:`headway.decode.tree.ancestor_mask`), nothing else."""
    visible = ancestor_mask(parents).to(device)
    mask = torch.zeros(visible.shape[0], prefix_len + visible.shape[0], dtype=dtype, device=device)
    mask[:, prefix_len:].masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def _hidden(outputs: Any, hidden_layers: tuple[int, ...]) -> tuple[Tensor, ...]:
    """Selected ``output_hidden_states`` entries of batch row 0, each ``[seq, H]``."""
    return tuple(outputs.hidden_states[layer][0] for layer in hidden_layers)


def prefill(
    model: PreTrainedModel, cache: DynamicCache, ids: Tensor, hidden_layers: tuple[int, ...] = ()
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Run ``ids [1, P]`` through ``model`` on top of ``cache`` (usually empty) with a plain
    causal mask, its linear layers on the model's GEMM route (:func:`routed_linears`: on a CPU
    where ``--gemm auto`` chose packed, a prompt of 180 tokens took 147 ms against 290 stock).

    Returns:
        logits ``[V]`` at the last position (only that row goes through the LM head) and, for
        every index in ``hidden_layers`` (into ``output_hidden_states``), the hidden states
        ``[P, H]`` of all P positions.
    """
    start = cache.get_seq_length()
    device = model.device
    end = start + ids.shape[1]
    position_ids = torch.arange(start, end, device=device)[None]
    with routed_linears(model):  # the model's route (packed: blocks up to 512 rows), as verifies
        outputs = model(
            input_ids=ids.to(device),
            # An explicit all-ones mask: a generated id that equals pad_token_id is a real token
            # (without a mask GPT-2 scans the ids for pad tokens on every call just to warn).
            attention_mask=torch.ones(1, end, dtype=torch.long, device=device),
            position_ids=position_ids,
            **cache_argument(model, cache),
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
            logits_to_keep=1,
        )
    return outputs.logits[0, -1], _hidden(outputs, hidden_layers)


def tree_forward(
    model: PreTrainedModel,
    cache: DynamicCache,
    root_and_tree_tokens: Tensor,
    parents: Tensor,
    prefix_len: int,
    hidden_layers: tuple[int, ...] = (),
) -> tuple[Tensor, tuple[Tensor, ...]]:
    """Verify a whole draft tree in ONE forward.

    Args:
        root_and_tree_tokens: LongTensor ``[1, n + 1]``, the root then the drafted nodes.
        parents: LongTensor ``[n]``, the tree's parent array (see :mod:`headway.decode.tree`).
        prefix_len: tokens already in ``cache``; must equal ``cache.get_seq_length()``.
        hidden_layers: indices into ``output_hidden_states``; () skips collecting them.
        The linear layers take the route applied to ``model``
        (:func:`headway.decode.gemm.gemm_route`); a 1-token block takes stock unless the route
        is ``"packed"``.

    Returns:
        logits ``[n + 1, V]`` (row b predicts the token after block entry b) and one
        ``[n + 1, H]`` tensor per requested hidden layer. The cache grows by n + 1 entries;
        call :func:`compact_cache` once the accepted path is known.
    """
    cached = cache.get_seq_length()
    if cached != prefix_len:
        raise ValueError(
            f"prefix_len={prefix_len} but the cache holds {cached} tokens; the cache must hold "
            "exactly the committed tokens before the root (compact or crop it first)"
        )
    size = root_and_tree_tokens.shape[1]
    if size != parents.numel() + 1:
        raise ValueError(
            f"root_and_tree_tokens has {size} entries but parents describes "
            f"{parents.numel()} nodes; pass the root followed by every node"
        )
    device = model.device
    mask: Tensor | dict[str, Tensor]
    if is_chain(parents):
        # A chain's ancestor mask is the causal mask: take the model's own (fast) causal path.
        mask = torch.ones(1, prefix_len + size, dtype=torch.long, device=device)
        position_ids = torch.arange(prefix_len, prefix_len + size, device=device)[None]
    else:
        positions = depths(parents) + prefix_len
        mask = windowed_masks(
            model,
            tree_attention_mask(parents, prefix_len, dtype=model.dtype, device=device),
            positions,
            prefix_len,
        )
        position_ids = positions.to(device)[None]
    route = gemm_route(model)
    routed = size > 1 or route == "packed"  # transposed: a single row stays stock
    with routed_linears(model, route if routed else "stock"):
        outputs = model(
            input_ids=root_and_tree_tokens.to(device),
            attention_mask=mask,  # a tensor, or one per layer type (windowed_masks)
            position_ids=position_ids,
            **cache_argument(model, cache),
            use_cache=True,
            output_hidden_states=bool(hidden_layers),
        )
    return outputs.logits[0], _hidden(outputs, hidden_layers)


def is_chain(parents: Tensor) -> bool:
    """True when node i's parent is node i - 1 for every node (the empty tree included)."""
    count = parents.numel()
    return count == 0 or torch.equal(parents.cpu(), torch.arange(-1, count - 1))


def _set_length(layer: Any, length: int) -> None:
    """Keep the first ``length`` sequence entries of one layer (a view, no copy). ``Any``: HF's
    cache layer classes type their keys and values as optional."""
    layer.keys = layer.keys[..., :length, :]
    layer.values = layer.values[..., :length, :]
    if hasattr(layer, "cumulative_length"):  # sliding-window layers track their length apart
        layer.cumulative_length = length


def compact_cache(cache: DynamicCache, prefix_len: int, keep: Tensor) -> None:
    """Shrink the cache after a tree forward to the prefix plus the accepted path.

    ``keep`` is LongTensor ``[k]`` of block indices in increasing order, root (0) first. Entry
    ``prefix_len + keep[j]`` moves to ``prefix_len + j`` in every layer, then the tail is dropped,
    leaving ``prefix_len + k`` entries, equal to a fresh prefill of prefix + root + accepted nodes
    (positions match because an accepted path has depths 0..k-1). Only k rows per layer are
    copied; ``keep[j] >= j`` so the gather never reads a row it has already overwritten. The
    copy is in place, so call it under the same grad mode as the forward (a cache filled under
    ``torch.inference_mode`` can only be modified there).
    """
    contiguous = int(keep[-1]) == keep.numel() - 1  # increasing from 0: the path 0..k-1
    for layer in cache.layers:
        if _holds_keys(layer):
            if contiguous:
                _set_length(layer, prefix_len + keep.numel())  # nothing moves: just crop
            else:
                _compact_layer(layer, prefix_len, keep)


def _compact_layer(layer: Any, prefix_len: int, keep: Tensor) -> None:
    count = keep.numel()
    source = keep.to(layer.keys.device) + prefix_len
    target = slice(prefix_len, prefix_len + count)
    layer.keys[..., target, :] = layer.keys.index_select(-2, source)
    layer.values[..., target, :] = layer.values.index_select(-2, source)
    _set_length(layer, prefix_len + count)


def crop_cache(cache: DynamicCache, length: int) -> None:
    """Roll the cache back to its first ``length`` entries (e.g. to re-decode from there).

    Used instead of ``DynamicCache.crop`` because its argument changed meaning across
    transformers versions (absolute length before 5.x, a negative count of tokens to drop now).
    """
    if length < 0 or length > cache.get_seq_length():
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} tokens to {length}")
    for layer in cache.layers:
        if _holds_keys(layer):
            _set_length(layer, length)


def _holds_keys(layer: Any) -> bool:
    """Whether a cache layer holds keys/values (not one yet unwritten, nor a ``DummyLayer``)."""
    return bool(getattr(layer, "is_initialized", True)) and getattr(layer, "keys", None) is not None
