"""A :class:`~headway.footprint.run_plan.RunPlan` as a readable table or as JSON (bytes, tokens
and seconds as plain numbers; 1 GB = 10^9 bytes in the table)."""

from __future__ import annotations

from typing import Any

from headway.footprint.run_plan import RunPlan

__all__ = ["plan_json", "plan_table"]

_LARGEST = 6  # activation terms listed under the table


def human_bytes(count: float) -> str:
    """``1234567`` -> ``1.23 MB`` (decimal units)."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(count) >= size:
            return f"{count / size:.2f} {unit}"
    return f"{count:.0f} B"


def human_seconds(seconds: float) -> str:
    """``4000`` -> ``1 h 06 min``."""
    if seconds < 60:
        return f"{seconds:.0f} s"
    minutes = round(seconds / 60)
    if minutes < 60:
        return f"{minutes} min"
    days, rest = divmod(minutes, 24 * 60)
    text = f"{rest // 60} h {rest % 60:02d} min"
    return f"{days} d {text}" if days else text


def _summary(plan: RunPlan) -> list[str]:
    config, target, drafter, step = plan.config, plan.target, plan.drafter, plan.step
    extra = []
    if drafter.draft_vocab_size:
        extra.append(f"draft vocab {drafter.draft_vocab_size:,}")
    if drafter.feature_layers:
        extra.append(f"reads target layers {', '.join(map(str, drafter.feature_layers))}")
    precision = (
        "none (fp32)" if plan.mixed_precision == "no" else f"{plan.mixed_precision} autocast"
    )
    return [
        f"headway plan: {plan.recipe}, {plan.processes} process(es), {plan.device}",
        f"target   {config.target.name}: {target.architecture}, {target.parameters:,} params, "
        f"{target.num_layers} layers, hidden {target.hidden_size:,}, vocab {target.vocab_size:,}, "
        f"{config.target.dtype}",
        f"drafter  {config.train.method}: {drafter.parameters:,} params"
        + (f" ({'; '.join(extra)})" if extra else ""),
        f"step     batch {step.batch} x {step.length} tokens "
        f"({'packed' if step.packed else 'padded'}, {config.data.features} features), "
        f"grad_accum {config.train.grad_accum}, mixed precision {precision}",
    ]


def _memory(plan: RunPlan) -> list[str]:
    sharded = f"sharded over {plan.processes}"
    lines = ["", f"{'memory per process':<24}{'replicated':>13}{sharded:>17}   note"]
    for row in plan.memory.rows:
        lines.append(
            f"  {row.name:<22}{human_bytes(row.today):>13}{human_bytes(row.sharded):>17}   "
            f"{row.note}"
        )
    lines.append(
        f"  {'total':<22}{human_bytes(plan.memory.total):>13}"
        f"{human_bytes(plan.memory.total_sharded):>17}   "
        "(sharded: target.shard, the target's decoder layers split; the drafter stays DDP)"
    )
    terms = sorted(plan.memory.activations.terms.items(), key=lambda item: -item[1])
    lines.append(f"  largest activations ({plan.memory.activations.phase}):")
    lines += [f"    {human_bytes(size):>10}  {name}" for name, size in terms[:_LARGEST] if size]
    return lines


def _disk(plan: RunPlan) -> list[str]:
    cache = plan.cache
    if cache is None:
        return ["", "offline feature cache: none (medusa2 runs the target itself every step)"]
    argmax = " + target argmax" if plan.config.train.method == "eagle3" else ""
    return [
        "",
        f"offline feature cache (`headway data cache-features --method "
        f"{plan.config.train.method}`, {cache.dtype}):",
        f"  per token {cache.per_token:,} B: layers {', '.join(map(str, cache.layers))} x "
        f"hidden {plan.target.hidden_size:,} + token id, loss mask{argmax}",
        f"  {cache.tokens:,} tokens -> {human_bytes(cache.total)}",
        f"  (tokens from {plan.tokens_source})",
    ]


def _regeneration(plan: RunPlan) -> list[str]:
    lines = ["", f"regeneration of {plan.regen_tokens:,} answer tokens:"]
    if plan.speed is None or plan.regen_seconds is None:
        lines.append("  no speed given: pass --tokens-per-s X or --measure-speed")
        return lines
    lines.append(
        f"  {human_seconds(plan.regen_seconds)} at {plan.speed.tokens_per_s:,.0f} tokens/s per "
        f"process x {plan.processes} ({plan.speed.source})"
    )
    return lines


def plan_table(plan: RunPlan) -> str:
    """The plan as text, one figure per line."""
    lines = _summary(plan) + _memory(plan) + _disk(plan) + _regeneration(plan)
    return "\n".join(lines)


def plan_json(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-ready data."""
    memory = plan.memory
    cache = plan.cache
    return {
        "recipe": plan.recipe,
        "method": plan.config.train.method,
        "processes": plan.processes,
        "device": plan.device,
        "mixed_precision": plan.mixed_precision,
        "target": {"name": plan.config.target.name, "dtype": plan.config.target.dtype}
        | plan.target.to_dict(),
        "drafter": {
            "parameters": plan.drafter.parameters,
            "lora_parameters": plan.drafter.lora_parameters,
            "draft_vocab_size": plan.drafter.draft_vocab_size,
            "feature_layers": list(plan.drafter.feature_layers),
        },
        "step": {
            "batch_size": plan.step.batch,
            "max_length": plan.step.length,
            "grad_accum": plan.config.train.grad_accum,
            "tokens_per_step": plan.tokens_per_step,
        },
        "memory_bytes": {
            "rows": [
                {
                    "name": row.name,
                    "today": row.today,
                    "fsdp_sharded": row.sharded,
                    "note": row.note,
                }
                for row in memory.rows
            ],
            "total": memory.total,
            "total_fsdp_sharded": memory.total_sharded,
            "activation_phase": memory.activations.phase,
            "activation_terms": memory.activations.terms,
        },
        "feature_cache": None
        if cache is None
        else {
            "layers": list(cache.layers),
            "dtype": cache.dtype,
            "bytes_per_token": cache.per_token,
            "header_bytes_per_sample": cache.per_sample,
            "tokens": cache.tokens,
            "tokens_source": plan.tokens_source,
            "bytes": cache.total,
        },
        "regeneration": {
            "tokens": plan.regen_tokens,
            "tokens_per_s": None if plan.speed is None else plan.speed.tokens_per_s,
            "speed_source": None if plan.speed is None else plan.speed.source,
            "seconds": plan.regen_seconds,
        },
    }
