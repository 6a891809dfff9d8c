"""Activation memory of one training micro-batch, estimated from shapes (no tensor is made).

Each method's estimate lists the tensors alive at the step's peak in headway's own code paths,
named by what makes them, so a figure can be traced to the code that allocates it:

- *target forward* (online features): ``output_hidden_states`` keeps every layer's
  ``[B, T, H]`` until the forward returns, beside one layer's working tensors (the MLP's
  ``[B, T, I]`` products) and the packed 4-D mask ``[B, 1, T, T]``;
- *drafter forward and loss*: what autograd saves for the backward pass (per row and draft
  layer: norm outputs, residual sums, the query as SDPA reads it, its output, the MLP's four
  ``[I]`` products; per attention call: the mask and the keys/values SDPA keeps) and what the
  loss holds at its end (logits, the target's distribution);
- *backward*, where it holds more than the forward did (Medusa's stacked ``[K, B, T, V]``
  logits get one full-size gradient per head, summed out of place).

The peak is the larger phase. Batches are taken as full: ``T = data.max_length`` tokens per row
(a packed block, or the longest padded sample), every token trained (EAGLE-3's training-time-test
rows all kept, one sample per block). Real batches hold prompts and several samples, so they
need somewhat less: the estimate bounds a step from above. ``tests/test_footprint.py`` holds it
within 20% of the live tensor bytes of measured steps (every method on a tiny Llama, fp32 and
bf16 autocast; the EAGLE-3 recipe on SmolLM2-135M, fp32); measured here it was within 5% for
EAGLE-1/3 and Medusa-1 on SmolLM2 in both precisions.

Bytes per element: the target's hidden states in its weights' dtype (``weight``); under bf16 or
fp16 autocast, matmul outputs in 2 bytes (``compute``) and one low-precision copy of every
trained weight (autocast's cache); norms, residual sums and loss terms in fp32. Kernel
workspaces (oneDNN, cuBLAS, flash-attention scratch), the allocator's caching and the data
loader are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from headway.footprint.sizes import DrafterSizes, TargetSizes, medusa_rows
from headway.run_config import RunConfig
from headway.train.method_eagle3 import TTT_CHUNK
from headway.train.soft_ce import SOFT_CE_ELEMENTS

__all__ = ["ActivationEstimate", "StepShape", "estimate_activations"]

FP32 = 4


@dataclass(frozen=True)
class StepShape:
    """One micro-batch: ``batch`` rows of ``length`` tokens; ``weight`` bytes per target
    element; ``compute`` bytes per matmul output (2 under bf16/fp16 autocast, else 4);
    ``cached`` bytes per element of an offline feature cache."""

    batch: int
    length: int
    weight: int
    compute: int
    online: bool
    packed: bool
    cached: int = 2

    @property
    def rows(self) -> int:
        return self.batch * self.length

    @property
    def casts_weights(self) -> bool:
        """Autocast makes low-precision copies of fp32 weights for each matmul."""
        return self.compute < FP32 and self.weight != self.compute


@dataclass(frozen=True)
class ActivationEstimate:
    """The peak's phase and its live tensors, ``name -> bytes``."""

    phase: str
    terms: dict[str, int]

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def _target_forward(target: TargetSizes, step: StepShape) -> dict[str, int]:
    """The frozen target's no-grad forward with ``output_hidden_states``: every layer's output
    is held until it returns, beside one layer's largest working set (the MLP's act, up and
    product ``[rows, I]``, or q/k/v and the attention output), the packed additive mask and,
    under autocast over fp32 weights, the LM head's low-precision copy (computed for one row,
    still the whole ``[V, H]`` weight)."""
    rows, hidden = step.rows, target.hidden_size
    attention = (2 * target.num_heads + 2 * target.num_kv_heads) * target.head_dim
    work = max(3 * target.intermediate_size, attention)
    terms = {
        "target hidden states, all layers": (target.num_layers + 1) * rows * hidden * step.weight,
        "target layer work": rows * work * step.compute,
        "target attention mask": step.batch * step.length**2 * (step.weight if step.packed else 1),
    }
    if step.casts_weights:  # the largest weight's autocast copy: the LM head's
        terms["target LM head, autocast copy"] = target.vocab_size * hidden * step.compute
    return terms


