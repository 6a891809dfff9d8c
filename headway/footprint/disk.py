"""Disk of an offline feature cache, and the time a regeneration takes.

The layout is :func:`headway.train.features.cache_features`' (one safetensors entry per sample
and column): ``input_ids`` int32 and ``loss_mask`` int8 per token, the hidden states of each
cached layer ``[T, H]`` in the cache's dtype (bf16 by default), and for EAGLE-3 the target's
argmax per token (int32). Layers: the last for Medusa-1/EAGLE-1, EAGLE-3's three taps and the
last (the four ``headway data cache-features --method eagle3`` writes). Each entry also costs
its safetensors header line, counted per sample.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "HEADER_BYTES_PER_ENTRY",
    "FeatureCacheSize",
    "feature_cache_size",
    "regeneration_seconds",
]

# One safetensors header entry: '"123.hidden.27":{"dtype":"BF16","shape":[300,576],
# "data_offsets":[0,345600]},' is ~80 bytes; rounded up for longer keys and offsets.
HEADER_BYTES_PER_ENTRY = 96
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


@dataclass(frozen=True)
class FeatureCacheSize:
    """Bytes of a feature cache: ``per_token`` (data), ``per_sample`` (header entries) and the
    total for ``tokens`` tokens in ``samples`` samples."""

    layers: tuple[int, ...]
    dtype: str
    per_token: int
    per_sample: int
    tokens: int
    samples: int

    @property
    def total(self) -> int:
        return self.tokens * self.per_token + self.samples * self.per_sample


def feature_cache_size(
    *,
    hidden_size: int,
    layers: tuple[int, ...],
    argmax: bool,
    tokens: int,
    sample_tokens: int,
    dtype: str = "bfloat16",
) -> FeatureCacheSize:
    """The cache of ``tokens`` tokens cut in samples of ``sample_tokens`` (the last partly full).

    Example: Llama-3.1-8B (H = 4096), EAGLE-3 (4 layers), bf16: ``4 · 4096 · 2 + 4 + 1 + 4 =
    32,777`` bytes per token, 268.5 MB per 8,192-token sample.
    """
    if dtype not in _DTYPE_BYTES:
        raise ValueError(f"feature dtype {dtype!r}: use one of {', '.join(_DTYPE_BYTES)}")
    entries = 2 + len(layers) + (1 if argmax else 0)  # ids, mask, hidden.L..., argmax
    per_token = 4 + 1 + len(layers) * hidden_size * _DTYPE_BYTES[dtype] + (4 if argmax else 0)
    samples = -(-tokens // max(sample_tokens, 1))
    return FeatureCacheSize(
        layers=layers,
        dtype=dtype,
        per_token=per_token,
        per_sample=entries * HEADER_BYTES_PER_ENTRY,
        tokens=tokens,
        samples=samples,
    )


def regeneration_seconds(tokens: int, tokens_per_s: float, processes: int) -> float:
    """Seconds to regenerate ``tokens`` answer tokens when each of ``processes`` answers its own
    shards at ``tokens_per_s`` (``headway data regenerate`` under ``accelerate launch``)."""
    if tokens_per_s <= 0 or processes < 1:
        raise ValueError("tokens_per_s must be > 0 and processes >= 1")
    return tokens / (tokens_per_s * processes)
