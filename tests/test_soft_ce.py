"""soft_cross_entropy equals the unfused soft-label cross-entropy, in value and gradient."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from headway.train.soft_ce import soft_cross_entropy


def _case(
    dtype: torch.dtype, n: int = 37, m: int = 11, vocab: int = 50
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(n, vocab, generator=generator)).to(dtype).requires_grad_()
    probs = torch.softmax(2 * torch.randn(m, vocab, generator=generator), dim=-1)
    rows = torch.randint(0, m, (n,), generator=generator)
    return logits, probs, rows


@pytest.mark.parametrize("chunk", [1, 8, 37, 128, None])
def test_soft_cross_entropy_equals_the_unfused_one_in_fp32(chunk: int | None) -> None:
    logits, probs, rows = _case(torch.float32)
    fused = soft_cross_entropy(logits, probs, rows, chunk=chunk)
    (fused_grad,) = torch.autograd.grad(2.5 * fused, logits)
    plain = F.cross_entropy(logits, probs[rows], reduction="sum")
    (plain_grad,) = torch.autograd.grad(2.5 * plain, logits)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(fused_grad, plain_grad, rtol=1e-5, atol=1e-6)


def test_soft_cross_entropy_leaves_fp32_logits_untouched() -> None:
    logits, probs, rows = _case(torch.float32)
    before = logits.detach().clone()
    soft_cross_entropy(logits, probs, rows, chunk=4).backward()
    assert torch.equal(logits.detach(), before)


def test_soft_cross_entropy_of_bf16_logits_is_fp32_with_bf16_gradients() -> None:
    logits, probs, rows = _case(torch.bfloat16)
    fused = soft_cross_entropy(logits, probs, rows, chunk=16)
    fused.backward()
    assert fused.dtype == torch.float32 and logits.grad is not None
    assert logits.grad.dtype == torch.bfloat16
    wide = logits.detach().float().requires_grad_()
    plain = F.cross_entropy(wide, probs[rows], reduction="sum")
    plain.backward()
    assert wide.grad is not None
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(logits.grad.float(), wide.grad, rtol=1e-2, atol=1e-2)


def test_soft_cross_entropy_passes_gradcheck_in_fp64() -> None:
    logits, probs, rows = _case(torch.float64, n=5, m=3, vocab=7)
    probs = probs.double()
    assert torch.autograd.gradcheck(lambda x: soft_cross_entropy(x, probs, rows, chunk=2), logits)


def test_soft_cross_entropy_refuses_mismatched_shapes() -> None:
    logits, probs, rows = _case(torch.float32)
    with pytest.raises(ValueError, match="one V"):
        soft_cross_entropy(logits, probs[:, :-1], rows)
    with pytest.raises(ValueError, match="rows"):
        soft_cross_entropy(logits, probs, rows[:-1])