def _features(target: TargetSizes, step: StepShape, layers: int) -> int:
    """Bytes of the hidden states handed to the method: fp32 copies of the cache's bf16 (offline)
    or the target's own dtype (online; fp32 copies under autocast)."""
    held = step.weight if step.online and step.compute == FP32 else FP32
    copies = FP32 if held != FP32 else 0  # the method casts bf16 features to its fp32
    cached = 0 if step.online else step.cached  # the batch's cached tensors stay alive
    return layers * step.rows * target.hidden_size * (held + copies + cached)


def _draft_layer(target: TargetSizes, rows: int, step: StepShape, *, eagle3: bool) -> int:
    """Saved bytes of one draft decoder layer (stock Llama pieces) over ``rows`` rows, its
    keys/values apart (they depend on the attention path).

    Per row, fp32: the norms' normalised inputs (EAGLE-3's two input norms and the post-attention
    one; EAGLE-1 has no input norm), the post-attention norm's output (the MLP's input), the two
    residual sums and EAGLE-3's ``[2H]`` concatenation; in the compute dtype: the query as SDPA
    reads it, SDPA's output and its contiguous copy (EAGLE-3's grouped SDPA; EAGLE-1's stock
    SDPA reads the rotated query in place, no copies), the rotary cos/sin and the MLP's gate,
    up, act and product. Linear outputs that only feed a sum (q/k/v before rotation,
    ``o_proj``, ``down_proj``) are not kept."""
    hidden, inter, dim = target.hidden_size, target.intermediate_size, target.head_dim
    fp32 = (3 + 1 + 2 + 2) * hidden if eagle3 else (1 + 1 + 2) * hidden
    compute = (3 if eagle3 else 2) * target.num_heads * dim + 2 * dim + 4 * inter
    return rows * (fp32 * FP32 + compute * step.compute)


