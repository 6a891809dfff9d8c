"""Small-block GEMM routing: same products as F.linear, installed only while a verify forward of
2+ tokens runs, never on layers it does not understand, and lossless end to end."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional

from headway.decode import gemm
from headway.decode.drafters import OracleDrafter, PromptLookupDrafter
from headway.decode.gemm import (
    MAX_ROWS,
    resolve_gemm,
    routed_linears,
    small_block_linear,
    transposed_is_faster,
)
from headway.decode.generate import generate
from headway.decode.kv import new_cache, prefill, tree_forward
from headway.decode.options import DecodeOptions
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, tiny_model

PROMPT = torch.tensor([1, 7, 23, 45, 12, 9, 60, 7, 23, 45])


@pytest.mark.parametrize("pad_single", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, MAX_ROWS, MAX_ROWS + 1, 40])
def test_routed_linear_equals_f_linear(rows: int, bias: bool, pad_single: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(1, rows, 48)
    calls: list[int] = []
    mm = torch.mm

    def counted_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(b.shape[1])
        return mm(a, b)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "mm", counted_mm)
        routed = small_block_linear(layer, pad_single=pad_single)(x)
    assert routed.shape == (1, rows, 80) and routed.is_contiguous()
    torch.testing.assert_close(routed, functional.linear(x, layer.weight, layer.bias))
    smallest = 1 if pad_single else 2
    if smallest <= rows <= MAX_ROWS:  # one (W · xᵀ) product, a single row padded to two
        assert calls == [max(rows, 2)]
    else:  # outside the routed range: the stock call itself
        assert calls == []
        assert torch.equal(routed, functional.linear(x, layer.weight, layer.bias))


def test_resolve_gemm_follows_device_dtype_choice_and_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[tuple[int, ...]] = []

    def faster(weight: torch.Tensor) -> bool:
        measured.append(tuple(weight.shape))
        return True

    monkeypatch.setattr(gemm, "transposed_is_faster", faster)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 16))
    assert resolve_gemm(model, "auto") and measured == [(16, 4)]  # fp32 CPU: the largest timed
    monkeypatch.setattr(gemm, "transposed_is_faster", lambda weight: False)
    assert not resolve_gemm(model, "auto")  # measured no faster here: stock
    assert not resolve_gemm(model, "stock")
    assert resolve_gemm(model.to(torch.bfloat16), "transposed")
    monkeypatch.setattr(gemm, "transposed_is_faster", faster)
    assert not resolve_gemm(model, "auto") and len(measured) == 1  # bf16: never considered
    assert not resolve_gemm(nn.ReLU(), "auto")  # no linear layer at all
    with pytest.raises(ValueError, match="gemm must be"):
        resolve_gemm(model, "fast")  # type: ignore[arg-type]


def test_gemm_module_keeps_no_state() -> None:
    """Nothing a call decides is remembered: no process-wide preference, no measurement memo."""
    state = {
        name: value
        for name, value in vars(gemm).items()
        if not name.startswith("__") and isinstance(value, dict | list | set)
    }
    assert state == {}


def test_transposed_is_faster_compares_the_two_timings() -> None:
    timings = iter([1.0, 0.5, 1.0, 0.9])  # (stock, transposed) per call

    def seconds(function: object) -> float:
        return next(timings)

    assert transposed_is_faster(torch.zeros(8, 4), seconds=seconds)  # 0.5 <= 0.8 x 1.0
    assert not transposed_is_faster(torch.zeros(8, 5), seconds=seconds)  # 0.9: not enough
    assert next(timings, None) is None


class _Quantized(nn.Linear):
    """Stands for a Linear subclass with its own weight format (e.g. int8): never rerouted."""


def test_routing_is_scoped_and_leaves_other_layers_alone() -> None:
    plain, subclass, wrapped = nn.Linear(4, 4), _Quantized(4, 4), nn.Linear(4, 4)
    own_forward = wrapped.forward
    wrapped.__dict__["forward"] = own_forward  # as accelerate's hooks install one
    model = nn.Sequential(plain, subclass, wrapped)
    with routed_linears(model, True):
        assert "forward" in plain.__dict__
        assert "forward" not in subclass.__dict__
        assert wrapped.__dict__["forward"] is own_forward
        with routed_linears(model, True):  # nested: the outer one owns the install
            pass
        assert "forward" in plain.__dict__
    assert "forward" not in plain.__dict__ and wrapped.__dict__["forward"] is own_forward
    with pytest.raises(RuntimeError), routed_linears(model, True):
        raise RuntimeError("a failing forward")
    assert "forward" not in plain.__dict__  # removed on error too


def _routed_flags(model: Any, block: int, route: bool) -> tuple[torch.Tensor, list[bool]]:
    """Logits of one tree forward over a chain of ``block`` tokens after PROMPT, and whether the
    LM head ran with the routed forward installed."""
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    flags: list[bool] = []
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda m, _: flags.append("forward" in m.__dict__))
    tokens = torch.arange(20, 20 + block)[None]
    parents = torch.arange(-1, block - 2)
    logits, _ = tree_forward(model, cache, tokens, parents, PROMPT.numel(), small_blocks=route)
    handle.remove()
    return logits, flags


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tree_forward_routes_blocks_of_two_or_more_only(family: str) -> None:
    model = tiny_model(family)
    single, single_flags = _routed_flags(model, 1, True)
    stock_single, _ = _routed_flags(model, 1, False)
    assert single_flags == [False] and torch.equal(single, stock_single)  # 1 token: stock, exact
    block, flags = _routed_flags(model, 4, True)
    stock_block, stock_flags = _routed_flags(model, 4, False)
    assert flags == [True] and stock_flags == [False]
    torch.testing.assert_close(block, stock_block, atol=1e-5, rtol=0)
    assert "forward" not in model.get_output_embeddings().__dict__


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("gemm", ["stock", "transposed"])
def test_greedy_output_is_identical_with_either_gemm(family: str, gemm: str) -> None:
    model = tiny_model(family)
    expected = hf_greedy(model, PROMPT, 24, None)
    for drafter in (OracleDrafter(expected, 3), PromptLookupDrafter(min_ngram=1)):
        result = generate(
            model,
            PROMPT,
            drafter=drafter,
            max_new_tokens=24,
            eos_token_ids=[],
            options=DecodeOptions(gemm=gemm),  # type: ignore[arg-type]
        )
        assert result.tokens == expected
