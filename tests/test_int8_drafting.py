"""Int8 draft layers (headway/decode/int8_linear.py): the product close to fp32, only the named
layers converted, the output still the target's greedy output, ``dtype=auto`` deciding by the
timing and the probe, and clear errors where int8 cannot draft."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from headway.decode import int8_linear
from headway.decode.generate import generate
from headway.decode.int8_linear import (
    Int8Linear,
    int8_available,
    int8_layer_count,
    int8_pays,
    to_int8,
)
from headway.drafters import build
from headway.drafters.build import build_drafter
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.drafters.specs import EagleSpec, MedusaSpec
from headway.errors import ConfigError
from headway.eval.run import describe_drafter
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Model
from headway.heads.io import HeadsError
from headway.target import Target
from tests.test_eagle3 import NEW_TOKENS, PROMPT, TREE, target_and_truth, trained
from tests.test_formats import random_run

needs_kernels = pytest.mark.skipif(not int8_available(), reason="no int8 kernels in this torch")
"""For the tests that multiply in int8; the fallback's tests simulate the kernels' absence and
run everywhere."""


@needs_kernels
@pytest.mark.parametrize("shape", [(5, 96), (2, 3, 96), (1, 96), (96,)])
@pytest.mark.parametrize("bias", [False, True])
def test_the_int8_product_is_close_to_fp32(shape: tuple[int, ...], bias: bool) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(96, 40, bias=bias)
    x = torch.randn(*shape)
    with torch.no_grad():
        expected, out = layer(x), Int8Linear(layer)(x)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out - expected).abs().max() < 0.03 * expected.abs().max()
    with torch.no_grad():  # a bf16 input comes back in bf16
        assert Int8Linear(layer)(x.bfloat16()).dtype == torch.bfloat16


@needs_kernels
def test_only_the_named_layers_become_int8() -> None:
    draft = Eagle3Model(trained("llama").config)
    assert to_int8(draft, ("midlayer", "lm_head")) == 8  # q, k, v, o, gate, up, down, head
    assert type(draft.fc) is nn.Linear  # reads raw target states: left as it is
    assert isinstance(draft.lm_head, Int8Linear)
    assert isinstance(draft.midlayer.self_attn.q_proj, Int8Linear)
    assert isinstance(draft.midlayer.mlp.down_proj, Int8Linear)
    assert not [m for m in draft.midlayer.modules() if type(m) is nn.Linear]


@needs_kernels
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_int8_drafting_keeps_the_greedy_output(family: str) -> None:
    """The target verifies every draft: int8 layers change drafts at most, never the output;
    a trained drafter still has most of its drafts accepted."""
    model, truth = target_and_truth(family)
    draft = Eagle3Model(trained(family).config)
    draft.load_state_dict(trained(family).state_dict())
    to_int8(draft, build.INT8_LAYERS[Eagle3Model])
    drafter = Eagle3Drafter(draft, TargetHead.of(model), **TREE)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    assert result.tau > 2.0, result.accept_lengths


def _target(tmp_path: Path, method: str = "eagle3") -> tuple[Target, Path, list[int]]:
    model, truth = target_and_truth("llama")
    run = random_run(tmp_path / "run", method, model)
    return Target(model=model, tokenizer=None, source="tiny"), run, truth  # type: ignore[arg-type]


def _int8_layers(drafter: Any) -> int:
    return int8_layer_count(drafter.model)


@needs_kernels
@pytest.mark.parametrize("drafting", ["eager", "static"])
def test_dtype_int8_builds_a_drafter_with_int8_layers(tmp_path: Path, drafting: str) -> None:
    target, run, truth = _target(tmp_path)
    spec = EagleSpec(heads=str(run), dtype="int8", drafting=drafting, **TREE)  # type: ignore[arg-type]
    drafter = build_drafter(spec, target)
    assert _int8_layers(drafter) == 8
    result = generate(
        target.model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
    )
    assert result.tokens == truth
    assert describe_drafter(spec, drafter)["int8_draft_layers"] == 8  # the eval report says so


@needs_kernels
@pytest.mark.parametrize("pays", [True, False])
def test_dtype_auto_follows_the_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pays: bool
) -> None:
    target, run, _ = _target(tmp_path)
    asked: list[tuple[str, ...]] = []

    def timed(model: nn.Module, names: tuple[str, ...]) -> bool:
        asked.append(tuple(names))
        return pays

    monkeypatch.setattr(build, "int8_pays", timed)
    drafter = build_drafter(EagleSpec(heads=str(run), **TREE), target)  # dtype=auto
    assert asked == [("midlayer", "lm_head")]
    assert _int8_layers(drafter) == (8 if pays else 0)
    static = build_drafter(EagleSpec(heads=str(run), drafting="static", **TREE), target)
    assert _int8_layers(static) == 0 and len(asked) == 1  # auto converts eager drafting only
    plain = build_drafter(EagleSpec(heads=str(run), dtype="target", **TREE), target)
    assert _int8_layers(plain) == 0 and len(asked) == 1


@needs_kernels
def test_the_timing_takes_int8_only_where_it_is_faster(monkeypatch: pytest.MonkeyPatch) -> None:
    """:func:`int8_pays` compares a streamed pass of the layers in int8 with their fastest fp32
    route (here: every fp32 pass takes 1 s, the int8 one 0.5 or 0.9 s)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512), nn.Linear(512, 2048))
    weights = sum(p.numel() for name, p in model.named_parameters() if name.endswith("weight"))
    assert weights >= int8_linear.MIN_TIMED_WEIGHTS
    for int8_seconds, taken in ((0.5, True), (0.9, False)):
        timed = [1.0, 1.0, int8_seconds]  # stock, transposed, then int8
        calls: list[float] = []

        def seconds(function: Any, timed: list[float] = timed, calls: list[float] = calls) -> float:
            function()
            calls.append(timed[len(calls)])
            return calls[-1]

        assert int8_pays(model, ["0", "1", "2"], seconds=seconds) is taken
        assert len(calls) == 3


