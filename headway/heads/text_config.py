"""A target's text config read as one set of sizes, where its layers differ.

A draft layer copies one attention and MLP shape and one rotary setting from its target
(:meth:`~headway.heads.eagle.EagleConfig.from_target`). Some 2026 targets configure layers
differently: Gemma 4's full-attention layers have another ``head_dim`` than its sliding ones
(transformers then refuses the global attribute with ``AmbiguousGlobalPerLayerAttributeError``),
Gemma 3n lists an ``intermediate_size`` per layer, and Gemma 3/4 keep one ``rope_parameters`` per
layer type. The draft layer takes what most of the
target's layers take (``tests/test_families.py``: an EAGLE-3 drafter on a Gemma 4 target).
"""

from __future__ import annotations

from typing import Any

__all__ = ["majority_rope", "uniform_attr"]


def uniform_attr(text: Any, name: str) -> Any:
    """``text.<name>`` (None where absent), a size; for a config whose layers differ in it (a
    list with one value per layer, Gemma 3n's ``intermediate_size``, or a per-layer attribute,
    Gemma 4's ``head_dim``), the value most layers take (the earliest layer's among equals)."""
    try:
        value = getattr(text, name, None)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        value = [getattr(layer, name) for layer in text.per_layer_config]
    if isinstance(value, (list, tuple)) and value:
        values = list(value)
        return max(values, key=values.count)
    return value


def majority_rope(text: Any) -> dict[str, Any]:
    """The target's ``rope_parameters`` (``{}`` without them); where they are kept per layer
    type (``{"sliding_attention": {...}, "full_attention": {...}}``), the set of the type most
    layers have."""
    rope = uniform_attr(text, "rope_parameters") or {}
    types = list(getattr(text, "layer_types", None) or [])
    if rope and all(isinstance(value, dict) for value in rope.values()):
        common = max(types, key=types.count) if types else next(iter(rope))
        return dict(rope.get(common) or next(iter(rope.values())))
    return dict(rope)
