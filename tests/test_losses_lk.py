"""LK losses (arXiv:2602.23881) on hand-made distributions: the acceptance rate against sums done
by hand, its fused gradient against autograd through the textbook formula, -log α and the λ
blend against their formulas computed here, their minimum where the draft is the target, the
direction of their gradients, and EAGLE-3's training-time-test loss with them against its slow
reference."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.config import load_config
from headway.errors import ConfigError
from headway.run_config import RunConfig
from headway.train.losses_eagle import eagle3_loss, eagle3_loss_reference
from headway.train.losses_lk import (
    LKLoss,
    acceptance_rate,
    acceptance_rate_reference,
    draft_vocab_mass,
    lk_alpha_loss,
    lk_lambda_loss,
)
from tests.test_eagle3 import HIDDEN, sharp_head

# Rows of the target's probabilities over a draft vocabulary of two tokens; row 2 keeps 0.3 of
# its mass outside it (a reduced draft vocabulary never proposes those tokens).
P = torch.tensor([[0.7, 0.3], [0.1, 0.9], [0.5, 0.2]])
Q = torch.tensor([[0.6, 0.4], [0.2, 0.8], [0.1, 0.9]])


def test_acceptance_rate_sums_the_overlap_of_hand_made_distributions() -> None:
    alpha = acceptance_rate(Q.log(), P, torch.arange(3))
    # min(.7,.6) + min(.3,.4) = .9;  min(.1,.2) + min(.9,.8) = .9;  min(.5,.1) + min(.2,.9) = .3
    torch.testing.assert_close(alpha, torch.tensor([0.9, 0.9, 0.3]))
    # rows pick the target row: q0 against p2 = .5 + .2, q1 against p0 = .2 + .3
    swapped = acceptance_rate(Q[:2].log(), P, torch.tensor([2, 0]))
    torch.testing.assert_close(swapped, torch.tensor([0.7, 0.5]))
    torch.testing.assert_close(acceptance_rate_reference(Q.log(), P), alpha)
    assert acceptance_rate(P.log()[:2], P, torch.arange(2)).tolist() == pytest.approx([1.0, 1.0])


@pytest.mark.parametrize("chunk", [1, 3, None])
def test_fused_acceptance_rate_and_gradient_equal_autograd(chunk: int | None) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 11, generator=generator, dtype=torch.float64, requires_grad=True)
    full = torch.softmax(torch.randn(5, 13, generator=generator, dtype=torch.float64), dim=-1)
    probs = full[:, :11]  # the target's mass on 11 of its 13 tokens
    rows = torch.tensor([0, 4, 2, 2, 1, 3, 0])
    weights = torch.rand(7, generator=generator, dtype=torch.float64)
    fast = acceptance_rate(logits, probs, rows, chunk)
    slow = acceptance_rate_reference(logits, probs[rows])
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-12)
    (got,) = torch.autograd.grad((fast * weights).sum(), logits)
    (want,) = torch.autograd.grad((slow * weights).sum(), logits)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda z: acceptance_rate(z, probs, rows, chunk), (logits,))
    low = logits.detach().to(torch.bfloat16).requires_grad_()
    alpha = acceptance_rate(low, probs, rows, chunk)
    alpha.sum().backward()
    assert alpha.dtype == torch.float32 and low.grad is not None
    assert low.grad.dtype == torch.bfloat16


def test_draft_vocab_mass_is_the_targets_probability_of_the_draft_tokens() -> None:
    generator = torch.Generator().manual_seed(4)
    full = torch.randn(5, 9, generator=generator)
    ids = torch.tensor([0, 3, 4, 8])
    want = torch.softmax(full, dim=-1)[:, ids].sum(-1)
    for rows in (1, 2, 1024):
        torch.testing.assert_close(draft_vocab_mass(full, full[:, ids], rows), want)
    assert draft_vocab_mass(full[:0], full[:0, ids]).shape == (0,)


def test_lk_losses_equal_their_formulas_and_lambda_holds_no_gradient() -> None:
    alpha = torch.tensor([0.9, 0.5, 0.25], requires_grad=True)
    ce = torch.tensor(1.7, requires_grad=True)
    by_hand = -(math.log(0.9) + math.log(0.5) + math.log(0.25)) / 3
    assert lk_alpha_loss(alpha).item() == pytest.approx(by_hand)
    mean = (0.9 + 0.5 + 0.25) / 3
    weight = 0.8 * math.exp(-2.0 * mean)
    blended = lk_lambda_loss(ce, alpha, scale=0.8, decay=2.0)
    assert blended.item() == pytest.approx(weight * 1.7 + (1 - weight) * (1 - mean))
    blended.backward()
    assert ce.grad is not None and alpha.grad is not None
    assert ce.grad.item() == pytest.approx(weight)  # λ is a constant to the gradient
    assert alpha.grad.tolist() == pytest.approx([-(1 - weight) / 3] * 3)
    assert LKLoss("lk_alpha")(ce, alpha).item() == pytest.approx(by_hand)
    assert LKLoss("lk_lambda", 0.8, 2.0)(ce, alpha).item() == pytest.approx(blended.item())
    nothing = torch.zeros(0)
    assert LKLoss("lk_lambda")(ce, nothing) is ce and LKLoss("lk_alpha")(ce, nothing) is ce


def test_a_row_nothing_of_which_is_accepted_adds_nothing_and_no_nan() -> None:
    alpha = torch.tensor([0.0, 0.5], requires_grad=True)
    loss = lk_alpha_loss(alpha)
    loss.backward()
    assert loss.item() == pytest.approx(-math.log(0.5) / 2)
    assert alpha.grad is not None and alpha.grad.tolist() == pytest.approx([0.0, -1.0])


def _step_loss(kind: str, logits: Tensor, target: Tensor) -> Tensor:
    """An LK step loss of ``logits`` ``[n, N]`` against target probabilities ``[n, N]`` (whose
    renormalised rows are the soft cross-entropy's labels)."""
    labels = target / target.sum(-1, keepdim=True)
    ce = -(labels * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    alpha = acceptance_rate(logits, target, torch.arange(len(logits)))
    return LKLoss(kind)(ce, alpha)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda"])
@pytest.mark.parametrize("mass", [1.0, 0.6])
def test_lk_losses_are_least_where_the_draft_is_the_target(kind: str, mass: float) -> None:
    """With all of the target's mass on the draft vocabulary the best -log α is 0; with part of
    it outside, -log(mass): the renormalised target reaches it."""
    generator = torch.Generator().manual_seed(1)
    target = torch.softmax(2 * torch.randn(4, 10, generator=generator), dim=-1) * mass
    best = _step_loss(kind, target.log(), target)
    if kind == "lk_alpha":
        assert best.item() == pytest.approx(-math.log(mass), abs=1e-6)
    for _ in range(20):
        other = target.log() + 0.5 * torch.randn(4, 10, generator=generator)
        assert _step_loss(kind, other, target).item() > best.item()


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda"])
def test_lk_gradients_raise_the_acceptance_rate(kind: str) -> None:
    """Descent raises a logit where the draft holds less than the target and lowers it where it
    holds more, and a small step raises α; -log α's gradient is (1 - α)'s scaled by 1 / α."""
    generator = torch.Generator().manual_seed(2)
    target = torch.softmax(torch.randn(3, 8, generator=generator), dim=-1) * 0.9
    logits = torch.randn(3, 8, generator=generator, requires_grad=True)
    (grad,) = torch.autograd.grad(_step_loss(kind, logits, target), logits)
    draft = torch.softmax(logits.detach(), dim=-1)
    if kind == "lk_alpha":
        assert bool((grad[draft < target] < 0).all()) and bool((grad[draft > target] > 0).all())
        alpha = acceptance_rate(logits, target, torch.arange(3))
        (tv_grad,) = torch.autograd.grad((1 - alpha).sum(), logits)
        torch.testing.assert_close(grad, tv_grad / alpha.detach()[:, None] / 3)
    before = acceptance_rate(logits.detach(), target, torch.arange(3))
    after = acceptance_rate(logits.detach() - 0.1 * grad, target, torch.arange(3))
    assert after.mean() > before.mean()


@pytest.mark.parametrize("kind", ["lk_alpha", "lk_lambda"])
def test_eagle3_loss_with_lk_equals_the_reference(kind: str) -> None:
    generator = torch.Generator().manual_seed(7)
    target = torch.randn(3, 11, HIDDEN, generator=generator)
    states = [torch.randn(3, 11, HIDDEN, generator=generator, requires_grad=True) for _ in range(4)]
    mask = torch.randint(0, 2, (3, 11), generator=generator)
    documents = torch.tensor([[0] * 4 + [1] * 7, [0] * 11, [0] * 6 + [-1] * 5])
    target_ids = torch.tensor([1, 2, 4, 5, 6, 8, 9, 10])  # 8 of the target's 12 tokens
    draft_weight = torch.randn(8, HIDDEN, generator=generator)
    head = sharp_head(scale=1.0)
    settings: dict[str, Any] = {
        "draft_logits": lambda s: s @ draft_weight.T,
        "target_logits": head,
        "target_ids": target_ids,
        "decay": 0.7,
        "document_ids": documents,
        "lk": LKLoss(kind, 0.9, 2.0),  # type: ignore[arg-type]
    }
    fast = eagle3_loss(states, target, mask, **settings)
    slow = eagle3_loss_reference(states, target, mask, **settings)
    torch.testing.assert_close(fast.loss, slow.loss, rtol=1e-5, atol=1e-6)
    assert fast.metrics.keys() == slow.metrics.keys() and "depth4/alpha" in fast.metrics
    for name, value in fast.metrics.items():
        assert value == pytest.approx(slow.metrics[name], rel=1e-5, abs=1e-6), name
    assert 0 < fast.metrics["depth1/alpha"] < 1
    fast_grads = torch.autograd.grad(fast.loss, states, allow_unused=True, materialize_grads=True)
    slow_grads = torch.autograd.grad(slow.loss, states, allow_unused=True, materialize_grads=True)
    for got, want in zip(fast_grads, slow_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    argmax = head(target).argmax(-1)  # offline features: the cached argmax, same loss
    cached = eagle3_loss(states, target, mask, **settings, target_argmax=argmax)
    torch.testing.assert_close(cached.loss, fast.loss)
    plain = eagle3_loss(states, target, mask, **{**settings, "lk": None})
    assert "depth1/alpha" not in plain.metrics and plain.loss.item() != fast.loss.item()


def test_loss_options_are_typed_and_checked() -> None:
    config = load_config(RunConfig, None, ["eagle3.loss=lk_lambda", "eagle3.lk_decay=1"])
    assert (config.eagle3.loss, config.eagle3.lk_scale, config.eagle3.lk_decay) == (
        "lk_lambda",
        1.0,
        1.0,
    )
    assert load_config(RunConfig, None, []).eagle3.loss == "soft_ce"
    with pytest.raises(ConfigError):
        load_config(RunConfig, None, ["eagle3.loss=lk"])
    with pytest.raises(ConfigError, match="lk_scale"):
        load_config(RunConfig, None, ["eagle3.lk_scale=1.5"])
