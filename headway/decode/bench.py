"""Timing harness for decoding: runs that are comparable because they are measured alike.

Every run is timed the same way: prompt ids ready on the device, wall time from the call to the
last generated token (prefill included), one prompt at a time (batch 1). Tokens/s is generated
tokens over that time. A warm-up generation runs first so one-time costs are not counted.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from headway.decode.forwards import EagerForward, TargetForward
from headway.decode.gemm import apply_gemm

T = TypeVar("T")


@dataclass
class RunStats:
    """Figures of one decoding configuration over a prompt set."""

    name: str
    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    accept_lengths: list[int] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per draft step (prefill excluded); 1.0 for plain decoding."""
        return statistics.fmean(self.accept_lengths) if self.accept_lengths else 1.0

    def add(self, output: Sequence[int], seconds: float, accept_lengths: Sequence[int]) -> None:
        self.tokens += len(output)
        self.seconds += seconds
        self.accept_lengths += list(accept_lengths)
        self.outputs.append(list(output))


def timed(function: Callable[[], T], device: torch.device) -> tuple[T, float]:
    """Call `function` (e.g. returning generated ids): its result and its wall time,
    synchronising CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    output = function()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return output, time.perf_counter() - start


def median_timed(
    run: Callable[[], T], device: torch.device, repeats: int, *, warm_up: bool = True
) -> tuple[float, T]:
    """The median wall seconds of ``repeats`` calls of ``run`` (each :func:`timed`), after one
    untimed call when ``warm_up`` (lazy initialisation, graph captures, compiles), and the
    last call's result (the warm-up's if ``repeats`` is 0)."""
    out = run() if warm_up or repeats < 1 else None
    times = []
    for _ in range(repeats):
        out, seconds = timed(run, device)
        times.append(seconds)
    return (statistics.median(times) if times else 0.0), out  # type: ignore[return-value]


def random_model(config: Path, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    """A causal LM shaped as ``config`` (a ``config.json``; ``model_type`` defaults to
    ``llama``) with seeded random weights, frozen, in eval mode: what a forward costs does not
    depend on the weights, so device scripts time a model's shape with nothing staged. On a
    CPU the stock GEMM route (no routes timed)."""
    fields = json.loads(config.read_text(encoding="utf-8"))
    shape = AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(shape, dtype=dtype).to(device).eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        apply_gemm(model, "stock")
    return model


@torch.inference_mode()
def forward_seconds(
    model: PreTrainedModel,
    prefix: Tensor,
    new_tokens: int,
    *,
    repeats: int = 5,
    tree: bool = False,
) -> float:
    """Median time of one forward over `new_tokens` tokens on a cache of `prefix`: a chain, or
    with ``tree`` a one-level tree (every drafted node a child of the root, so the 4-D tree mask
    is used as in real tree verification).

    This is the cost of verifying a tree of ``new_tokens`` nodes after a prompt like `prefix`,
    with the linear layers multiplied by the model's route (:mod:`headway.decode.gemm`).
    """
    eager = EagerForward(model)
    return target_seconds(eager, prefix, new_tokens, repeats=repeats, tree=tree)


@torch.inference_mode()
def target_seconds(
    target: TargetForward,
    prefix: Tensor,
    new_tokens: int,
    *,
    repeats: int = 5,
    tree: bool = False,
    prefilled: bool = False,
    warmup: bool = True,
) -> float:
    """:func:`forward_seconds` through ``target``, however it runs the model (eager, or a
    static cache with captured graphs); starts a generation of its own on ``target`` unless
    ``prefilled`` says its cache already holds exactly ``prefix`` (an earlier call's: each timed
    forward is truncated back to it). ``warmup``: run one untimed forward first (a caller that
    warms every size up itself, as :func:`~headway.decode.costs.verify_cost_table` does, times
    single forwards with ``repeats=1, warmup=False``)."""
    prefix_len = prefix.numel()
    if not prefilled:
        target.begin(prefix_len + new_tokens)
        target.prefill(prefix.unsqueeze(0), ())
    tokens = prefix[-1:].repeat(new_tokens).unsqueeze(0)
    if tree:  # every drafted node a child of the root
        parents = torch.full((new_tokens - 1,), -1, dtype=torch.long, device=prefix.device)
    else:
        parents = torch.arange(-1, new_tokens - 2, device=prefix.device)
    times = []
    for _ in range(repeats + int(warmup)):
        start = time.perf_counter()
        target.verify(tokens, parents, prefix_len, ())
        if prefix.device.type == "cuda":
            torch.cuda.synchronize(prefix.device)
        times.append(time.perf_counter() - start)
        target.truncate(prefix_len)
    return statistics.median(times[int(warmup) :])
