"""The drafter the quickstart evaluates: prompt lookup merged with confidence-gated Medusa heads.

- The heads are read back from the *exported* folder (:func:`headway.heads.export.import_medusa`),
  so the evaluation also proves that the export loads.
- :class:`~headway.heads.drafter_confident.ConfidentMedusaDrafter` drafts the heads' top-1
  chain only while its probability stays above a threshold calibrated on held-out data
  (:mod:`headway.eval.calibrate`), over a draft vocabulary of the training data's most frequent
  tokens (a cheaper ``[V', H]`` projection).
- :class:`~headway.decode.merged.MergedDrafter` proposes the union of several drafters' trees,
  merged as a prefix tree within a node budget, the first drafter's paths first, and counts which
  drafter proposed each accepted token.

Drafts never affect what is committed (the float32 target verifies every token), so none of this
touches exactness; it only decides how much verification work is spent, and on what.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor

from headway.decode.drafters import PromptLookupDrafter
from headway.decode.generate import Drafter
from headway.decode.merged import MergedDrafter
from headway.errors import HeadwayError
from headway.eval.calibrate import (
    GateCalibration,
    choose_threshold,
    head1_scores,
    verify_break_even,
)
from headway.heads.drafter_confident import ConfidentMedusaDrafter
from headway.heads.drafter_medusa import check_final_hidden, final_hidden_layer
from headway.heads.export import import_medusa
from headway.heads.medusa import MedusaHead, MedusaHeads
from headway.target import Target, resolve_dtype
from headway.train.regenerate import read_jsonl

__all__ = [
    "build_quickstart_drafter",
    "draft_vocabulary",
]


def _heads_from_export(export_dir: Path, target: Target, dtype: str) -> MedusaHeads:
    """Medusa heads read back from an exported folder, in ``dtype``, on the target's device."""
    imported = import_medusa(export_dir)
    heads = MedusaHeads(imported.config)
    heads.load_state_dict(imported.state_dict)
    device = target.model.get_output_embeddings().weight.device
    return heads.to(device=device, dtype=resolve_dtype(dtype)).eval()


def _gate(
    heads: MedusaHeads,
    target: Target,
    plan: Any,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    vocab: Tensor | None,
) -> GateCalibration:
    """The plan's fixed confidence, or one calibrated on held-out ``samples`` (see
    :mod:`headway.eval.calibrate`)."""
    if plan.confidence is not None:
        return GateCalibration(plan.confidence, 0.0, 0, 0.0, 0.0)
    if not samples:
        raise HeadwayError("calibrating the confidence gate needs held-out samples")
    prefix = torch.as_tensor(list(samples[0][0])[:256], device=target.model.device)
    break_even = verify_break_even(target.model, prefix)
    head = cast(MedusaHead, heads.heads[0])
    confidence, correct = head1_scores(target.model, head, samples, vocab=vocab)
    return choose_threshold(confidence, correct, break_even=break_even)


def build_quickstart_drafter(
    export_dir: Path,
    target: Target,
    plan: Any,
    data_dir: Path,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
) -> tuple[Drafter, dict[str, Any]]:
    """The quickstart's drafter (module docstring) and its description for the report.

    Args:
        export_dir: the exported heads (``medusa`` or ``medusa-vllm`` layout).
        plan: a :class:`~headway.eval.quickstart_plan.QuickstartPlan`.
        data_dir: the regenerated training data, for the draft vocabulary.
        samples: held-out ``(input_ids, loss_mask)`` pairs to calibrate the confidence gate
            (when ``plan.confidence`` is None).
    """
    heads = _heads_from_export(export_dir, target, plan.draft_dtype)
    layer = final_hidden_layer(target.model)
    check_final_hidden(target.model, layer)
    vocab = None
    if plan.draft_vocab_size:
        vocab = draft_vocabulary(data_dir, target.tokenizer, plan.draft_vocab_size)
    gate = _gate(heads, target, plan, samples, vocab)
    info: dict[str, Any] = {
        "name": f"medusa-{heads.config.num_heads}",
        "export": str(export_dir),
        "heads": heads.config.to_dict(),
        "draft_dtype": plan.draft_dtype,
        "draft_vocab_size": None if vocab is None else int(vocab.numel()),
        "gate": asdict(gate),
    }
    drafters: list[Drafter] = []
    if plan.prompt_lookup:
        drafters.append(
            PromptLookupDrafter(
                min_ngram=plan.lookup_min_ngram,
                max_ngram=plan.lookup_max_ngram,
                num_draft_tokens=plan.lookup_tokens,
                max_nodes=plan.lookup_tokens,
            )
        )
        info["prompt_lookup"] = {
            "min_ngram": plan.lookup_min_ngram,
            "max_ngram": plan.lookup_max_ngram,
            "num_draft_tokens": plan.lookup_tokens,
        }
    if gate.threshold is not None or not drafters:
        medusa = ConfidentMedusaDrafter(
            heads,
            hidden_layer=layer,
            threshold=gate.threshold if gate.threshold is not None else 1.0,
            max_depth=heads.config.num_heads,
            vocab=vocab,
        )
        drafters.append(medusa)
    info["name"] = _drafter_name(heads, gate, plan.prompt_lookup)
    budget = plan.lookup_tokens + heads.config.num_heads
    return MergedDrafter(drafters, max_nodes=budget), info


def _drafter_name(heads: MedusaHeads, gate: GateCalibration, prompt_lookup: bool) -> str:
    medusa = f"Medusa-1, {heads.config.num_heads} heads"
    if gate.threshold is None:
        medusa += " (gated off: below break-even)"
    else:
        medusa += f" (confidence >= {gate.threshold:.2g})"
    return f"prompt lookup + {medusa}" if prompt_lookup else medusa


def draft_vocabulary(data_dir: Path, tokenizer: Any, size: int) -> Tensor:
    """The ``size`` most frequent token ids of the assistant answers in regenerated data
    (``data_dir/*.jsonl`` with ``messages`` rows), sorted, as a LongTensor."""
    counts: Counter[int] = Counter()
    for path in sorted(data_dir.glob("*.jsonl*")):
        for row in read_jsonl(path):
            answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            for answer in answers:
                counts.update(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if not counts:
        raise HeadwayError(f"{data_dir} holds no assistant answers to build a draft vocabulary")
    return torch.tensor(sorted(token for token, _ in counts.most_common(size)), dtype=torch.long)
