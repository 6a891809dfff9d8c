"""What a static EAGLE drafting step asks of a GPU, counted on a CPU (issue #32).

A captured step replays one kernel per op it holds; at batch 1 on a GPU those kernels are small
(a 135M target's verify forward of 1 or 33 tokens costs the same ~3 ms), so the step's cost
follows how many there are. This script decodes a few tokens with the static drafter and prints
per step:

- the ops the uncaptured step dispatches (views excluded, as they launch nothing), split into
  the draft forwards (``StaticDrafting._feed``) and everything around them (norms, LM head,
  top-k, masks, selection), with the most frequent ops;
- with ``--compiled``: the kernel calls in the code inductor writes for the compiled step
  (``drafting="compiled"``: the whole step as one graph), grouped as fused kernels, matrix
  products and other library calls.

Usage (the shipped drafter on the embedded target, ~2 minutes here with the compile):

    python scripts/step_kernels.py --compiled [--dtype bfloat16]

Inductor's CPU code stands in for its GPU code (both fuse the same elementwise chains; the
kernel counts, not their times, carry over).
"""

from __future__ import annotations

import argparse
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from headway.api import prompt_ids
from headway.decode.device_step import DeviceVerify
from headway.decode.gemm import apply_gemm
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter
from headway.drafters.specs import EagleSpec
from headway.drafters.static_eagle import StaticDrafting
from headway.evalsets import load_prompts
from headway.target import load_target

# Inductor's generated code: a kernel call in its ``call`` function.
_CALL = re.compile(r"^\s*(?:\w+(?:, \w+)* = )?(cpp_fused\w*|triton\w*|extern_kernels\.\w+|"
                   r"torch\.ops\.\w+\.\w+(?:\.\w+)?)(?:\.run)?\(")  # fmt: skip


