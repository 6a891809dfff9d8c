"""Layers that attend to part of the sequence only: sliding windows and attention chunks.

headway hands a stock model its own 4-D masks (the tree's, the static cache's, the batched
steps'), and transformers uses a 4-D mask as given: what a layer type leaves out, the mask
must leave out too. Two kinds of layers do:

- **sliding** (``sliding_attention``: Mistral, Gemma 2/3, GPT-OSS, ...): a query at position
  ``p`` sees the keys at ``p - window < k <= p``;
- **chunked** (``chunked_attention``: Llama 4, whose RoPE layers attend within chunks of
  ``attention_chunk_size`` = 8,192 tokens): a query at ``p`` sees the keys of its own chunk,
  ``k // chunk == p // chunk``, ``k <= p`` (transformers' ``create_chunked_causal_mask``).

While no key a mask opens is one of these layers' blocked keys the mask is returned as it is;
past that, a model whose layers are all of one local kind gets the blocked mask, and a model that
mixes kinds gets one mask per layer type (transformers' ``causal_mask_mapping``), or a one-line
refusal where its forward takes a single mask. The cache keeps every key either way (a sliding
layer's is not cropped), so the masks can index the whole prefix.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch
from torch import Tensor
from transformers import PreTrainedModel

from headway.errors import SlidingWindowError

__all__ = [
    "attention_chunk",
    "has_local_attention",
    "local_masks",
    "mask_types",
    "mixes_with_one_mask",
    "rows_local_masks",
    "sliding_window",
    "takes_mask_mapping",
    "windowed_masks",
]

SLIDING, CHUNKED, FULL = "sliding_attention", "chunked_attention", "full_attention"


def sliding_window(model: PreTrainedModel) -> tuple[int | None, bool]:
    """``(window, mixed)``: the target's attention window (``None`` without one) and whether
    it mixes sliding and full-attention layers (``config.layer_types``)."""
    config = model.config.get_text_config()
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if not window or (types is not None and SLIDING not in types):
        return None, False
    return int(window), types is not None and any(kind != SLIDING for kind in types)


def attention_chunk(model: PreTrainedModel) -> int | None:
    """The chunk of the target's ``chunked_attention`` layers (``None`` without such layers)."""
    config = model.config.get_text_config()
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or ()
    return int(chunk) if chunk and CHUNKED in types else None


def has_local_attention(model: PreTrainedModel) -> bool:
    """Whether some layer of the target sees part of the sequence only (module docstring)."""
    return sliding_window(model)[0] is not None or attention_chunk(model) is not None


def _layer_types(model: PreTrainedModel) -> tuple[str, ...]:
    """The distinct layer types of the target, in layer order (``("",)`` when its config names
    none: one kind on every layer)."""
    types = getattr(model.config.get_text_config(), "layer_types", None)
    return tuple(dict.fromkeys(types)) if types else ("",)


def mask_types(model: PreTrainedModel) -> tuple[str, ...]:
    """The mask inputs a static forward keeps for the target: one per layer type for a model
    with local layers among others that takes one mask per type, else ``("",)``, one mask."""
    types = _layer_types(model)
    if has_local_attention(model) and len(types) > 1 and takes_mask_mapping(model):
        return types
    return ("",)


def takes_mask_mapping(model: PreTrainedModel) -> bool:
    """The model's forward accepts one mask per layer type (transformers' ``causal_mask_mapping``
    convention, read off the decoder's source: there is no flag for it). The decoder is the
    base model, or a child of the model where that names the model itself (Llama 4's
    ``Llama4ForCausalLM`` holds its ``Llama4TextModel`` as ``model``)."""
    decoders = [model.base_model, *model.children()]
    return any(_forward_takes_mask_mapping(type(module).forward) for module in decoders)


@functools.cache
def _forward_takes_mask_mapping(forward: Callable[..., object]) -> bool:
    """Read once per forward function: this runs on every tree step past the window."""
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return False
    return "causal_mask_mapping := attention_mask, dict" in source


def windowed_masks(
    model: PreTrainedModel, mask: Tensor, positions: Tensor, prefix_len: int
) -> Tensor | dict[str, Tensor]:
    """The tree ``mask`` ``[1, 1, q, prefix_len + q]`` for a model with local layers, whose
    block entries sit at ``positions`` ``[q]`` after the prefix's ``0 .. prefix_len - 1``: see
    :func:`local_masks`.

    Raises:
        SlidingWindowError: a mixed model whose forward takes a single mask only.
    """
    keys = torch.cat([torch.arange(prefix_len, device=positions.device), positions])
    return local_masks(
        model, mask, positions[:, None].to(mask.device), keys.to(mask.device), "tree decoding"
    )


