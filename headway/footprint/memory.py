"""Memory of one training process, by what holds it, for a recipe and a process count.

What headway's loop does (``headway/train/loop.py``): every process loads the whole frozen
target in ``target.dtype`` (replicated), builds the drafter in fp32 and trains it with AdamW
(two fp32 moments per parameter and a step counter per tensor). Mixed precision is autocast:
parameters stay fp32, there is no separate master copy; autocast adds low-precision copies of
the trained weights for the forward (counted with the activations). With several processes
accelerate wraps the drafter in DDP, whose reducer keeps gradient buckets as large as the
gradients (``gradient_as_bucket_view`` off). Gradients are counted as held through the step,
as they are with ``train.grad_accum > 1``; with 1 they are freed between steps, so a step's
peak can be lower by up to their size.

The ``sharded`` column is what a process holds with the target sharded (``target.shard``, an
accelerate FSDP launch; ``headway/train/sharding.py``): the target's decoder layers split ``N``
ways, its embedding and LM head whole on every process, the drafter under DDP as today; FSDP's
transiently gathered layer is not counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from headway.footprint.activations import ActivationEstimate
from headway.footprint.sizes import DrafterSizes, TargetSizes

__all__ = ["MemoryPlan", "MemoryRow", "adamw_bytes", "memory_plan"]

FP32 = 4


def adamw_bytes(drafter: DrafterSizes) -> int:
    """PyTorch AdamW's state: ``exp_avg`` and ``exp_avg_sq`` like the parameters (fp32) and a
    0-d fp32 ``step`` per parameter tensor."""
    return 2 * drafter.parameters * FP32 + drafter.tensors * FP32


@dataclass(frozen=True)
class MemoryRow:
    """One holder of memory: bytes per process with the target replicated (the default of a
    plain launch) and with its decoder layers sharded over the processes (``target.shard``)."""

    name: str
    today: int
    sharded: int
    note: str = ""


@dataclass(frozen=True)
class MemoryPlan:
    rows: tuple[MemoryRow, ...]
    activations: ActivationEstimate
    processes: int

    @property
    def total(self) -> int:
        return sum(row.today for row in self.rows)

    @property
    def total_sharded(self) -> int:
        return sum(row.sharded for row in self.rows)


def _split(value: int, processes: int) -> int:
    return -(-value // processes)


def memory_plan(
    target: TargetSizes,
    target_buffer_bytes: int,
    drafter: DrafterSizes,
    activations: ActivationEstimate,
    *,
    weight_bytes: int,
    processes: int,
    online: bool,
    mixed_precision: str,
) -> MemoryPlan:
    """Bytes per process of each holder (module docstring). ``weight_bytes``: the target's
    ``target.dtype`` element size; an offline run (``online=False``) still loads the target
    (its embedding and LM head are borrowed by EAGLE and Medusa)."""
    weights = target.parameters * weight_bytes + target_buffer_bytes
    whole = target.embedding_parameters * (1 if target.tied_embeddings else 2)  # stay whole
    sharded = (
        _split((target.parameters - whole) * weight_bytes, processes)
        + whole * weight_bytes
        + target_buffer_bytes
    )
    parameters = drafter.parameters * FP32 + drafter.buffer_bytes
    gradients = drafter.parameters * FP32
    optimizer = adamw_bytes(drafter)
    dtype = {2: "bf16/fp16", 4: "fp32"}.get(weight_bytes, f"{weight_bytes} B")
    lora = f", {drafter.lora_parameters:,} LoRA" if drafter.lora_parameters else ""
    precision = "fp32" if mixed_precision == "no" else f"fp32, {mixed_precision} autocast"
    rows = [
        MemoryRow(
            "target weights",
            weights,
            sharded,
            f"{target.parameters:,} params in {dtype}"
            + ("" if online else "; offline runs load it too"),
        ),
        MemoryRow(
            "drafter parameters",
            parameters,
            parameters,
            f"{drafter.parameters:,} params{lora}, {precision}; no master copy",
        ),
        MemoryRow("gradients", gradients, gradients, "fp32"),
        MemoryRow(
            "optimizer state",
            optimizer,
            optimizer,
            "AdamW: exp_avg + exp_avg_sq fp32, step per tensor",
        ),
    ]
    if processes > 1:
        rows.append(
            MemoryRow("DDP gradient buckets", gradients, gradients, "a copy of the gradients")
        )
    rows.append(
        MemoryRow(
            "activations (peak)",
            activations.total,
            activations.total,
            f"one micro-batch; {activations.phase}",
        )
    )
    return MemoryPlan(rows=tuple(rows), activations=activations, processes=processes)
