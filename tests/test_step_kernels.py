"""scripts/step_kernels.py: a static drafting step's ops counted by region, and the kernel calls
of the code inductor writes for a compiled one."""

from __future__ import annotations

import pytest
import torch

from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.hardware import has_cxx_compiler
from tests.scripts_loader import load_script
from tests.test_static_eagle import PROMPT, SHAPES, _pair, target_and_truth

CODE = """
def call(self, args):
    buf0 = empty_strided_cpu((8, 64), (64, 1), torch.float32)
    cpp_fused_add_mean_mul_pow_rsqrt_0(arg0_1, buf0)
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    buf2 = torch.ops.aten.topk.default(buf1, 8)
    cpp_fused_add_1(buf1, buf2)
    extern_kernels.mm(buf1, arg2_1, out=buf3)
    return (buf3, )

def benchmark_compiled_module(times=10, repeat=10):
    extern_kernels.mm(a, b, out=c)
"""


def test_kernel_calls_are_read_from_the_call_function_only() -> None:
    calls = load_script("step_kernels.py").kernel_calls(CODE)
    assert calls == {"fused": 2, "extern_kernels.mm": 2, "torch.ops.aten.topk.default": 1}


def test_a_steps_ops_split_into_the_draft_forwards_and_the_rest() -> None:
    script = load_script("step_kernels.py")
    model, truth = target_and_truth("llama")
    _, static = _pair("trained", model, SHAPES["tree"])
    decoder = Decoder(model, static, DecodeOptions(verify="captured"))
    tokens: list[int] = []
    ops, steps = script.eager_ops(
        lambda: tokens.extend(decoder.generate(PROMPT, max_new_tokens=8, eos_token_ids=()).tokens)
    )
    assert tokens == truth[:8] and steps > 0
    depth = SHAPES["tree"]["depth"]
    assert ops["forwards"]["scaled_dot_product_attention"] == steps * depth  # a feed a level
    assert ops["step"]["topk"] >= steps * depth  # a level's children, around the forwards
    layers = model.config.num_hidden_layers
    assert ops["verify"]["scaled_dot_product_attention"] == steps * layers  # device steps
    assert "_feed" not in vars(type(static)) and "Keep" not in vars(script)  # patches undone


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
def test_the_code_inductor_writes_is_caught_and_counted() -> None:
    script = load_script("step_kernels.py")
    torch._dynamo.reset()

    def norm_then_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)) @ w

    with script.inductor_code() as codes:
        torch.compile(norm_then_product, dynamic=False)(torch.randn(4, 8), torch.randn(8, 8))
    (code,) = codes
    calls = script.kernel_calls(code)
    assert calls["fused"] >= 1 and sum(calls.values()) >= 2  # the norm fused, then the product
