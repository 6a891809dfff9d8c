"""A run's plan: memory per process, feature-cache disk and regeneration time, from a recipe.

Everything but ``--measure-speed`` comes from the target's config alone (built on the meta
device, :mod:`headway.footprint.sizes`) and the recipe: no weights are read, nothing downloads.
"""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedModel

from headway.footprint.activations import StepShape, estimate_activations
from headway.footprint.disk import FeatureCacheSize, feature_cache_size, regeneration_seconds
from headway.footprint.memory import MemoryPlan, memory_plan
from headway.footprint.regen_speed import RegenSpeed
from headway.footprint.sizes import (
    DrafterSizes,
    TargetSizes,
    drafter_sizes,
    meta_target,
    target_sizes,
)
from headway.hardware import mixed_precision
from headway.run_config import RunConfig
from headway.target import resolve_dtype

__all__ = ["RunPlan", "build_plan", "planned_mixed_precision"]


@dataclass(frozen=True)
class RunPlan:
    """What :func:`build_plan` found; rendered by :mod:`headway.footprint.tables`."""

    recipe: str
    config: RunConfig
    target: TargetSizes
    drafter: DrafterSizes
    step: StepShape
    device: str
    mixed_precision: str
    processes: int
    memory: MemoryPlan
    tokens_per_step: int
    tokens: int
    tokens_source: str
    cache: FeatureCacheSize | None
    regen_tokens: int
    speed: RegenSpeed | None

    @property
    def regen_seconds(self) -> float | None:
        if self.speed is None:
            return None
        return regeneration_seconds(self.regen_tokens, self.speed.tokens_per_s, self.processes)


def planned_mixed_precision(choice: str, device: str) -> str:
    """``train.mixed_precision`` as a run on ``device`` (``cpu`` or ``cuda``) would resolve it:
    ``auto`` is bf16 on CUDA (assumed bf16-capable: Ampere or newer) and, on a CPU, what
    :func:`headway.hardware.mixed_precision` picks on this machine; fp16 needs CUDA."""
    if choice == "auto":
        return "bf16" if device == "cuda" else mixed_precision("auto", "cpu")
    if choice == "fp16" and device != "cuda":
        return "no"
    return choice


def build_plan(
    config: RunConfig,
    *,
    recipe: str,
    processes: int = 1,
    device: str = "cpu",
    tokens: int | None = None,
    regen_tokens: int | None = None,
    speed: RegenSpeed | None = None,
    feature_dtype: str = "bfloat16",
    model: PreTrainedModel | None = None,
) -> RunPlan:
    """The plan of ``config`` on ``processes`` data-parallel processes.

    Args:
        config: the validated recipe (:func:`headway.config.load_config`).
        recipe: its file, for the report.
        processes: data-parallel processes (``accelerate launch --num_processes``).
        device: ``cpu`` or ``cuda``, where the run will be (decides ``mixed_precision: auto``).
        tokens: tokens to cache; default the token slots the recipe's steps read.
        regen_tokens: answer tokens to regenerate; default ``tokens``.
        speed: regeneration tokens/s per process, for the time figure (none: no figure).
        feature_dtype: the feature cache's dtype (``cache-features --feature-dtype``).
        model: the target built on the meta device (default: from ``config.target.name``'s
            config, read offline).
    """
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    if model is None:
        model = meta_target(config.target.name, trust_remote_code=config.target.trust_remote_code)
    target, drafter = target_sizes(model), drafter_sizes(config, model)
    precision = planned_mixed_precision(config.train.mixed_precision, device)
    weight = resolve_dtype(config.target.dtype).itemsize
    online = config.data.features == "online"
    step = StepShape(
        batch=config.train.batch_size,
        length=config.data.max_length,
        weight=weight,
        compute=4 if precision == "no" else 2,
        online=online,
        packed=config.data.pack,
        cached=resolve_dtype(feature_dtype).itemsize,
    )
    activations = estimate_activations(config, target, drafter, step)
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    memory = memory_plan(
        target,
        buffer_bytes,
        drafter,
        activations,
        weight_bytes=weight,
        processes=processes,
        online=online,
        mixed_precision=precision,
    )
    per_step = step.rows * config.train.grad_accum * processes
    source = "--tokens"
    if tokens is None:
        tokens = per_step * config.train.max_steps
        source = (
            f"recipe: {config.train.max_steps:,} steps x {per_step:,} token slots (batch "
            f"{step.batch} x max_length {step.length} x grad_accum {config.train.grad_accum} x "
            f"{processes} processes)"
        )
    cache = None
    if drafter.feature_layers:  # Medusa-2 cannot train offline
        cache = feature_cache_size(
            hidden_size=target.hidden_size,
            layers=drafter.feature_layers,
            argmax=config.train.method == "eagle3",
            tokens=tokens,
            sample_tokens=step.length,
            dtype=feature_dtype,
        )
    return RunPlan(
        recipe=recipe,
        config=config,
        target=target,
        drafter=drafter,
        step=step,
        device=device,
        mixed_precision=precision,
        processes=processes,
        memory=memory,
        tokens_per_step=per_step,
        tokens=tokens,
        tokens_source=source,
        cache=cache,
        regen_tokens=tokens if regen_tokens is None else regen_tokens,
        speed=speed,
    )