class OpCounter(TorchDispatchMode):
    """Non-view aten ops by region (the innermost :meth:`region` open) and name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: dict[str, Counter[str]] = {}
        self.calls: Counter[str] = Counter()
        self.open: list[str] = []  # the regions open, innermost last

    @contextmanager
    def region(self, name: str) -> Iterator[None]:
        self.open.append(name)
        self.calls[name] += 1
        try:
            yield
        finally:
            self.open.pop()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.open and not getattr(func, "is_view", False):
            counter = self.ops.setdefault(self.open[-1], Counter())
            counter[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


@contextmanager
def regions_of(counter: OpCounter) -> Iterator[None]:
    """Count the static drafter's step as ``"step"``, the step's draft forwards as
    ``"forwards"`` (the prompt's, fed outside a step, are not counted) and the device step's
    verify forward as ``"verify"``."""
    patches: list[tuple[type, str, str]] = [
        (StaticDrafting, "_step", "step"),
        (StaticDrafting, "_feed", "forwards"),
        (DeviceVerify, "_body", "verify"),
    ]
    originals = [vars(owner)[name] for owner, name, _ in patches]

    def wrapped(original: Callable[..., Any], region: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            if region == "forwards" and "step" not in counter.open:
                return original(*args, **kwargs)  # the prompt's, not a step's
            with counter.region(region):
                return original(*args, **kwargs)

        return run

    for (owner, name, region), original in zip(patches, originals, strict=True):
        setattr(owner, name, wrapped(original, region))
    try:
        yield
    finally:
        for (owner, name, _), original in zip(patches, originals, strict=True):
            setattr(owner, name, original)


def eager_ops(decode: Callable[[], object]) -> tuple[dict[str, Counter[str]], int]:
    """Ops per region over ``decode()`` (uncaptured static drafting), and the steps drafted."""
    counter = OpCounter()
    with regions_of(counter), torch.inference_mode(), counter:
        decode()
    return counter.ops, counter.calls["step"]


@contextmanager
def inductor_code() -> Iterator[list[str]]:
    """The code inductor writes while the block runs (one string per compiled graph)."""
    codes: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            message = record.getMessage()
            if "def call(" in message:
                codes.append(message)

    logger = logging.getLogger("torch._inductor.codecache.__output_code")  # output_code_log
    handler, kept = Keep(logging.DEBUG), (logger.level, logger.propagate)
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # to this handler only, not printed
    try:
        yield codes
    finally:
        logger.removeHandler(handler)
        logger.level, logger.propagate = kept


def kernel_calls(code: str) -> Counter[str]:
    """Kernel calls in a graph's ``call`` function, grouped: fused (inductor's own kernels),
    each library op by name."""
    body = code[code.index("def call(") :]
    calls: Counter[str] = Counter()
    for line in body.splitlines()[1:]:
        if re.match(r"^\s*def ", line) or re.match(r"^\S", line):
            break  # the next function, or the module level
        match = _CALL.match(line)
        if match:
            name = match.group(1)
            calls["fused" if name.startswith(("cpp_fused", "triton")) else name] += 1
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target (name or folder)")
    parser.add_argument("--heads", default="drafters/smollm2-135m-eagle3", help="EAGLE drafter")
    parser.add_argument("--top-k", type=int, default=8, help="tree: children per node")
    parser.add_argument("--depth", type=int, default=6, help="tree: levels")
    parser.add_argument("--total-tokens", type=int, default=32, help="tree: nodes verified")
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens decoded per count")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16"),
        help="the target's dtype (the drafter takes it)",
    )
    parser.add_argument("--compiled", action="store_true", help="also compile the step")
    parser.add_argument(
        "--compiled-verify",
        action="store_true",
        help="with --compiled, compile the verify forward too (--verify compiled; several "
        "minutes on a 2-core CPU): a graph per block size, its attention calls one per layer",
    )
    args = parser.parse_args(argv)
    target = load_target(args.target, dtype=args.dtype, device="cpu")
    apply_gemm(target.model, "stock")  # the ops a GPU's stock route dispatches
    prompt = load_prompts("mt-bench", limit=1)[0]
    ids = prompt_ids(target, prompt.text, chat=prompt.chat)
    shape = {"top_k": args.top_k, "depth": args.depth, "total_tokens": args.total_tokens}

    def decoder(drafting: str, verify: str = "captured") -> Decoder:
        spec = EagleSpec(
            heads=args.heads,
            drafting=drafting,  # type: ignore[arg-type]
            dtype="target",  # the ops a GPU dispatches, not a CPU's int8 draft layers
            **shape,
        )
        drafter = build_drafter(spec, target)
        return Decoder(target.model, drafter, DecodeOptions(verify=verify))  # type: ignore[arg-type]

    static = decoder("static")
    ops, steps = eager_ops(
        lambda: static.generate(ids, max_new_tokens=args.new_tokens, eos_token_ids=())
    )
    forwards = sum(ops.get("forwards", Counter()).values()) / steps
    around = sum(ops.get("step", Counter()).values()) / steps
    print(f"# one static drafting step, {shape}, {steps} steps ({args.dtype}, CPU, uncaptured)\n")
    print(f"ops a step: {forwards + around:.0f} ({forwards:.0f} in the draft forwards, "
          f"{around:.0f} around them)")  # fmt: skip
    common = (ops.get("step", Counter()) + ops.get("forwards", Counter())).most_common(12)
    print("most frequent: " + ", ".join(f"{name} {n / steps:.0f}" for name, n in common))
    verify = sum(ops.get("verify", Counter()).values()) / steps
    print(f"for scale, the verify forward of the device step: {verify:.0f} ops a step")
    if args.compiled:
        with inductor_code() as codes:
            path = "compiled" if args.compiled_verify else "captured"
            compiled = decoder("compiled", path)
            compiled.generate(ids, max_new_tokens=args.new_tokens, eos_token_ids=())
        for index, code in enumerate(codes):
            calls = kernel_calls(code)
            shown = ", ".join(f"{name} {n}" for name, n in calls.most_common())
            print(f"compiled graph {index}: {sum(calls.values())} kernel calls ({shown})")


if __name__ == "__main__":
    main()