def local_masks(
    model: PreTrainedModel,
    mask: Tensor,
    queries: Tensor,
    keys: Tensor,
    doing: str,
    always: bool = False,
) -> Tensor | dict[str, Tensor]:
    """An additive ``mask`` ``[..., q, k]`` for the target's layer types, given the queries'
    positions ``queries`` ``[..., q, 1]`` and the keys' ``keys`` ``[k]`` (broadcastable to
    ``mask``): unchanged while no local layer blocks a key; past that, the blocked keys closed
    for the local layers (the whole mask when every layer is of one local kind, a per-type
    mapping for a mixed model). ``always``: closed whether or not a key is blocked, without
    reading the device (a CUDA graph's shapes and outputs stay those of every step). ``doing``
    names the work in the error.

    Raises:
        SlidingWindowError: a mixed model whose forward takes a single mask only.
    """
    window, _ = sliding_window(model)
    chunk = attention_chunk(model)
    if window is None and chunk is None:
        return mask
    blocked: dict[str, Tensor] = {}
    if window is not None:
        blocked[SLIDING] = queries - keys >= window
    if chunk is not None:  # an earlier key of another chunk (later keys are closed anyway)
        apart = torch.div(queries, chunk, rounding_mode="floor") != torch.div(
            keys, chunk, rounding_mode="floor"
        )
        blocked[CHUNKED] = apart & (keys <= queries)
    if not always:
        blocked = {kind: where for kind, where in blocked.items() if bool(where.any())}
    if not blocked:
        return mask
    closed = {
        kind: mask.masked_fill(where, torch.finfo(mask.dtype).min)
        for kind, where in blocked.items()
    }
    types = _layer_types(model)
    if types == ("",) or len(types) == 1:  # one kind on every layer
        return next(iter(closed.values()))
    if not takes_mask_mapping(model):
        raise SlidingWindowError(_one_mask_only(model, window, chunk, doing))
    return {kind: closed.get(kind, mask) for kind in types}


def rows_local_masks(
    model: PreTrainedModel, mask: Tensor, positions: Tensor, starts: Tensor, keys: Tensor
) -> dict[str, Tensor]:
    """A batch's block mask ``[B, 1, S, W]`` as the target's mask inputs (``{"": mask}`` for
    one): itself, or for a target with sliding or chunked layers the keys those layers leave
    out closed too, one mask per layer type for a mixed one (:func:`local_masks` on the device
    only, so a CUDA graph holds it). Row ``b``'s columns (``keys [W]``, their indices) before
    ``starts[b]`` hold the positions of their index, its block's the ``positions [B, S]`` of
    its entries, from ``starts[b]`` on."""
    if not has_local_attention(model):
        return {"": mask}
    size = positions.shape[1]
    offset = keys - starts[:, None]  # [B, W]: each column's place in the row's block
    inside = (offset >= 0) & (offset < size)
    placed = positions.gather(1, offset.clamp(0, size - 1))
    columns = torch.where(inside, placed, keys.expand_as(offset))  # each column's position
    queries, held = positions[:, None, :, None], columns[:, None, None, :]
    local = local_masks(model, mask, queries, held, "batched decoding", always=True)
    return local if isinstance(local, dict) else {"": local}


def mixes_with_one_mask(model: PreTrainedModel) -> bool:
    """Whether the target mixes local and full layers but its forward takes one mask for all
    (what :func:`rows_local_masks` cannot serve)."""
    return (
        has_local_attention(model)
        and len(_layer_types(model)) > 1
        and not takes_mask_mapping(model)
    )


def _one_mask_only(
    model: PreTrainedModel, window: int | None, chunk: int | None, doing: str
) -> str:
    name = type(model).__name__
    if window is not None:
        return (
            f"{name} mixes sliding-window ({window} tokens) and full attention but takes one "
            f"mask for both; {doing} past the window is not supported: keep prompt + "
            f"--max-new-tokens under {window}"
        )
    return (
        f"{name} mixes chunked ({chunk}-token chunks) and full attention but takes one mask "
        f"for both; {doing} past the first chunk is not supported: keep prompt + "
        f"--max-new-tokens under {chunk}"
    )
