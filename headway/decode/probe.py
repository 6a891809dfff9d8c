"""A mask probe at load: does this model honour headway's 4-D tree mask?

Tree verification passes a 4-D additive mask and explicit positions to the stock model. A model
whose attention ignores that mask (a custom kernel, a wrapper that drops it, remote code that
builds its own causal mask) would verify a tree as if it were one sequence and silently change
the output. So before any decoding, one tiny tree (two branches of two tokens after a short
prefix) is verified in one forward and compared with each branch decoded on its own; a
disagreement, or a cache headway cannot compact, is refused in one line.

A difference alone does not condemn a model: in bf16 the tree forward and the plain ones round
differently (the real SmolLM2 in bf16 on an AVX-512 EPYC: 0.28 logit standard deviations at
worst where the mask is honoured). So the tree's difference is also weighed against a forward of
the same tokens at the tree's positions under a plain causal mask, which is what a model
ignoring the mask computes: a model is refused where its tree differs by more than
:func:`_tolerance` and by more than :data:`RELATIVE` of what ignoring the mask gives.

Cost: a prefill of 4 tokens, one 5-token tree forward, two 6-token and one 9-token plain
forwards, once per process and model.
"""

from __future__ import annotations

import weakref

import torch
from transformers import PreTrainedModel

from headway.decode.kv import new_cache, prefill, tree_forward
from headway.decode.tree import depths, root_to_leaf_paths
from headway.errors import TargetError

__all__ = ["check_tree_mask"]

_PREFIX = (1, 7, 3, 5)
_BLOCK = (4, 9, 8, 6, 2)  # root, then two branches of two: 9 -> 8 and 6 -> 2
_PARENTS = (-1, 0, -1, 2)
_CHECKED: weakref.WeakSet[PreTrainedModel] = weakref.WeakSet()


RELATIVE = 0.5
"""A tree forward differing from the paths by at least this share of the plain causal forward's
difference is taken for one that ignores the mask (ignoring it, the share is ~1)."""


def _tolerance(dtype: torch.dtype) -> float:
    """Differences up to this many logit standard deviations pass without further question (for
    scale, ignoring the mask moves SmolLM2's logits by 1.7 in bf16, tiny random models' by
    0.4-1.3)."""
    return 1e-3 if dtype == torch.float32 else 0.05


def _alibi(model: PreTrainedModel) -> bool:
    """Whether the target adds ALiBi biases (MPT's ``attn_config.alibi``, Falcon's ``alibi``;
    BLOOM always, refused where its forward fails on a 4-D mask)."""
    config = model.config.get_text_config()
    attention = getattr(config, "attn_config", None)
    return bool(getattr(config, "alibi", False) or getattr(attention, "alibi", False))


def _gap(logits: torch.Tensor, expected: torch.Tensor, scale: torch.Tensor) -> float:
    """The largest difference of ``logits`` from ``expected`` (both ``[positions, V]``) in units of
    ``scale``."""
    return float((logits.float() - expected).abs().max() / scale)


@torch.inference_mode()
def check_tree_mask(model: PreTrainedModel) -> None:
    """Refuse ``model`` if a tree forward with headway's mask differs from plain decoding of the
    same paths (logits compared at every tree position, relative to their standard deviation).

    Raises:
        TargetError: the model ignores the 4-D mask, or its cache cannot be re-indexed.
    """
    if model in _CHECKED:
        return
    if _alibi(model):
        raise TargetError(
            f"this {model.config.model_type} target adds ALiBi position biases, which "
            "transformers computes from each key's place in the cache, not from position_ids: "
            "a tree's branches would see wrong distances, so it cannot be tree-decoded"
        )
    device = next(model.parameters()).device
    vocab = int(model.get_output_embeddings().weight.shape[0])
    prefix = torch.tensor([_PREFIX], device=device) % vocab
    block = torch.tensor([_BLOCK], device=device) % vocab
    parents = torch.tensor(_PARENTS)
    cache = new_cache(model)  # TargetError for a target with recurrent layers
    prefill(model, cache, prefix)
    try:
        logits, _ = tree_forward(model, cache, block, parents, prefix.shape[1])
    except (ValueError, RuntimeError, TypeError, IndexError, AssertionError) as error:  # BLOOM
        first = str(error).splitlines()[0][:160] if str(error) else ""
        raise TargetError(
            f"this {getattr(model.config, 'model_type', type(model).__name__)} target's forward "
            f"fails on headway's 4-D tree attention mask ({type(error).__name__}: {first}); "
            "tree decoding needs a model whose attention takes a 4-D mask"
        ) from None
    at_tree = prefix.shape[1] + depths(parents).to(device)  # the positions tree_forward gives
    positions = torch.cat([torch.arange(prefix.shape[1], device=device), at_tree])
    ignoring = model(input_ids=torch.cat([prefix, block], dim=1), position_ids=positions[None])
    causal = ignoring.logits[0, prefix.shape[1] :]  # the tree's positions, a causal mask
    worst = ignored = 0.0
    for path in root_to_leaf_paths(parents):
        sequence = torch.cat([prefix[0], block[0, torch.tensor(path, device=device)]])[None]
        plain = model(input_ids=sequence).logits[0, prefix.shape[1] :]
        expected = plain.float()
        scale = expected.std().clamp_min(1e-6)  # relative to the logits' own spread
        worst = max(worst, _gap(logits[path], expected, scale))
        ignored = max(ignored, _gap(causal[path], expected, scale))
    if worst > _tolerance(logits.dtype) and worst > RELATIVE * ignored:
        raise TargetError(
            f"this target ignores headway's 4-D tree attention mask (a tree forward differs from "
            f"decoding each path by {worst:.3g} logit standard deviations, a plain causal one by "
            f"{ignored:.3g}); load it with attn_implementation='eager' or 'sdpa', or use a model "
            "whose attention takes a 4-D mask"
        )
    if worst > _tolerance(logits.dtype) and logits.dtype == torch.float32:
        raise TargetError(  # no rounding of fp32 comes near: the tree itself is seen otherwise
            f"this target's tree forward differs from decoding each path by {worst:.3g} logit "
            f"standard deviations in float32, where rounding stays under "
            f"{_tolerance(logits.dtype):g} (its attention reads something a tree changes besides "
            "the mask and position_ids, e.g. ALiBi biases from each key's place in the cache): "
            "headway cannot decode it losslessly"
        )
    _CHECKED.add(model)
