"""Calibrate a confidence gate for drafting heads: draft only what pays for its verification.

A drafted token makes the verify forward longer, which costs time whether or not the token is
accepted; an accepted token saves one whole target forward. With ``t1`` the cost of a plain
one-token forward and ``t2`` that of a forward over the root and one drafted token, a draft pays
off when it is accepted with probability at least ``(t2 - t1) / t1``, the *break-even* rate
(:func:`verify_break_even`, measured on this machine).

:func:`choose_threshold` then picks, from held-out positions scored by head 1 (its top
probability and whether its top token was right), the lowest confidence threshold whose drafts
are right at least that often. If no threshold qualifies, the heads should not draft at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import PreTrainedModel

from headway.decode.bench import forward_seconds
from headway.decode.gemm import gemm_route
from headway.drafters.build import describe_spec
from headway.drafters.draft_vocab import narrow_medusa
from headway.drafters.specs import DrafterSpec, LookupMedusaSpec, PromptLookupSpec
from headway.errors import HeadwayError
from headway.heads.format_medusa import ImportedMedusa, import_medusa
from headway.heads.medusa import MedusaHead, MedusaHeads
from headway.quickstart.plan import QuickstartPlan
from headway.target import Target, resolve_dtype

__all__ = ["GateCalibration", "choose_threshold", "head1_scores", "verify_break_even"]


def verify_break_even(model: PreTrainedModel, prefix: Tensor, *, repeats: int = 5) -> float:
    """``(t2 - t1) / t1`` on ``prefix`` ``[P]``: the acceptance rate a one-token draft needs to
    pay for itself (clamped to [0, 1])."""
    gemm_route(model)  # decided before timing, as the decoding loop will multiply them
    one = forward_seconds(model, prefix, 1, repeats=repeats)
    two = forward_seconds(model, prefix, 2, repeats=repeats)
    return min(max((two - one) / one, 0.0), 1.0)


@torch.inference_mode()
def head1_scores(
    model: PreTrainedModel,
    head: MedusaHead,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    vocab: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Head 1's top probability and correctness at every trained position of ``samples``.

    Args:
        model: the target (its last hidden state feeds the head, as when drafting).
        head: Medusa head 1 (predicts the token two places after its hidden state).
        samples: ``(input_ids, loss_mask)`` pairs; position t counts iff ``loss_mask[t + 2]``.
        vocab: the target id of each row of the head's LM head, for a head narrowed by
            :func:`~headway.drafters.draft_vocab.narrow_medusa`; ``None``: row = target id.

    Returns:
        ``(confidence [N], correct [N] bool)`` over all counted positions.
    """
    layer = int(model.config.get_text_config().num_hidden_layers)
    weight = head.lm_head.weight
    confidences, hits = [], []
    for input_ids, loss_mask in samples:
        ids = torch.as_tensor(list(input_ids), device=model.device)[None]
        hidden = model(ids, output_hidden_states=True).hidden_states[layer][0]  # [T, H]
        z = hidden.to(weight.dtype)
        for block in head.blocks:
            z = block(z)
        probs = torch.softmax(F.linear(z, weight).float(), dim=-1)  # [T, V']
        best = probs.max(dim=-1)
        predicted = best.indices if vocab is None else vocab.to(best.indices.device)[best.indices]
        mask = torch.as_tensor(list(loss_mask), device=model.device).bool()
        counted = mask[2:]  # position t is scored against token t + 2
        confidences.append(best.values[:-2][counted].cpu())
        hits.append((predicted[:-2] == ids[0, 2:])[counted].cpu())
    return torch.cat(confidences), torch.cat(hits)


@dataclass(frozen=True)
class GateCalibration:
    """The chosen gate and the evidence for it.

    Attributes:
        threshold: lowest qualifying confidence, or None (the heads should not draft).
        break_even: acceptance rate a draft needs on this machine.
        positions: held-out positions scored.
        drafted_fraction: share of positions the gate lets through (0 if None).
        accuracy: accuracy of those drafts (of all positions' top-1 if None).
    """

    threshold: float | None
    break_even: float
    positions: int
    drafted_fraction: float
    accuracy: float


