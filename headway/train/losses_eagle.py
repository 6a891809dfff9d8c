"""EAGLE training losses, each with a slow reference implementation kept beside it.

- :func:`eagle_loss`: EAGLE-1 (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking
  Feature Uncertainty", arXiv:2401.15077, §4.2):
  ``L = w_f · SmoothL1(f̂_{t+1}, f_{t+1}) + w_c · CE(softmax(lm_head(f_{t+1})), lm_head(f̂_{t+1}))``
  with ``w_f = 1.0`` and ``w_c = 0.1`` (the reference's ``v_w`` and ``p_w``); the CE is *soft*:
  its target is the frozen target's whole next-token distribution, not a token id.

Worked example of the EAGLE alignment (T = 6, tokens ``x0..x5``, target features ``f0..f5``). Row
t of the draft model reads the pair (``f_t``, ``x_{t+1}``) at position t and predicts f̂_{t+1};
that is compared with ``f_{t+1}``, and its LM-head output drafts ``x_{t+2}``, scored against the
target's own distribution of ``x_{t+2}``, ``softmax(lm_head(f_{t+1}))``::

    row 0: (f0, x1) -> f̂1 vs f1, drafts x2      row 3: (f3, x4) -> f̂4 vs f4, drafts x5
    row 1: (f1, x2) -> f̂2 vs f2, drafts x3      row 4: (f4, x5) -> f̂5 vs f5, drafts x6 (beyond)
    row 2: (f2, x3) -> f̂3 vs f3, drafts x4      row 5: (f5, -)  -> no f6: never trained

Row t is trained iff ``t + 1 < T`` and ``loss_mask[t + mask_offset] == 1``. The default
``mask_offset = 2`` keeps the rule of :func:`medusa_loss`: a row counts iff the token it drafts,
``x_{t+2}``, is a trained token. With ``loss_mask = [0, 0, 1, 1, 1, 0]`` (x2..x4 are the
assistant's) that is rows 0, 1, 2. The reference (SafeAILab/EAGLE ``eagle/train/main.py``:
``input_ids[:, 1:]`` beside ``hidden_state``, ``target = hidden_state[:, 1:]``, weights
``loss_mask[t]`` with ``loss_mask[-1] = 0``) uses ``mask_offset = 0``: rows 2, 3, 4 here. The two
differ only at turn boundaries; offset 2 trains row ``s - 1`` of a reply starting at ``s``, which
drafts the first token EAGLE ever proposes for that reply (the root after prefill is ``x_s``).

- :func:`eagle3_loss`: EAGLE-3 training-time test (Li et al. 2025, "EAGLE-3: Scaling up Inference
  Acceleration of Large Language Models via Training-Time Test", arXiv:2503.01840, §3.2):
  ``L = Σ_j decay^j · CE_j`` over the S unrolled draft steps (decay 0.8, the reference's
  ``ploss_weight``), ``CE_j`` the soft cross-entropy between the target's next-token
  distribution *renormalised over the draft vocabulary* and the draft's (forward KL up to the
  target's entropy). Step j at row t has read ``x_{t+1} .. x_{t+j+1}`` and drafts ``x_{t+j+2}``,
  scored against ``softmax(lm_head(f_{t+j+1})[draft ids])``; step 0 is the EAGLE-1 alignment
  above. Row t of step j counts iff ``loss_mask[t + j + 2]`` (the drafted token is trained, as
  ``mask_offset = 2``; the reference shifts ``loss_mask`` with the inputs and reads
  ``loss_mask[t + j]``), t and t + j + 2 lie in one sample, and the target's argmax at t + j + 1
  is a draft token (the reference's ``position_mask = t2d[argmax] * loss_mask``: a token the
  drafter cannot propose teaches it nothing). ``CE_j`` is the mean over step j's counted rows;
  the reference divides every step by all B·T rows instead (``.mean()``), which weights steps by
  how many rows they count. With ``lk`` (``eagle3.loss``), step j's ``CE_j`` is replaced by the
  LK loss of :mod:`headway.train.losses_lk` over the same rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from headway.train.losses import TOP_K, LossOutput, label_mask
from headway.train.losses_lk import (
    LKLoss,
    acceptance_rate,
    acceptance_rate_reference,
    draft_vocab_mass,
)
from headway.train.soft_ce import soft_cross_entropy

__all__ = [
    "eagle3_loss",
    "eagle3_loss_reference",
    "eagle3_rows",
    "eagle_loss",
    "eagle_loss_reference",
    "eagle_rows",
]


def _check_eagle(predicted: Tensor, features: Tensor, loss_mask: Tensor, mask_offset: int) -> None:
    if predicted.dim() != 3 or predicted.shape != features.shape:
        raise ValueError(
            f"need predicted and features [B, T, H] of one shape, got {tuple(predicted.shape)} "
            f"and {tuple(features.shape)}"
        )
    if loss_mask.shape != predicted.shape[:2]:
        raise ValueError(
            f"loss_mask {tuple(loss_mask.shape)} must be [B, T] = {tuple(predicted.shape[:2])}"
        )
    if not 0 <= mask_offset <= 2:
        raise ValueError(f"mask_offset must be 0 (reference), 1 or 2 (default), got {mask_offset}")


def eagle_rows(loss_mask: Tensor, mask_offset: int = 2) -> Tensor:
    """Bool ``[B, T - 1]``: which rows t (predicting ``f_{t+1}``) are trained (module docstring)."""
    return label_mask(loss_mask, mask_offset)[:, :-1]


def eagle_loss(
    predicted: Tensor,
    features: Tensor,
    loss_mask: Tensor,
    *,
    lm_head: Callable[[Tensor], Tensor],
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    mask_offset: int = 2,
) -> LossOutput:
    """EAGLE-1 loss (see the module docstring for the formula and the alignment).

    Only the trained rows go through the LM head, so memory is ``rows x V``, not ``B x T x V``.

    Args:
        predicted: ``[B, T, H]``, row t = the draft's f̂_{t+1} from (``f_t``, ``x_{t+1}``); the
            last row is never used.
        features: ``[B, T, H]``, the target's clean features ``f_0..f_{T-1}``.
        loss_mask: ``[B, T]``, 1 on trained tokens (assistant tokens), 0 on prompt and padding.
        lm_head: the target's frozen LM head, ``[..., H] -> [..., V]``.
        feature_weight: w_f, weight of the SmoothL1 (beta 1) feature regression.
        ce_weight: w_c, weight of the soft cross-entropy.
        mask_offset: row t counts iff ``loss_mask[t + mask_offset]``; 2 = the drafted token.

    Returns:
        :class:`LossOutput` with metrics ``feature_loss`` (SmoothL1, mean over rows and H),
        ``ce``, ``feature_l1`` (mean absolute error), ``depth1/top1`` (draft argmax == target
        argmax), ``depth1/top5`` (target argmax in the draft's top 5) and ``tokens`` (rows).
    """
    _check_eagle(predicted, features, loss_mask, mask_offset)
    rows = eagle_rows(loss_mask, mask_offset)
    draft = predicted[:, :-1][rows].float()  # [N, H]
    truth = features[:, 1:][rows].detach().float()
    count = rows.sum()
    feature_sum = F.smooth_l1_loss(draft, truth, reduction="sum")
    feature_loss = feature_sum / (count * draft.shape[-1]).clamp_min(1)
    logits = lm_head(draft)  # [N, V], bf16 under autocast
    with torch.no_grad():
        target_p = torch.softmax(lm_head(truth).float(), dim=-1)
    ce = soft_cross_entropy(logits, target_p, torch.arange(len(logits), device=logits.device))
    ce = ce / count.clamp_min(1)
    loss = feature_weight * feature_loss + ce_weight * ce
    with torch.no_grad():
        wanted = target_p.max(-1).indices  # argmax's first maximum
        top = logits.topk(min(TOP_K, logits.shape[-1]), dim=-1).indices
        hits = top == wanted[:, None]
        stats = torch.stack(
            [feature_loss, ce, (draft - truth).abs().sum(), hits[:, 0].sum(), hits.any(-1).sum()]
        ).tolist()
    return LossOutput(loss, _eagle_metrics(stats, int(count), draft.shape[-1]))


def _eagle_metrics(stats: list[float], count: int, hidden: int) -> dict[str, float]:
    """``[feature_loss, ce, abs error sum, top1 hits, top5 hits]`` -> named metrics."""
    feature_loss, ce, abs_sum, top1, top5 = stats
    rows = max(count, 1)
    return {
        "feature_loss": float(feature_loss),
        "ce": float(ce),
        "feature_l1": abs_sum / (rows * hidden),
        "depth1/top1": top1 / rows,
        "depth1/top5": top5 / rows,
        "tokens": float(count),
    }


def eagle_loss_reference(
    predicted: Tensor,
    features: Tensor,
    loss_mask: Tensor,
    *,
    lm_head: Callable[[Tensor], Tensor],
    feature_weight: float = 1.0,
    ce_weight: float = 0.1,
    mask_offset: int = 2,
) -> LossOutput:
    """The slow, obvious :func:`eagle_loss`: a loop over batch rows and positions, the textbook
    SmoothL1 and soft cross-entropy per position. Kept so a test holds the fast version equal."""
    _check_eagle(predicted, features, loss_mask, mask_offset)
    batch, length, hidden = predicted.shape
    smooth, cross, abs_sum, top1, top5 = [], [], 0.0, 0, 0
    for b in range(batch):
        for t in range(length - 1):
            label = t + mask_offset
            if label >= length or not loss_mask[b, label]:
                continue
            error = predicted[b, t].float() - features[b, t + 1].detach().float()
            small = error.abs() < 1.0
            smooth.append(torch.where(small, 0.5 * error**2, error.abs() - 0.5).mean())
            p = torch.softmax(lm_head(features[b, t + 1].detach().float()).float(), dim=-1)
            log_q = torch.log_softmax(lm_head(predicted[b, t].float()).float(), dim=-1)
            cross.append(-(p * log_q).sum())
            abs_sum += float(error.detach().abs().sum())
            ranking = log_q.topk(min(TOP_K, log_q.numel())).indices.tolist()
            top1 += ranking[0] == int(p.argmax())
            top5 += int(p.argmax()) in ranking
    zero = predicted.new_zeros((), dtype=torch.float32)
    feature_loss = torch.stack(smooth).mean() if smooth else zero
    ce = torch.stack(cross).mean() if cross else zero
    loss = feature_weight * feature_loss + ce_weight * ce
    stats = [float(feature_loss.detach()), float(ce.detach()), abs_sum, float(top1), float(top5)]
    return LossOutput(loss, _eagle_metrics(stats, len(smooth), hidden))


def eagle3_rows(loss_mask: Tensor, steps: int, document_ids: Tensor | None = None) -> Tensor:
    """Bool ``[S, B, T]``: which rows t of step j are trained before the draft-vocabulary check
    (``loss_mask[t + j + 2]`` and, for packed batches, one sample; module docstring)."""
    rows = []
    length = loss_mask.shape[1]
    for step in range(steps):
        offset = step + 2
        rows_j = label_mask(loss_mask, offset)
        if document_ids is not None and offset < length:
            same = torch.zeros_like(rows_j)
            same[:, : length - offset] = document_ids[:, :-offset] == document_ids[:, offset:]
            rows_j &= same
        rows.append(rows_j)
    return torch.stack(rows)


def _check_eagle3(step_states: Sequence[Tensor], target_states: Tensor, loss_mask: Tensor) -> None:
    shapes = {tuple(states.shape[:2]) for states in step_states}
    if not step_states or shapes != {tuple(loss_mask.shape)} or target_states.dim() != 3:
        raise ValueError(
            f"need S >= 1 step states [B, T, H], target_states [B, T, H_t] and loss_mask [B, T] "
            f"of one [B, T]; got steps {sorted(shapes)}, target {tuple(target_states.shape)}, "
            f"mask {tuple(loss_mask.shape)}"
        )


def eagle3_loss(
    step_states: Sequence[Tensor],
    target_states: Tensor,
    loss_mask: Tensor,
    *,
    draft_logits: Callable[[Tensor], Tensor],
    target_logits: Callable[..., Tensor],
    target_ids: Tensor,
    decay: float = 0.8,
    document_ids: Tensor | None = None,
    target_argmax: Tensor | None = None,
    lk: LKLoss | None = None,
) -> LossOutput:
    """EAGLE-3 training-time-test loss (see the module docstring for the formula and alignment).

    The target's LM head runs once, on the positions some step needs; each step's draft head
    only on its counted rows, so memory is ``rows x V``, not ``S x B x T x V``.

    Args:
        step_states: S tensors ``[B, T, H]``, the draft's pre-norm states after step j.
        target_states: ``[B, T, H_t]``, the target's LM-head inputs ``f_0 .. f_{T-1}``.
        loss_mask: ``[B, T]``, 1 on trained tokens.
        draft_logits: the draft head, ``[n, H] -> [n, N]``.
        target_logits: the target's frozen LM head, ``[n, H_t] -> [n, V]``; called as
            ``target_logits(states, target_ids) -> [n, N]`` (those columns only) when
            ``target_argmax`` is given.
        target_ids: int64 ``[N]``, the target id of each draft id (``arange + d2t``).
        decay: step j's weight is ``decay^j``.
        document_ids: ``[B, T]`` sample numbers of packed batches, if any.
        target_argmax: ``[B, T]``, the target's argmax at each position if known (a feature
            cache stores it): the target's LM head then runs over the N draft columns only
            (over all V with ``lk``, which needs its mass outside them).
        lk: an LK loss replacing each step's soft CE (``None``: the soft CE).

    Returns:
        :class:`LossOutput` with ``depth{j+1}/ce``, ``depth{j+1}/top1`` (the draft's argmax is
        the target's) and ``depth{j+1}/tokens`` per step (with ``lk`` also ``depth{j+1}/alpha``,
        the mean acceptance rate), and ``in_vocab`` (the share of step 0's rows whose target
        argmax is a draft token).
    """
    _check_eagle3(step_states, target_states, loss_mask)
    rows = eagle3_rows(loss_mask, len(step_states), document_ids)  # [S, B, T]
    length = loss_mask.shape[1]
    needed = torch.zeros_like(rows[0])  # positions s = t + j + 1 some counted row reads
    for step, rows_j in enumerate(rows):
        needed[:, step + 1 :] |= rows_j[:, : max(length - step - 1, 0)]
    where = torch.full(needed.shape, -1, dtype=torch.long, device=needed.device)
    where[needed] = torch.arange(int(needed.sum()), device=needed.device)
    with torch.no_grad():
        states_needed = target_states[needed].detach()
        wanted = None if target_argmax is None else target_argmax[needed].long()
        mass = None  # LK's p is over all V: the target's probability mass on the draft tokens
        if wanted is None or lk is not None:  # [n, V] in the head's dtype (bf16 under autocast)
            full = target_logits(states_needed)
            chosen = full.index_select(-1, target_ids)
            if wanted is None:
                wanted = full.max(-1).indices  # argmax's first maximum, faster over bf16 on a CPU
            if lk is not None:
                mass = draft_vocab_mass(full, chosen)  # [n]
        else:
            chosen = target_logits(states_needed, target_ids)
        target_p = torch.softmax(chosen.float(), dim=-1)  # [n, N]
        in_vocab = torch.isin(wanted, target_ids)  # [n]: the target's argmax is a draft token
        target_p_full = None if mass is None else target_p * mass[:, None]  # [n, N], LK's p
    total = step_states[0].new_zeros((), dtype=torch.float32)
    stats = []  # per step: ce, top1 hits, rows counted, rows before the vocabulary check
    for step, (states, rows_j) in enumerate(zip(step_states, rows, strict=True)):
        index = torch.full_like(where, -1)  # [B, T]: row t reads target position t + step + 1
        index[:, : max(length - step - 1, 0)] = where[:, step + 1 :]
        counted = rows_j.clone()
        counted[rows_j] = in_vocab[index[rows_j]]
        targets = index[counted]
        logits = draft_logits(states[counted])  # [n_j, N], bf16 under autocast
        count = counted.sum()
        # -sum(p * log_softmax(logits)) over rows, fused and chunked (no [n_j, N] fp32 copies)
        ce = soft_cross_entropy(logits, target_p, targets) / count.clamp_min(1)
        step_loss, alpha = ce, None
        if lk is not None and target_p_full is not None:  # LK replaces the step's soft CE
            alpha = acceptance_rate(logits, target_p_full, targets)  # [n_j]
            step_loss = lk(ce, alpha)
        total = total + decay**step * step_loss
        with torch.no_grad():
            hits = (target_ids[logits.max(-1).indices] == wanted[targets]).sum()
            extra = [] if alpha is None else [alpha.sum() / count.clamp_min(1)]
            stats.append(torch.stack([ce.detach(), hits, count, rows_j.sum(), *extra]))
    return LossOutput(total, _eagle3_metrics(torch.stack(stats).tolist()))


def _eagle3_metrics(rows: list[list[float]]) -> dict[str, float]:
    """``[[ce, top1 hits, rows counted, rows before the vocabulary check(, mean α)], ...]`` ->
    metrics."""
    metrics: dict[str, float] = {}
    for index, (ce, top1, count, _, *alpha) in enumerate(rows):
        depth = index + 1
        metrics[f"depth{depth}/ce"] = float(ce)
        metrics[f"depth{depth}/top1"] = top1 / count if count else 0.0
        metrics[f"depth{depth}/tokens"] = float(count)
        metrics.update({f"depth{depth}/alpha": float(value) for value in alpha})
    first_count, first_candidates = rows[0][2], rows[0][3]
    metrics["in_vocab"] = first_count / first_candidates if first_candidates else 0.0
    return metrics


def eagle3_loss_reference(
    step_states: Sequence[Tensor],
    target_states: Tensor,
    loss_mask: Tensor,
    *,
    draft_logits: Callable[[Tensor], Tensor],
    target_logits: Callable[[Tensor], Tensor],
    target_ids: Tensor,
    decay: float = 0.8,
    document_ids: Tensor | None = None,
    lk: LKLoss | None = None,
) -> LossOutput:
    """The slow, obvious :func:`eagle3_loss`: loops over steps, batch rows and positions, the
    textbook renormalised soft cross-entropy (and ``Σ min(p, q)``) per row. Kept so a test holds
    the fast one equal."""
    _check_eagle3(step_states, target_states, loss_mask)
    batch, length = loss_mask.shape
    draft_set = set(target_ids.tolist())
    total = step_states[0].new_zeros((), dtype=torch.float32)
    rows = []
    for step, states in enumerate(step_states):
        terms, alphas, top1, candidates = [], [], 0, 0
        for b in range(batch):
            for t in range(length - step - 2):
                label = t + step + 2
                if not loss_mask[b, label]:
                    continue
                if document_ids is not None and document_ids[b, t] != document_ids[b, label]:
                    continue
                candidates += 1
                full = target_logits(target_states[b, t + step + 1].detach()).float()
                if int(full.argmax()) not in draft_set:
                    continue
                p = torch.softmax(full[target_ids], dim=-1)
                log_q = torch.log_softmax(draft_logits(states[b, t]).float(), dim=-1)
                terms.append(-(p * log_q).sum())
                p_full = torch.softmax(full, dim=-1)[target_ids]  # not renormalised
                alphas.append(acceptance_rate_reference(draft_logits(states[b, t]), p_full))
                top1 += int(target_ids[log_q.argmax()]) == int(full.argmax())
        ce = torch.stack(terms).mean() if terms else total.new_zeros(())
        alpha = torch.stack(alphas) if alphas else total.new_zeros(0)
        total = total + decay**step * (ce if lk is None else lk(ce, alpha))
        row = [float(ce.detach()), float(top1), float(len(terms)), float(candidates)]
        extra = [] if lk is None else [float(alpha.detach().sum()) / max(len(alphas), 1)]
        rows.append([*row, *extra])
    return LossOutput(total, _eagle3_metrics(rows))
