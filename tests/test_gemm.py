"""GEMM routes (transposed small blocks, packed oneDNN weights): same products as F.linear,
installed only while a routed forward runs, never on layers they do not understand, packed weights
remade when a weight changes, and lossless end to end."""

from __future__ import annotations

import gc
from collections.abc import MutableMapping
from typing import Any
from weakref import WeakKeyDictionary

import pytest
import torch
from torch import nn
from torch.nn import functional

from headway.decode import gemm, gemm_routes, packed
from headway.decode.gemm import (
    MAX_PACKED_ROWS,
    MAX_ROWS,
    Route,
    apply_gemm,
    fastest_route,
    forget_packed,
    gemm_choice,
    packed_linear,
    packed_weight,
    packing_available,
    routed_linears,
    small_block_linear,
)
from headway.decode.generate import generate
from headway.decode.kv import new_cache, prefill, tree_forward
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.oracle import OracleDrafter
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, tiny_model

PROMPT = torch.tensor([1, 7, 23, 45, 12, 9, 60, 7, 23, 45])
needs_packing = pytest.mark.skipif(not packing_available(), reason="no oneDNN linear kernels")


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, MAX_PACKED_ROWS, MAX_PACKED_ROWS + 1])
def test_packed_linear_equals_f_linear(rows: int, bias: bool, dtype: torch.dtype) -> None:
    if not packing_available(dtype):
        pytest.skip(f"this CPU's oneDNN has no {dtype} linear kernels (`headway env`)")
    torch.manual_seed(rows)
    layer = nn.Linear(48, 80, bias=bias).to(dtype)
    x = torch.randn(1, rows, 48, dtype=dtype)
    with torch.inference_mode():
        routed = packed_linear(layer)(x)
        stock = functional.linear(x, layer.weight, layer.bias)
    assert routed.shape == (1, rows, 80) and routed.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(routed, stock, atol=1e-5, rtol=1e-5)
    else:  # bf16: the default tolerance of that dtype
        torch.testing.assert_close(routed, stock)
    assert (layer in packed._PACKED) == (rows <= MAX_PACKED_ROWS)  # beyond: the stock call


@needs_packing
def test_packed_route_remakes_a_changed_weight_and_leaves_autograd_alone() -> None:
    torch.manual_seed(0)
    layer = nn.Linear(16, 8)
    forward = packed_linear(layer)
    x = torch.randn(3, 16)
    with torch.no_grad():
        before = forward(x)
        layer.weight.mul_(2)  # in place, tracked: the version counter moves
        torch.testing.assert_close(forward(x) - layer.bias, 2 * (before - layer.bias))
        layer.weight = nn.Parameter(torch.zeros(8, 16))  # a new tensor
        torch.testing.assert_close(forward(x), layer.bias.expand(3, 8))
    held = packed._PACKED[layer][1]
    assert held is packed_weight(layer)  # one entry per layer, replaced only on a change
    forget_packed(nn.Sequential(layer))
    assert layer not in packed._PACKED
    x.requires_grad_(True)
    forward(x).sum().backward()  # with autograd: the stock call, gradients as usual
    assert x.grad is not None and torch.equal(x.grad, layer.weight.sum(0).expand(3, 16))