def choose_threshold(
    confidence: Tensor, correct: Tensor, *, break_even: float, min_drafts: int = 20
) -> GateCalibration:
    """The lowest threshold ``c`` (a seen confidence) such that positions with confidence >= c
    number at least ``min_drafts`` and are right at least ``break_even`` of the time.

    Example: confidences ``[0.9, 0.8, 0.3]`` with correctness ``[1, 1, 0]``, break-even 0.6 and
    ``min_drafts=1``: at 0.3 accuracy is 2/3 >= 0.6, so the threshold is 0.3.
    """
    order = torch.argsort(confidence, descending=True)
    sorted_confidence = confidence[order]
    hits = torch.cumsum(correct[order].double(), 0)
    counts = torch.arange(1, len(order) + 1, dtype=torch.double)
    accuracy = hits / counts
    qualifies = (accuracy >= break_even) & (counts >= min_drafts)
    total = len(order)
    if not bool(qualifies.any()):
        overall = float(correct.double().mean()) if total else 0.0
        return GateCalibration(None, break_even, total, 0.0, overall)
    last = int(qualifies.nonzero()[-1, 0])
    return GateCalibration(
        threshold=float(sorted_confidence[last]),
        break_even=break_even,
        positions=total,
        drafted_fraction=(last + 1) / total,
        accuracy=float(accuracy[last]),
    )


def _gate(
    imported: ImportedMedusa,
    target: Target,
    plan: QuickstartPlan,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
) -> GateCalibration:
    """The plan's fixed confidence, or one calibrated on held-out ``samples`` with the first
    head of the exported heads ``imported``."""
    if plan.confidence is not None:
        return GateCalibration(plan.confidence, 0.0, 0, 0.0, 0.0)
    if not samples:
        raise HeadwayError("calibrating the confidence gate needs held-out samples")
    device = target.model.get_output_embeddings().weight.device
    dtype = resolve_dtype(plan.draft_dtype)
    config, state, vocab = narrow_medusa(imported.config, imported.state_dict, None)
    heads = MedusaHeads.trained(config, state, device=device, dtype=dtype)
    prefix = torch.as_tensor(list(samples[0][0])[:256], device=target.model.device)
    break_even = verify_break_even(target.model, prefix)
    head = cast(MedusaHead, heads.heads[0])
    confidence, correct = head1_scores(target.model, head, samples, vocab=vocab)
    return choose_threshold(confidence, correct, break_even=break_even)


def quickstart_spec(
    export_dir: Path,
    target: Target,
    plan: QuickstartPlan,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
) -> tuple[DrafterSpec, dict[str, Any]]:
    """The drafter the quickstart evaluates, as a spec anyone can build again, and its
    description for the report (with the ``headway eval`` command that measures it).

    A ``lookup-medusa`` spec on the exported heads with the calibrated confidence; when the
    calibration gates the heads off (no threshold pays on this machine), prompt lookup alone.
    """
    imported = import_medusa(export_dir)
    gate = _gate(imported, target, plan, samples)
    spec: DrafterSpec
    if gate.threshold is None and plan.prompt_lookup:
        spec = PromptLookupSpec(
            min_ngram=plan.lookup_min_ngram,
            max_ngram=plan.lookup_max_ngram,
            num_draft_tokens=plan.lookup_tokens,
            max_nodes=plan.lookup_tokens,
        )
    else:
        spec = LookupMedusaSpec(
            heads=str(export_dir),
            confidence=gate.threshold if gate.threshold is not None else 1.0,
            lookup=plan.prompt_lookup,
            lookup_min_ngram=plan.lookup_min_ngram,
            lookup_max_ngram=plan.lookup_max_ngram,
            lookup_tokens=plan.lookup_tokens,
            draft_dtype=plan.draft_dtype,  # type: ignore[arg-type]
        )
    heads_name = "Medusa-1 heads"
    if gate.threshold is None:
        heads_name += " (gated off: below break-even)"
    else:
        heads_name += f" (confidence >= {gate.threshold:.2g})"
    info: dict[str, Any] = {
        "name": f"prompt lookup + {heads_name}" if plan.prompt_lookup else heads_name,
        "spec": describe_spec(spec),
        "export": str(export_dir),
        "draft_vocab_size": imported.config.draft_vocab_size or None,
        "gate": asdict(gate),
        "command": eval_command(spec),
    }
    return spec, info


def eval_command(spec: DrafterSpec) -> str:
    """The ``headway eval`` command line that builds ``spec`` again."""
    options = asdict(spec)
    heads = options.pop("heads", None)
    parts = ["headway eval"]
    parts += [f"--heads {heads}"] if heads else []
    parts += [f"--drafter {spec.name}"] if spec.name in ("prompt-lookup", "lookup-medusa") else []
    defaults = type(spec)(**({"heads": heads} if heads else {}))
    for key, value in options.items():
        if value != getattr(defaults, key):
            parts.append(f"--draft-option {key}={value}")
    return " ".join(parts)