def _soft_ce_chunk(rows: int, vocab: int) -> int:
    """The fused soft cross-entropy's working pair of one chunk (``[chunk, V]`` fp32 logits and
    targets; :mod:`headway.train.soft_ce`): a few MB at most, the whole batch for tiny V."""
    return min(rows, max(1, SOFT_CE_ELEMENTS // vocab)) * vocab * 2 * FP32


def _mask(batch: int, queries: int, keys: int, groups: int, element: int) -> int:
    """A 4-D additive mask ``[b, 1, q, k]`` as SDPA keeps it: grouped SDPA
    (:func:`~headway.decode.grouped_attention.packed_sdpa`) keeps a copy repeated for the
    ``groups`` query heads of a key/value head (the mask itself when there is one)."""
    return batch * queries * keys * element * max(groups, 1)


def _eagle3(
    target: TargetSizes, drafter: DrafterSizes, step: StepShape, steps: int
) -> dict[str, int]:
    """:class:`~headway.train.method_eagle3.Eagle3`'s forward and loss at the loss's end.

    Step 0 runs every row over causal keys; steps ``1 .. S-1`` run the kept rows (here all) in
    chunks of ``C = TTT_CHUNK`` rows, each over a window of ``W = T`` step-0 keys plus one key
    per earlier step, so step j makes new keys/values ``[chunks, kv, W + j·C, d]`` (the cache
    grows by concatenation) and a mask ``[chunks, G, C, W + j·C]``. (A batch whose every row
    is kept, e.g. plain-text data trained from its first token, takes the unchunked path, whose
    masks and keys grow with ``T + j·T``: more than this.)"""
    rows, hidden, batch, length = step.rows, target.hidden_size, step.batch, step.length
    vocab, draft_vocab = target.vocab_size, drafter.draft_vocab_size or target.vocab_size
    groups = target.num_heads // target.num_kv_heads
    kv_row = 2 * target.num_kv_heads * target.head_dim * step.compute  # one key and value
    chunk = min(TTT_CHUNK, length)
    chunks = batch * math.ceil(length / chunk)
    kept = chunks * chunk  # rows of each TTT step >= 1
    later = masks = 0
    keys = chunks * length if steps > 1 else 0  # step 1 gathers each chunk's step-0 keys
    for j in range(1, steps):
        width = length + j * chunk
        keys += chunks * width
        later += _draft_layer(target, kept, step, eagle3=True)
        masks += _mask(chunks, chunk, width, groups, step.compute)
    head = step.compute if step.compute != FP32 else step.weight
    scored = vocab if step.online else draft_vocab  # a cache's argmax: the draft columns only
    return {
        "target features (3 taps + last)": _features(target, step, 4),
        "fc input [3H] and output, embeddings": rows * hidden * (4 * FP32 + step.compute),
        "draft layer, step 0": _draft_layer(target, rows, step, eagle3=True) + rows * kv_row,
        "attention masks, step 0": _mask(batch, length, length, groups, step.compute)
        + batch * length**2,
        "draft layer, TTT steps 1..": later + (kept * hidden * FP32 if steps > 1 else 0),
        "TTT keys/values (the grown cache)": keys * kv_row,
        "TTT attention masks": masks,
        "TTT step states [B, T, H]": (steps - 1) * rows * hidden * FP32,
        "target logits (no grad)": rows * scored * head,
        "target distribution [n, N]": rows * draft_vocab * (head + FP32),
        "draft logits [n, N] per step": steps
        * rows
        * (draft_vocab * step.compute + 3 * hidden * FP32),
        "soft cross-entropy chunk": _soft_ce_chunk(rows, draft_vocab),
    }


def _eagle1(target: TargetSizes, step: StepShape) -> dict[str, int]:
    """:class:`~headway.train.method_eagle.Eagle1`: stock SDPA keeps the rotated keys and the
    values (repeated for each query head of a group when heads are grouped); the loss holds the
    draft logits, the target's logits and its softmax, all ``[n, V]``."""
    rows, hidden, vocab = step.rows, target.hidden_size, target.vocab_size
    kv_heads = target.num_heads if target.num_heads > target.num_kv_heads else target.num_kv_heads
    return {
        "target features (last layer)": _features(target, step, 1),
        "fc input [2H], output, embeddings, noisy features": rows
        * hidden
        * (4 * FP32 + step.compute),
        "draft layer": _draft_layer(target, rows, step, eagle3=False)
        + rows * 2 * kv_heads * target.head_dim * step.compute,
        "attention mask": _mask(step.batch, step.length, step.length, 1, FP32),
        "draft output and loss rows (draft, truth, SmoothL1)": 4 * rows * hidden * FP32,
        "draft logits [n, V]": rows * vocab * step.compute,
        # forward: the target's fp32 logits (or their fp32 copy) and softmax; backward: the
        # softmax, the draft logits' gradient and a loss chunk
        "target logits and distribution [n, V]": max(
            rows * vocab * 2 * FP32,
            rows * vocab * (FP32 + step.compute) + _soft_ce_chunk(rows, vocab),
        ),
        # under autocast the draft logits' matmul keeps the LM head's copy for its backward
        "target LM head, autocast copy": vocab * hidden * step.compute if step.casts_weights else 0,
    }


def _medusa_logits(heads: int, rows: int, vocab: int, step: StepShape) -> int:
    """Peak bytes of Medusa's logits: forward, the stacked ``[K, B, T, V]`` and each head's
    log-softmax (+ one reshaped copy when B > 1); backward, every head's slice gradient is a
    full-size ``[K, B, T, V]`` summed out of place (buffer, new, sum) while the log-softmax
    outputs of the heads not yet reached are alive: ``4K - 2`` units for K >= 2."""
    unit = rows * vocab
    forward = heads * unit * step.compute + heads * unit * FP32
    forward += unit * FP32 if step.batch > 1 else 0
    backward = 3 * heads * unit * step.compute + max(heads - 2, 0) * unit * FP32
    return max(forward, backward)


def _medusa(config: RunConfig, target: TargetSizes, step: StepShape) -> dict[str, int]:
    rows, hidden = step.rows, target.hidden_size
    heads, blocks = config.medusa.num_heads, config.medusa.num_layers
    vocab = medusa_rows(config.medusa.draft_vocab_size, target.vocab_size)
    return {
        "target features (last layer)": _features(target, step, 1),
        "residual blocks": heads * blocks * 2 * rows * hidden * step.compute,
        "head logits [K, B, T, V]": _medusa_logits(heads, rows, vocab, step),
    }


def _medusa2(config: RunConfig, target: TargetSizes, step: StepShape) -> dict[str, int]:
    """Medusa-2: the target itself trains (LoRA), so each layer keeps its saved tensors: the two
    norms' outputs, q/k/v, rotated q/k and the attention output, the MLP's gate, up and act
    ``[I]``, and for each adapted layer its fp32 dropout output ``[H]``, the dropout mask and
    ``lora_A``'s output ``[r]``; then the teacher's and the student's logits for the KL, and the
    heads. Under autocast every frozen matmul keeps its weight's low-precision copy for the
    backward pass through it (the LM head's included)."""
    rows, hidden, inter = step.rows, target.hidden_size, target.intermediate_size
    dim, heads, kv = target.head_dim, target.num_heads, target.num_kv_heads
    adapted = len(config.medusa.lora_target_modules)
    per_row = 2 * hidden * FP32 + ((2 * heads + 3 * kv) * dim + 3 * inter) * step.compute
    per_row += adapted * (hidden * (FP32 + 1) + config.medusa.lora_r * step.compute)
    vocab, heads_k = target.vocab_size, config.medusa.num_heads
    blocks = heads_k * config.medusa.num_layers * 2 * rows * hidden * step.compute
    terms = {
        "target layers (training, LoRA)": target.num_layers * rows * per_row,
        "target hidden states, all layers": (target.num_layers + 1) * rows * hidden * step.weight,
        "teacher and student logits, KL": 4 * rows * vocab * FP32,
        "residual blocks": blocks,
        "head logits [K, B, T, V]": _medusa_logits(heads_k, rows, vocab, step),
    }
    if step.casts_weights:
        cast = target.parameters - (0 if target.tied_embeddings else target.embedding_parameters)
        terms["target weights, autocast copies"] = cast * step.compute
    return terms


def estimate_activations(
    config: RunConfig, target: TargetSizes, drafter: DrafterSizes, step: StepShape
) -> ActivationEstimate:
    """The activation peak of one micro-batch of ``config``'s method (module docstring)."""
    method = config.train.method
    if method == "eagle3":
        method_terms = _eagle3(target, drafter, step, config.eagle3.ttt_steps)
    elif method == "eagle1":
        method_terms = _eagle1(target, step)
    elif method == "medusa1":
        method_terms = _medusa(config, target, step)
    else:
        method_terms = _medusa2(config, target, step)
    if step.compute < FP32:  # autocast caches one copy of every trained weight per forward
        method_terms["drafter weights, autocast copies"] = drafter.parameters * step.compute
    if method == "medusa2":
        return ActivationEstimate("target forward and backward (LoRA)", method_terms)
    phases = [ActivationEstimate("drafter forward, loss and backward", method_terms)]
    if step.online:
        phases.append(
            ActivationEstimate("target forward (features)", _target_forward(target, step))
        )
    return max(phases, key=lambda phase: phase.total)