def test_small_layers_are_not_timed() -> None:
    model = nn.Sequential(nn.Linear(64, 64))

    def never(function: Any) -> float:
        raise AssertionError("timed")

    assert int8_pays(model, ["0"], seconds=never) is False


def test_without_int8_kernels_auto_drafts_in_fp32_and_int8_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A torch without the quantised kernels (simulated: the probe says no) drafts in the
    target's dtype under auto; asking for int8 says why it cannot."""
    target, run, _ = _target(tmp_path)
    monkeypatch.setattr(int8_linear, "int8_available", lambda: False)
    monkeypatch.setattr(build, "int8_available", lambda: False)
    big = nn.Sequential(nn.Linear(1024, 1024))
    assert int8_pays(big, ["0"]) is False
    drafter = build_drafter(EagleSpec(heads=str(run), **TREE), target)
    assert _int8_layers(drafter) == 0
    with pytest.raises(HeadsError, match="no working int8 linear kernels"):
        build_drafter(EagleSpec(heads=str(run), dtype="int8", **TREE), target)


def test_the_probe_says_no_when_the_kernels_fail(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*args: Any) -> Any:
        raise RuntimeError("Didn't find engine for operation quantized::linear_prepack NoQEngine")

    int8_available.cache_clear()
    monkeypatch.setattr(torch.ops.quantized, "linear_prepack", missing)
    try:
        torch.manual_seed(5)
        expected = torch.rand(3)
        torch.manual_seed(5)
        assert int8_available() is False
        assert torch.equal(torch.rand(3), expected)  # probing drew nothing from the global seed
    finally:
        int8_available.cache_clear()


@needs_kernels
def test_medusa_heads_draft_with_int8_lm_heads(tmp_path: Path) -> None:
    """``MedusaSpec(dtype="int8")``: each head's LM head multiplies int8 weights, the residual
    blocks stay as they are, and the output is still the target's."""
    target, run, truth = _target(tmp_path, "medusa1")
    spec = MedusaSpec(heads=str(run), dtype="int8")
    drafter = build_drafter(spec, target)
    assert isinstance(drafter, MedusaDrafter)
    assert int8_layer_count(drafter.heads) == 2
    assert describe_drafter(spec, drafter)["int8_draft_layers"] == 2
    assert sum(type(module) is nn.Linear for module in drafter.heads.modules()) == 2  # blocks
    result = generate(
        target.model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=()
    )
    assert result.tokens == truth


def test_medusa_heads_stay_in_the_targets_dtype_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No ``auto`` for Medusa heads: their int8 LM heads lose precision on the target's outlier
    channels, which no timing sees, so nothing is timed and nothing converted by default."""
    target, run, _ = _target(tmp_path, "medusa1")

    def never(model: nn.Module, names: tuple[str, ...]) -> bool:
        raise AssertionError("timed")

    monkeypatch.setattr(build, "int8_pays", never)
    drafter = build_drafter(MedusaSpec(heads=str(run)), target)
    assert isinstance(drafter, MedusaDrafter)
    assert int8_layer_count(drafter.heads) == 0
    with pytest.raises(ConfigError, match="choose target or int8"):
        MedusaSpec(heads=str(run), dtype="auto")  # type: ignore[arg-type]


def test_int8_where_it_cannot_draft_is_a_clear_error(tmp_path: Path) -> None:
    target, run, _ = _target(tmp_path, "eagle1")
    with pytest.raises(HeadsError, match="dtype=int8 is for EAGLE-3 drafters and Medusa heads"):
        build_drafter(EagleSpec(heads=str(run), dtype="int8", **TREE), target)
    with pytest.raises(ConfigError, match="not compiled"):
        EagleSpec(heads=str(run), dtype="int8", drafting="compiled")
    with pytest.raises(ConfigError, match="choose auto, target, bfloat16 or int8"):
        EagleSpec(heads=str(run), dtype="float16")  # type: ignore[arg-type]