def test_apply_gemm_follows_device_dtype_choice_and_measurement(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    measured: list[list[tuple[int, ...]]] = []

    def transposed(linears: list[nn.Linear], packing: bool) -> str:
        measured.append([tuple(module.weight.shape) for module in linears])
        return "transposed"

    monkeypatch.setattr(gemm, "fastest_route", transposed)
    for module in (gemm, gemm_routes):  # the route's check and the timed candidates
        monkeypatch.setattr(module, "packing_available", lambda dtype: True)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 16))
    assert gemm_choice(model) == "auto" and gemm.gemm_route(model) == "transposed"  # lazily
    assert measured == [[(4, 4), (16, 4)]]  # fp32 CPU: every plain layer timed, in order
    assert apply_gemm(model, "auto") == "transposed"  # applied once: not timed again
    assert apply_gemm(model, "stock") == "stock" and gemm_choice(model) == "stock"
    assert gemm.gemm_route(model) == "stock"
    assert apply_gemm(model, "auto") == "transposed" and len(measured) == 1  # back: remembered
    assert apply_gemm(model.to(torch.float16), "transposed") == "transposed"
    assert apply_gemm(model, "auto") == "stock" and len(measured) == 1  # fp16: never timed
    model.to(torch.bfloat16)  # another dtype: the recorded choice is decided again
    assert gemm.gemm_route(model) == "transposed" and len(measured) == 2  # bf16: timed
    assert apply_gemm(nn.ReLU(), "auto") == "stock"  # no linear layer at all
    with pytest.raises(ValueError, match="gemm must be"):
        apply_gemm(model, "fast")  # type: ignore[arg-type]


@pytest.mark.parametrize(("free", "room"), [(4096, False), (2**40, True), (None, True)])
def test_auto_packs_only_with_room_for_a_copy(
    monkeypatch: pytest.MonkeyPatch, free: int | None, room: bool
) -> None:
    offered: list[bool] = []

    def route(weight: torch.Tensor, packing: bool) -> str:
        offered.append(packing)
        return "stock"

    monkeypatch.setattr(gemm, "fastest_route", route)
    for module in (gemm, gemm_routes):  # the route's check and the timed candidates
        monkeypatch.setattr(module, "packing_available", lambda dtype: True)
    monkeypatch.setattr(gemm, "available_memory", lambda: free)  # None: unknown (not Linux)
    apply_gemm(nn.Linear(64, 64), "auto")  # 16 KiB of weights: needs 32 KiB available
    assert offered == [room]


@needs_packing
def test_a_prefill_takes_the_models_route() -> None:
    """A prompt's prefill multiplies on the route applied to the model, as verify forwards do
    (packed: 147 ms against 290 stock for 180 tokens of SmolLM2 on an AVX-512 EPYC)."""
    model = tiny_model("llama")
    prompt = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    for route, held in (("packed", len(gemm._plain_linears(model))), ("stock", 0)):
        assert apply_gemm(model, route) == route  # type: ignore[arg-type]
        packed.forget_packed(model)
        with torch.inference_mode():  # as decoding runs (autograd keeps the stock call)
            prefill(model, new_cache(model), prompt)
        assert len(packed.held_packed(model)) == held


@needs_packing
def test_resolving_packed_reorders_every_plain_weight() -> None:
    model = nn.Sequential(nn.Linear(4, 4), _Quantized(4, 4), nn.Linear(4, 16))
    assert apply_gemm(model, "packed") == "packed"
    held = {module for module in model if module in packed._PACKED}
    assert held == {model[0], model[2]}  # the subclass keeps its own forward


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packed_route_is_refused_off_the_cpu() -> None:
    with pytest.raises(ValueError, match="for models on a CPU"):
        apply_gemm(nn.Linear(4, 4).cuda(), "packed")
    assert apply_gemm(nn.Linear(4, 4).cuda(), "auto") == "stock"


def test_packed_route_is_refused_without_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in (gemm, gemm_routes):  # the route's check and the timed candidates
        monkeypatch.setattr(module, "packing_available", lambda dtype: False)
    with pytest.raises(ValueError, match="oneDNN lacks the kernels here"):
        apply_gemm(nn.Linear(4, 4), "packed")
    timings = iter([1.0, 0.5])  # stock, transposed: packed is not even timed
    assert fastest_route([nn.Linear(4, 8)], seconds=lambda f: next(timings)) == "transposed"


