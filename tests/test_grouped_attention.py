"""Attention that reads each grouped key/value head once (headway.decode.grouped_attention):
no logits change inside the block and the model is restored after; one SDPA call per group for
one-token steps and chains alike; the packed mask is shared by a forward's layers. Also the
sampling pick every batched engine draws with (temperature and nucleus)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.decode.sampling import SamplingParams, pick_tokens, probs_from_logits
from tests.tiny import tiny_model


def reference(model: Any, prompt: list[int], max_new: int, eos: list[int]) -> list[int]:
    """``generate`` on the prompt alone, the answer cut before its first EOS."""
    output = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    return output[: next((i for i, t in enumerate(output) if t in eos), len(output))]


def test_sampled_tokens_follow_the_distribution() -> None:
    """Chi-square goodness of fit of 20,000 draws (the engine's pick, each with its own noise
    key) against the target's probabilities; greedy picks the first maximum."""
    logits = torch.tensor([[1.5, 1.0, 0.2, -0.5, -3.0]]).repeat(20_000, 1)
    params = SamplingParams(temperature=0.8)
    keys = torch.randint(0, 2**32, (20_000,), generator=torch.Generator().manual_seed(0))
    draws = pick_tokens(logits, params, keys)
    counts = torch.bincount(draws, minlength=5).double()
    expected = probs_from_logits(logits[:1], params)[0].double() * len(draws)
    chi_square = float(((counts - expected) ** 2 / expected).sum())
    assert chi_square < 18.47  # the 0.999 quantile of chi-square with 4 degrees of freedom
    assert pick_tokens(logits[:1], SamplingParams(), None).tolist() == [0]  # greedy
    with pytest.raises(ValueError, match="noise keys"):
        pick_tokens(logits[:1], params, None)


def test_grouped_attention_restores_the_model_and_changes_no_logits() -> None:
    """Inside the block the tiny Llama (4 query heads over 2 key/value heads) runs its
    multi-token forward through packed_sdpa; the logits are those of its own sdpa."""
    from headway.decode.grouped_attention import PACKED, grouped_attention

    model = tiny_model("llama")
    assert model.config._attn_implementation == "sdpa"
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        with grouped_attention(model):
            assert model.config._attn_implementation == PACKED
            found = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(found[mask.bool()], expected[mask.bool()])


def test_a_model_that_refuses_packed_attention_runs_as_it_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from headway.decode.grouped_attention import grouped_attention

    model = tiny_model("llama")

    def refuse(implementation: str) -> None:
        raise ValueError(f"{implementation} is not supported")

    monkeypatch.setattr(model, "set_attn_implementation", refuse)
    with grouped_attention(model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("step", [1, 3])
def test_packed_sdpa_reads_each_key_head_once_and_equals_sdpa(
    step: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One-token steps and lookahead chains both run as one SDPA call of the ``G · S`` queries
    of a group against their key/value head (no repeated heads, no ``enable_gqa`` even where
    the environment forces it for stock sdpa), with sdpa's output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from headway.decode.grouped_attention import packed_sdpa

    module = torch.nn.Module()
    module.num_key_value_groups = 3  # type: ignore[assignment]
    module.is_causal = False  # type: ignore[assignment]
    batch, heads, kv_heads, width, dim = 4, 9, 3, 20, 8
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(batch, heads, step, dim, generator=generator)
    key = torch.randn(batch, kv_heads, width, dim, generator=generator)
    value = torch.randn(batch, kv_heads, width, dim, generator=generator)
    visible = torch.rand(batch, 1, step, width, generator=generator) > 0.4
    visible[..., 0] = True
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    expected, _ = sdpa_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    monkeypatch.setenv("TRANSFORMERS_SDPA_FORCE_GQA", "1")
    shapes: list[tuple[int, ...]] = []
    stock = torch.nn.functional.scaled_dot_product_attention

    def recording(q: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        shapes.append(tuple(q.shape))
        return stock(q, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
    found, _ = packed_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    assert shapes == [(batch, kv_heads, 3 * step, dim)]
    torch.testing.assert_close(found, expected)


def test_packed_mask_is_reused_within_a_forward_and_packed_anew_after() -> None:
    """The layers of one forward share the mask packed by the first (the same copy, on a CPU
    without gradients); a mask buffer rewritten in place for the next forward, which starts
    again from layer 0, is packed anew, and each layer's output is stock sdpa's."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from headway.decode import grouped_attention
    from headway.decode.grouped_attention import _packed_mask, packed_sdpa

    generator = torch.Generator().manual_seed(1)
    query = torch.randn(2, 6, 3, 8, generator=generator)
    key, value = torch.randn(2, 2, 10, 8, generator=generator), torch.randn(2, 2, 10, 8)
    mask = torch.zeros(2, 1, 3, 10)
    layers = []
    for index in range(3):
        layer = torch.nn.Module()
        layer.num_key_value_groups, layer.is_causal, layer.layer_idx = 3, False, index  # type: ignore[assignment]
        layers.append(layer)
    with torch.no_grad():
        for forward in range(2):
            mask.zero_()
            mask[..., forward + 4 :] = torch.finfo(torch.float32).min  # rewritten in place
            packed = [_packed_mask(mask, 3, index) for index in range(3)]
            assert packed[1] is packed[0] and packed[2] is packed[0]
            assert torch.equal(packed[0][:, :, :3], mask) and torch.equal(
                packed[0][:, :, 3:6], mask
            )
            for layer in layers:
                found, _ = packed_sdpa(layer, query, key, value, mask, scaling=8**-0.5)
                expected, _ = sdpa_attention_forward(
                    layer, query, key, value, mask, scaling=8**-0.5
                )
                torch.testing.assert_close(found, expected)
    grouped_attention._last_mask.clear()
    first = _packed_mask(mask, 3, 0)
    assert _packed_mask(mask, 3, 1) is not first  # gradients on: every layer packs
