"""The mask probe at load (issue #16): a stock model passes, one whose attention ignores the 4-D
tree mask (a wrapper that drops it) is refused in one line before any decoding."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.api import generate
from headway.decode import probe
from headway.decode.probe import check_tree_mask
from headway.errors import TargetError
from headway.target import Target, load_target
from tests.families import family_model
from tests.tiny import TINY_FAMILIES, tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def drop_4d_masks(model: Any) -> Any:
    """Wrap ``model.forward`` so a 4-D attention mask never reaches the model (as a custom
    kernel or a careless wrapper would): the tree is then attended as one causal sequence."""
    stock = model.forward

    def forward(*args: Any, attention_mask: Any = None, **kwargs: Any) -> Any:
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return stock(*args, attention_mask=attention_mask, **kwargs)

    model.forward = forward
    return model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", [*TINY_FAMILIES, "mixtral"])
def test_stock_models_pass(family: str, dtype: torch.dtype) -> None:
    model = tiny_model(family) if family in TINY_FAMILIES else family_model(family)
    model.to(dtype)
    check_tree_mask(model)
    assert model in probe._CHECKED  # checked once per model


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_model_that_drops_the_mask_is_refused_before_decoding(dtype: torch.dtype) -> None:
    model = drop_4d_masks(tiny_model("llama", vocab_size=400).to(dtype))
    with pytest.raises(TargetError, match="ignores headway's 4-D tree attention mask") as caught:
        check_tree_mask(model)
    assert "\n" not in str(caught.value)
    target = Target(model, smollm2_tokenizer(), "broken")
    with pytest.raises(TargetError, match="ignores"):
        generate(target, "hello", max_new_tokens=4)


def test_rounding_far_below_what_ignoring_the_mask_gives_passes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bf16 tree forward that rounds differently from the plain ones (kernels of another
    shape: 0.28 logit standard deviations for the real SmolLM2 on an AVX-512 EPYC) is no mask
    ignored: what counts is that difference against the plain causal forward's. In fp32 no
    rounding comes near it: the same difference is refused there."""
    real = probe.tree_forward

    def rounded_otherwise(*args: Any, **kwargs: Any) -> Any:
        logits, rest = real(*args, **kwargs)
        noise = torch.linspace(-1, 1, logits.shape[-1], device=logits.device)
        return logits + (0.2 * logits.float().std() * noise).to(logits.dtype), rest

    monkeypatch.setattr(probe, "tree_forward", rounded_otherwise)
    # ignoring the mask moves its logits by ~1.3 deviations; 0.2: over the bf16 tolerance
    check_tree_mask(tiny_model("qwen2").to(torch.bfloat16))
    with pytest.raises(TargetError, match="in float32, where rounding stays under"):
        check_tree_mask(tiny_model("qwen2"))


@pytest.mark.slow
def test_the_embedded_model_passes_in_bfloat16() -> None:
    """The real SmolLM2 in bf16 (`headway generate --dtype bfloat16`, bf16 by `auto` on an AMX
    CPU) was refused on an AVX-512 EPYC before the probe weighed its rounding (2026-11-28)."""
    model = load_target("smollm2-135m", dtype="bfloat16", device="cpu").model
    check_tree_mask(model)
    with pytest.raises(TargetError, match="ignores"):
        check_tree_mask(drop_4d_masks(load_target("smollm2-135m", dtype="bfloat16").model))


def test_the_probe_runs_once_per_model(monkeypatch: pytest.MonkeyPatch) -> None:
    model = tiny_model("qwen2")
    calls: list[int] = []
    real = probe.tree_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(probe, "tree_forward", counted)
    with torch.no_grad():
        check_tree_mask(model)
        check_tree_mask(model)
    assert calls == [1]


def test_a_model_whose_forward_fails_on_a_4d_mask_is_refused_in_one_line() -> None:
    """BLOOM builds its ALiBi biases from a 2-D padding mask and fails on a 4-D one: the probe
    turns the failure into one line instead of a traceback."""
    from transformers import BloomConfig, BloomForCausalLM

    torch.manual_seed(0)
    model = BloomForCausalLM(BloomConfig(vocab_size=96, hidden_size=32, n_layer=2, n_head=4))
    with pytest.raises(TargetError, match="fails on headway's 4-D tree attention mask") as error:
        check_tree_mask(model.eval())
    assert "\n" not in str(error.value) and "this bloom target" in str(error.value)


def test_a_model_that_places_tree_entries_by_cache_index_is_refused_in_fp32() -> None:
    """A forward that takes the mask but not the tree's ``position_ids`` (each entry placed by
    its index in the cache, as ALiBi's biases are) differs from the paths by far less than
    ignoring the mask would, but far beyond fp32 rounding: refused."""
    model = tiny_model("llama")
    stock = model.forward

    def forward(*args: Any, position_ids: Any = None, **kwargs: Any) -> Any:
        return stock(*args, **kwargs)  # transformers then counts positions along the cache

    model.forward = forward
    with pytest.raises(TargetError, match=r"in float32, where rounding stays under 0\.001"):
        check_tree_mask(model)


def test_an_alibi_target_is_refused_in_one_line() -> None:
    """MPT builds its ALiBi biases from each key's place in the cache: refused before any
    forward, whatever the dtype (in bf16 the difference would pass for rounding)."""
    from transformers import MptConfig, MptForCausalLM

    torch.manual_seed(0)
    config = MptConfig(vocab_size=96, d_model=32, n_heads=4, n_layers=2, max_seq_len=64)
    assert getattr(config.attn_config, "alibi", False)  # the default
    model = MptForCausalLM(config).eval().to(torch.bfloat16)
    with pytest.raises(TargetError, match="this mpt target adds ALiBi position biases") as error:
        check_tree_mask(model)
    assert "\n" not in str(error.value)