def test_gemm_module_keeps_no_state_but_per_model_records() -> None:
    """No process-wide preference: the state is the choice applied to each model and the
    reordered weights, both weakly keyed by module (gone with it), beside the probe of what
    this CPU runs (one answer per dtype)."""
    state = {
        (module.__name__, name): value
        for module in (gemm, gemm_routes, packed)
        for name, value in vars(module).items()
        if not name.startswith("__") and isinstance(value, dict | list | set | MutableMapping)
    }
    assert sorted(state) == [
        ("headway.decode.gemm", "_APPLIED"),
        ("headway.decode.packed", "_PACKED"),
    ]
    assert all(isinstance(value, WeakKeyDictionary) for value in state.values())
    if packing_available():
        layer = nn.Linear(4, 4)
        packed_weight(layer)
        assert layer in packed._PACKED
        del layer
        gc.collect()
        assert not any(module.in_features == 4 for module in packed._PACKED)


@pytest.mark.parametrize(
    ("timings", "packing", "dtype", "route"),
    [
        ([1.0, 0.5, 0.6], True, torch.float32, "packed"),  # both pay, packed the faster
        ([1.0, 0.7, 0.5], True, torch.float32, "transposed"),  # both pay, transposed the faster
        ([1.0, 0.9, 0.5], True, torch.float32, "transposed"),  # packed not enough, transposed is
        ([1.0, 0.9, 0.9], True, torch.float32, "stock"),  # neither clearly faster
        ([1.0, 0.9], True, torch.bfloat16, "stock"),  # bf16: transposed never considered
        ([1.0, 0.5], True, torch.bfloat16, "packed"),
        ([1.0, 0.5], False, torch.float32, "transposed"),  # no oneDNN: packed never timed
    ],
)
def test_fastest_route_takes_the_fastest_that_clearly_beats_stock(
    timings: list[float], packing: bool, dtype: torch.dtype, route: str
) -> None:
    if packing and not packing_available(dtype):
        pytest.skip(f"this CPU's oneDNN has no {dtype} linear kernels (`headway env`)")
    answers = iter(timings)
    layers = [nn.Linear(4, 8, dtype=dtype), nn.Linear(8, 4, dtype=dtype)]
    chosen = fastest_route(layers, seconds=lambda function: next(answers), packing=packing)
    assert chosen == route and next(answers, None) is None
    if route != "packed":  # copies made for the test are dropped unless the route is taken
        assert not any(module in packed._PACKED for module in layers)


