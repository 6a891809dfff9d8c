"""headway's LK losses (``headway/train/losses_lk.py``) against the code they follow: SpecForge's
``core/lk_loss.py`` (the paper's authors' own) and compact teacher, and speculators'
``losses/eager.py``. Values and gradients, over a reduced draft vocabulary where SpecForge takes
one and over the full vocabulary where speculators renormalises (the module docstring of
``losses_lk`` says where they differ; these tests hold that it is only there)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from headway.train.losses_lk import acceptance_rate, draft_vocab_mass, lk_alpha_loss, lk_lambda_loss
from headway.train.soft_ce import soft_cross_entropy
from tests.installed import installed_modules

specforge_lk, teacher = installed_modules(
    "specforge", "specforge.core.lk_loss", "specforge.core.compact_teacher"
)
(speculators_eager,) = installed_modules("speculators", "speculators.losses.eager")

HIDDEN, VOCAB, LENGTH = 16, 40, 24


def _teacher(seed: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A target's last hidden states ``[1, T, H]`` and LM head ``[V, H]`` (sharp enough that the
    argmax leaves the draft vocabulary at some positions), the draft vocabulary's mask ``t2d``
    ``[V]`` (bool, 3 of 5 tokens) and a loss mask ``[1, T, 1]``."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(1, LENGTH, HIDDEN, generator=generator, dtype=torch.float64)
    head = 0.6 * torch.randn(VOCAB, HIDDEN, generator=generator, dtype=torch.float64)
    t2d = torch.rand(VOCAB, generator=generator) < 0.6
    loss_mask = (torch.rand(1, LENGTH, 1, generator=generator) < 0.8).long()
    return hidden, head, t2d, loss_mask


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_targets_draft_vocabulary_probabilities_are_specforges(seed: int) -> None:
    hidden, head, t2d, loss_mask = _teacher(seed)
    target_p, on_draft, argmax, position_mask = teacher.compute_target_from_hidden(
        hidden, head, t2d, loss_mask, chunk_size=7
    )
    # headway's eagle3_loss: the draft columns' softmax, rescaled by the target's mass on them
    full = (hidden @ head.T)[0]  # [T, V]
    chosen = full[:, t2d]  # [T, N]
    mine = torch.softmax(chosen.float(), dim=-1)
    mass = draft_vocab_mass(full, chosen, rows=5)
    torch.testing.assert_close(mine, target_p[0].float())
    torch.testing.assert_close(mine * mass[:, None], on_draft[0].float())
    assert 0 < int(position_mask.sum()) < int(loss_mask.sum())  # some argmax outside the draft
    in_vocab = torch.isin(full.argmax(-1), t2d.nonzero()[:, 0])  # eagle3_loss's row check
    assert torch.equal(in_vocab & loss_mask[0, :, 0].bool(), position_mask[0, :, 0].bool())
    assert torch.equal(full.argmax(-1), argmax[0])


def _draft(seed: int, rows: int, columns: int, dtype: torch.dtype) -> Tensor:
    """Draft logits ``[rows, columns]`` that want a gradient."""
    generator = torch.Generator().manual_seed(100 + seed)
    logits = 2 * torch.randn(rows, columns, generator=generator, dtype=dtype)
    return logits.requires_grad_()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_acceptance_and_lk_losses_equal_specforges_in_value_and_gradient(seed: int) -> None:
    hidden, head, t2d, loss_mask = _teacher(seed)
    target_p, on_draft, _, position_mask = teacher.compute_target_from_hidden(
        hidden, head, t2d, loss_mask
    )
    counted = position_mask[0, :, 0].bool()  # the rows a TTT step counts
    rows = counted.nonzero()[:, 0]
    logits = _draft(seed, LENGTH, int(t2d.sum()), torch.float32)  # SpecForge's teacher: fp32
    ce = soft_cross_entropy(logits[rows], target_p[0], rows) / len(rows)
    alpha = acceptance_rate(logits[rows], on_draft[0], rows)
    theirs = specforge_lk._acceptance_rate_per_token_from_logits(logits[None], on_draft)
    torch.testing.assert_close(alpha, theirs[0, rows])
    mean, log_mean = specforge_lk.compute_acceptance_rate(
        logits=logits[None], target_probs=on_draft, position_mask=position_mask
    )
    for kind, scale, decay in [("alpha", 1.0, 1.0), ("lambda", 1.0, 1.0), ("lambda", 0.7, 3.0)]:
        want = specforge_lk.compute_lk_loss(
            kl_loss=ce,  # SpecForge's CE divides by all B*T rows; here both take the same CE
            acceptance_rate=mean,
            log_acceptance_rate=log_mean,
            lk_loss_type=kind,
            kl_scale=scale,
            kl_decay=decay,
        )
        got = (
            lk_alpha_loss(alpha)
            if kind == "alpha"
            else lk_lambda_loss(ce, alpha, scale=scale, decay=decay)
        )
        torch.testing.assert_close(got, want)
        (grad_got,) = torch.autograd.grad(got, logits, retain_graph=True)
        (grad_want,) = torch.autograd.grad(want, logits, retain_graph=True)
        torch.testing.assert_close(grad_got, grad_want)
        assert grad_got[~counted].abs().max() == 0 < grad_got[counted].abs().max()


@pytest.mark.parametrize("seed", [0, 1])
def test_over_the_whole_vocabulary_speculators_gives_the_same_losses(seed: int) -> None:
    """speculators renormalises ``p`` over a draft vocabulary; over the whole one it agrees:
    ``1 - α`` is its TV, ``-log α`` its NLA, and its per-row hybrid (λ per row, KL where headway
    takes the CE: the same gradient, they differ by the target's entropy) has the gradient of
    headway's λ blend over each row alone."""
    hidden, head, _, _ = _teacher(seed)
    targets = (hidden @ head.T).float()  # [1, T, V]; speculators' losses compute in fp32
    probs = torch.softmax(targets[0], dim=-1)
    logits = _draft(seed, LENGTH, VOCAB, torch.float32)
    rows = torch.arange(LENGTH)
    alpha = acceptance_rate(logits, probs, rows)
    tv = speculators_eager.tv_loss(logits[None], targets)[0]
    torch.testing.assert_close(1 - alpha, tv)
    nla = speculators_eager.neg_log_acceptance_loss(logits[None], targets)[0]
    assert float(alpha.min()) > 1e-5  # speculators clamps α there; headway does not
    torch.testing.assert_close(lk_alpha_loss(alpha), nla.mean())
    hybrid = speculators_eager.lk_hybrid_loss(logits[None], targets, eta=3.0)[0]
    (want,) = torch.autograd.grad(hybrid.sum(), logits)
    for row in range(LENGTH):
        one = rows[row : row + 1]
        ce = soft_cross_entropy(logits[one], probs, one)
        got = lk_lambda_loss(ce, acceptance_rate(logits[one], probs, one), scale=1.0, decay=3.0)
        (grad,) = torch.autograd.grad(got, logits)
        torch.testing.assert_close(grad[row], want[row])
