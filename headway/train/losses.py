"""Training losses for drafters, each with a slow reference implementation kept beside it.

- :func:`medusa_loss`: Medusa-1 heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration
  Framework with Multiple Decoding Heads", arXiv:2401.10774, eq. 1):
  ``L = Σ_k λ_k · CE_k`` with ``λ_k = decay^k`` (the paper: "the k-th power of a constant like
  0.8"), head k at position t scored against token t + k + 1.
- :func:`distillation_kl`: the Medusa-2 backbone loss with self-distillation (§2.3.2): the LoRA-
  tuned target (student) is pulled towards the frozen original (teacher) by KL(teacher ‖ student),
  so its own next-token distribution, hence the output, stays the target's.

Worked example of the Medusa alignment (T = 5, tokens ``x0..x4``; head k reads position t)::

    head 1 (k=1):  t=0 -> x2   t=1 -> x3   t=2 -> x4            (label t + 2)
    head 2 (k=2):  t=0 -> x3   t=1 -> x4                        (label t + 3)

Position t counts for head k iff t + k + 1 < T and ``loss_mask[t + k + 1] == 1`` (the label is a
trained token, e.g. an assistant token); each CE_k is the mean over those positions.

The EAGLE losses are in :mod:`headway.train.losses_eagle`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "TOP_K",
    "LossOutput",
    "distillation_kl",
    "distillation_kl_reference",
    "label_mask",
    "medusa_loss",
    "medusa_loss_reference",
]

_IGNORE = -100
TOP_K = 5


@dataclass
class LossOutput:
    """A batch's loss and what to log about it.

    Attributes:
        loss: scalar tensor to back-propagate.
        metrics: plain floats, e.g. ``head1/ce``, ``head1/top1``, ``head1/top5``, ``head1/tokens``.
    """

    loss: Tensor
    metrics: dict[str, float]


def label_mask(loss_mask: Tensor, offset: int) -> Tensor:
    """``out[b, t] = loss_mask[b, t + offset]`` (False past the end): which positions have a
    trained label ``offset`` tokens ahead. ``loss_mask`` ``[B, T]`` -> bool ``[B, T]``."""
    mask = torch.zeros_like(loss_mask, dtype=torch.bool)
    if offset < loss_mask.shape[1]:
        mask[:, : loss_mask.shape[1] - offset] = loss_mask[:, offset:].bool()
    return mask


def _check_shapes(head_logits: Tensor, input_ids: Tensor, loss_mask: Tensor) -> None:
    if head_logits.dim() != 4 or input_ids.dim() != 2:
        raise ValueError(
            f"need head_logits [K, B, T, V] and input_ids [B, T], got "
            f"{tuple(head_logits.shape)} and {tuple(input_ids.shape)}"
        )
    if head_logits.shape[1:3] != input_ids.shape or loss_mask.shape != input_ids.shape:
        raise ValueError(
            f"head_logits {tuple(head_logits.shape)}, input_ids {tuple(input_ids.shape)} and "
            f"loss_mask {tuple(loss_mask.shape)} disagree on [B, T]"
        )


def medusa_loss(
    head_logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    decay: float = 0.8,
    document_ids: Tensor | None = None,
    token_map: Tensor | None = None,
) -> LossOutput:
    """Medusa-1 loss ``Σ_{k=1..K} decay^k · CE_k`` (see the module docstring for the alignment).

    Args:
        head_logits: ``[K, B, T, V]`` from :class:`~headway.heads.medusa.MedusaHeads`;
            ``head_logits[k - 1, b, t]`` predicts ``input_ids[b, t + k + 1]``.
        input_ids: LongTensor ``[B, T]``, the sequence the hidden states were computed on.
        loss_mask: ``[B, T]``, 1 where a token is a training label (assistant tokens), 0 for
            prompt and padding.
        decay: λ_k = decay^k for k = 1..K.
        document_ids: ``[B, T]`` sample numbers of packed batches, if any: a label in another
            sample than its position is not trained (as if the sample ended there).
        token_map: heads over a draft vocabulary (``V`` = D): the target id of each draft id,
            int64 ``[D]`` ascending. A label outside it has no logit: it adds no cross-entropy
            and counts as a miss in the accuracies.

    Returns:
        :class:`LossOutput`; metrics per head k (1-based): ``head{k}/ce``, ``head{k}/top1``,
        ``head{k}/top5`` (accuracies over valid positions; 0.0 when the batch has none) and
        ``head{k}/tokens`` (how many valid positions there were).
    """
    _check_shapes(head_logits, input_ids, loss_mask)
    num_heads, _, length, vocab = head_logits.shape
    drafted = input_ids if token_map is None else _to_draft_ids(input_ids, token_map)
    total = head_logits.new_zeros((), dtype=torch.float32)
    stats = []  # per head: ce, top1 hits, top5 hits, count
    for index in range(num_heads):
        k = index + 1
        shift = min(k + 1, length)
        logits = head_logits[index, :, : length - shift]  # [B, T - k - 1, V]
        labels = drafted[:, shift:]  # draft ids, -1 outside a draft vocabulary
        valid = loss_mask[:, shift:].bool()
        if document_ids is not None:
            valid &= document_ids[:, shift:] == document_ids[:, : length - shift]
        count = valid.sum()
        trained = valid & (labels >= 0)
        targets = labels.masked_fill(~trained, _IGNORE).reshape(-1)
        ce_sum = F.cross_entropy(
            logits.reshape(-1, vocab).float(), targets, ignore_index=_IGNORE, reduction="sum"
        )
        ce = ce_sum / trained.sum().clamp_min(1)  # nothing trained: ce_sum is 0, so is the term
        total = total + decay**k * ce
        with torch.no_grad():
            top = logits.topk(min(TOP_K, vocab), dim=-1).indices  # [B, T - k - 1, 5]
            hits = (top == labels[..., None]) & valid[..., None]
            stats.append(torch.stack([ce.detach(), hits[..., 0].sum(), hits.any(-1).sum(), count]))
    return LossOutput(total, _metrics(torch.stack(stats).tolist()))


def _to_draft_ids(input_ids: Tensor, token_map: Tensor) -> Tensor:
    """Target ids ``[B, T]`` -> draft ids ``[B, T]`` of the sorted ``token_map`` ``[D]``, -1 for
    tokens outside it."""
    token_map = token_map.to(input_ids.device)
    place = torch.searchsorted(token_map, input_ids).clamp_max(token_map.numel() - 1)
    return torch.where(token_map[place] == input_ids, place, torch.full_like(place, -1))


def _metrics(rows: list[list[float]]) -> dict[str, float]:
    """``[[ce, top1 hits, top5 hits, count], ...]`` (head 1 first) -> named metrics."""
    metrics: dict[str, float] = {}
    for index, (ce, top1, top5, count) in enumerate(rows):
        k = index + 1
        metrics[f"head{k}/ce"] = float(ce)
        metrics[f"head{k}/top1"] = top1 / count if count else 0.0
        metrics[f"head{k}/top5"] = top5 / count if count else 0.0
        metrics[f"head{k}/tokens"] = float(count)
    return metrics


def medusa_loss_reference(
    head_logits: Tensor,
    input_ids: Tensor,
    loss_mask: Tensor,
    *,
    decay: float = 0.8,
    document_ids: Tensor | None = None,
) -> LossOutput:
    """The slow, obvious :func:`medusa_loss`: Python loops over heads, batch rows and positions.
    Kept so a test can hold the fast version equal to it."""
    _check_shapes(head_logits, input_ids, loss_mask)
    num_heads, batch, length, vocab = head_logits.shape
    total = head_logits.new_zeros((), dtype=torch.float32)
    rows = []
    for index in range(num_heads):
        k = index + 1
        terms: list[Tensor] = []
        top1 = top5 = 0
        for b in range(batch):
            for t in range(length):
                label_position = t + k + 1
                if label_position >= length or not loss_mask[b, label_position]:
                    continue
                if (
                    document_ids is not None
                    and document_ids[b, t] != document_ids[b, label_position]
                ):
                    continue
                row = head_logits[index, b, t].float()
                label = int(input_ids[b, label_position])
                terms.append(-torch.log_softmax(row, dim=-1)[label])
                ranking = row.topk(min(TOP_K, vocab)).indices.tolist()
                top1 += ranking[0] == label
                top5 += label in ranking
        ce = torch.stack(terms).mean() if terms else total.new_zeros(())
        total = total + decay**k * ce
        rows.append([float(ce.detach()), float(top1), float(top5), float(len(terms))])
    return LossOutput(total, _metrics(rows))


def distillation_kl(student_logits: Tensor, teacher_logits: Tensor, mask: Tensor) -> Tensor:
    """Mean over masked positions of KL(teacher ‖ student) = Σ_v p_T(v) (log p_T(v) - log p_S(v)).

    The Medusa-2 backbone loss with self-distillation (Cai et al. 2024, §2.3.2): the student is
    the target with its LoRA adapters, the teacher the frozen original (no gradient flows into
    it). Computed in fp32.

    Args:
        student_logits: ``[B, T, V]``.
        teacher_logits: ``[B, T, V]``.
        mask: ``[B, T]``, 1 where row t is scored. Row t predicts token t + 1, so for a
            ``loss_mask`` over label tokens pass ``label_mask(loss_mask, 1)``.

    Returns:
        A scalar tensor (0 if no position is masked in).
    """
    if student_logits.shape != teacher_logits.shape or student_logits.shape[:2] != mask.shape:
        raise ValueError(
            f"need student and teacher logits [B, T, V] and mask [B, T], got "
            f"{tuple(student_logits.shape)}, {tuple(teacher_logits.shape)}, {tuple(mask.shape)}"
        )
    log_student = torch.log_softmax(student_logits.float(), dim=-1)
    log_teacher = torch.log_softmax(teacher_logits.detach().float(), dim=-1)
    kl = F.kl_div(log_student, log_teacher, reduction="none", log_target=True).sum(-1)  # [B, T]
    weights = mask.to(kl.dtype)
    return (kl * weights).sum() / weights.sum().clamp_min(1)


def distillation_kl_reference(
    student_logits: Tensor, teacher_logits: Tensor, mask: Tensor
) -> Tensor:
    """The slow, obvious :func:`distillation_kl`: a loop over positions and the textbook sum."""
    terms = []
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t]:
                log_p = torch.log_softmax(teacher_logits[b, t].float(), dim=-1)
                log_q = torch.log_softmax(student_logits[b, t].float(), dim=-1)
                terms.append((log_p.exp() * (log_p - log_q)).sum())
    return torch.stack(terms).mean() if terms else student_logits.new_zeros((), dtype=torch.float32)