def test_the_timed_pass_streams_every_layer_on_each_verify_block_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What "auto" times is what a forward does: every layer in order, per block size (a layer
    timed alone stays in the cache and misjudged whole forwards on a Xeon), on one token and
    on 2, 4 and 8 (on 1 and 8 alone, an AVX2-only EPYC's choice flipped from run to run)."""
    calls: list[tuple[int, int]] = []
    layers = [nn.Linear(4, 8), nn.Linear(8, 4)]
    monkeypatch.setattr(
        gemm_routes, "_stock", lambda module, x: calls.append((module.in_features, x.shape[0]))
    )
    gemm_routes._linear_pass(layers, "stock")()
    assert calls == [(features, rows) for rows in (1, 2, 4, MAX_ROWS) for features in (4, 8)]


def test_auto_times_a_model_whose_layers_differ_in_dtype() -> None:
    """A model that keeps one layer in another dtype (say an fp32 head under bf16 layers) is
    timed with inputs of each layer's own dtype."""
    model = nn.Sequential(nn.Linear(8, 16).to(torch.bfloat16), nn.Linear(16, 4))
    assert apply_gemm(model, "auto") in ("stock", "transposed", "packed")


class _Quantized(nn.Linear):
    """Stands for a Linear subclass with its own weight format (e.g. int8): never rerouted."""


def test_routing_is_scoped_and_leaves_other_layers_alone() -> None:
    plain, subclass, wrapped = nn.Linear(4, 4), _Quantized(4, 4), nn.Linear(4, 4)
    own_forward = wrapped.forward
    wrapped.__dict__["forward"] = own_forward  # as accelerate's hooks install one
    model = nn.Sequential(plain, subclass, wrapped)
    with routed_linears(model, "transposed"):
        assert "forward" in plain.__dict__
        assert "forward" not in subclass.__dict__
        assert wrapped.__dict__["forward"] is own_forward
        with routed_linears(model, "transposed"):  # nested: the outer one owns the install
            pass
        assert "forward" in plain.__dict__
    assert "forward" not in plain.__dict__ and wrapped.__dict__["forward"] is own_forward
    with pytest.raises(RuntimeError), routed_linears(model, "transposed"):
        raise RuntimeError("a failing forward")
    assert "forward" not in plain.__dict__  # removed on error too


def _routed_flags(model: Any, block: int, route: Route) -> tuple[torch.Tensor, list[bool]]:
    """Logits of one tree forward over a chain of ``block`` tokens after PROMPT, and whether the
    LM head ran with the routed forward installed."""
    cache = new_cache(model)
    prefill(model, cache, PROMPT[None])
    flags: list[bool] = []
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(lambda m, _: flags.append("forward" in m.__dict__))
    tokens = torch.arange(20, 20 + block)[None]
    parents = torch.arange(-1, block - 2)
    apply_gemm(model, route)
    logits, _ = tree_forward(model, cache, tokens, parents, PROMPT.numel())
    handle.remove()
    return logits, flags


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tree_forward_routes_transposed_blocks_of_two_or_more_only(family: str) -> None:
    model = tiny_model(family)
    single, single_flags = _routed_flags(model, 1, "transposed")
    stock_single, _ = _routed_flags(model, 1, "stock")
    assert single_flags == [False] and torch.equal(single, stock_single)  # 1 token: stock, exact
    block, flags = _routed_flags(model, 4, "transposed")
    stock_block, stock_flags = _routed_flags(model, 4, "stock")
    assert flags == [True] and stock_flags == [False]
    torch.testing.assert_close(block, stock_block, atol=1e-5, rtol=0)
    assert "forward" not in model.get_output_embeddings().__dict__


@needs_packing
@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tree_forward_routes_every_packed_block_one_token_included(family: str) -> None:
    model = tiny_model(family)
    for block in (1, 4):
        packed, flags = _routed_flags(model, block, "packed")
        stock, _ = _routed_flags(model, block, "stock")
        assert flags == [True]
        torch.testing.assert_close(packed, stock, atol=1e-5, rtol=0)
    assert "forward" not in model.get_output_embeddings().__dict__


@torch.no_grad()
@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("gemm", ["stock", "transposed", "packed"])
def test_greedy_output_is_identical_with_every_gemm(family: str, gemm: str) -> None:
    if gemm == "packed" and not packing_available():
        pytest.skip("no oneDNN linear kernels")
    model = tiny_model(family)
    expected = hf_greedy(model, PROMPT, 24, None)
    apply_gemm(model, gemm)  # type: ignore[arg-type]
    for drafter in (OracleDrafter(expected, 3), PromptLookupDrafter(min_ngram=1)):
        result = generate(
            model,
            PROMPT,
            drafter=drafter,
            max_new_tokens=24,
            eos_token_ids=[],
        )
        assert result.tokens == expected


def test_auto_is_timed_once_per_model_and_every_decoding_forward_reads_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two decoders over one model time ``"auto"`` once; the verify forwards take the route
    recorded for the model, and forwards outside decoding stay stock."""
    timed: list[int] = []

    def transposed(linears: list[nn.Linear], packing: bool) -> str:
        timed.append(len(linears))
        return "transposed"

    monkeypatch.setattr(gemm, "fastest_route", transposed)
    model = tiny_model("llama")
    expected = hf_greedy(model, PROMPT, 12, None)
    for _ in range(2):
        result = generate(
            model, PROMPT, drafter=OracleDrafter(expected, 3), max_new_tokens=12, eos_token_ids=[]
        )
        assert result.tokens == expected
    assert len(timed) == 1 and gemm.gemm_route(model) == "transposed"
    _, flags = _routed_flags(model, 4, "transposed")
    assert flags == [True]
    assert "forward" not in model.get_output_embeddings().__dict__  # outside: stock
