"""Chained device steps (headway/decode/device_chain.py): several greedy device steps of a static
drafter run back to back on the device, one host read a run, and decode exactly what one device
step at a time decodes."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from headway.decode import captured
from headway.decode.device_chain import DeviceChain
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams
from headway.drafters import static_eagle
from headway.eval.dispatch_decoding import count_decoding
from tests.test_device_step import random_medusa
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_generate import hf_greedy
from tests.test_static_eagle import SHAPES, _pair

LONG_PROMPT = torch.arange(1, 60) % 90 + 3
RUNS = ((PROMPT, 30), (LONG_PROMPT, 41), (PROMPT, 30))


@pytest.mark.parametrize(
    ("kind", "shape"),
    [*(("random", shape) for shape in sorted(SHAPES)), ("eagle1", "tree"), ("eagle3.1", "tree")],
)
def test_chained_steps_are_the_single_steps(
    kind: str, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokens and acceptance lengths equal one device step at a time's (and transformers'
    greedy output) for runs of 2 and 5 steps, across target and draft caches that grow
    mid-generation, for lengths that end inside a run, and again from the same decoder."""
    monkeypatch.setattr(captured, "MIN_CAPACITY", 16)
    monkeypatch.setattr(static_eagle, "MIN_CAPACITY", 16)
    model, _ = target_and_truth("llama")
    for chain in (2, 5):
        _, single = _pair(kind, model, SHAPES[shape])
        _, chained = _pair(kind, model, SHAPES[shape])
        one = Decoder(model, single, DecodeOptions(verify="captured", chain=1))
        many = Decoder(model, chained, DecodeOptions(verify="captured", chain=chain))
        for prompt, new in ((PROMPT, 30), (LONG_PROMPT, 41), (PROMPT, 30)):
            mine = many.generate(prompt, max_new_tokens=new, eos_token_ids=())
            theirs = one.generate(prompt, max_new_tokens=new, eos_token_ids=())
            assert mine.tokens == theirs.tokens == hf_greedy(model, prompt, new, eos=None)
            assert mine.accept_lengths == theirs.accept_lengths
        assert isinstance(many._chain, DeviceChain) and one._chain is None


def test_a_stop_inside_a_run_drops_the_rest_and_cuts_the_cache_back() -> None:
    """An EOS that a run commits in its middle step ends the generation there, as the single
    steps do; the target's cache keeps exactly the kept tokens' entries; the next generation
    from the same decoder is whole again."""
    model, _ = target_and_truth("llama")
    _, single = _pair("trained", model, SHAPES["tree"])
    _, chained = _pair("trained", model, SHAPES["tree"])
    one = Decoder(model, single, DecodeOptions(verify="captured", chain=1))
    many = Decoder(model, chained, DecodeOptions(verify="captured", chain=4))
    truth = one.generate(PROMPT, max_new_tokens=30, eos_token_ids=()).tokens
    for eos in (truth[5], truth[12], truth[-1]):
        mine = many.generate(PROMPT, max_new_tokens=30, eos_token_ids=(eos,))
        theirs = one.generate(PROMPT, max_new_tokens=30, eos_token_ids=(eos,))
        assert mine.tokens == theirs.tokens and mine.stop_reason == theirs.stop_reason
        assert mine.accept_lengths == theirs.accept_lengths
        assert isinstance(many.target, captured.StaticForward)
        assert many.target.cache.length == len(PROMPT) + len(mine.tokens) - 1
    assert many.generate(PROMPT, max_new_tokens=30, eos_token_ids=()).tokens == truth


@pytest.mark.parametrize("kind", ["plain", "eagle3", "medusa"])
def test_sampled_runs_draw_what_single_steps_draw(kind: str) -> None:
    """Sampled device steps chain too: a run draws every step's uniforms before it, in the
    order single steps draw theirs, so with a host generator seeded alike the tokens and
    acceptance lengths are one step at a time's (whose distribution is the target's:
    tests/test_device_step.py); different seeds give different answers."""
    model, _ = target_and_truth("llama")

    def drafter() -> Any:
        if kind == "eagle3":
            return _pair("random", model, SHAPES["tree"])[1]
        return random_medusa(model) if kind == "medusa" else None

    sampling = SamplingParams(temperature=1.0)
    one = Decoder(model, drafter(), DecodeOptions(verify="captured", chain=1))
    many = Decoder(model, drafter(), DecodeOptions(verify="captured", chain=4))
    answers = set()
    for seed in range(3):
        mine, theirs = (
            run.generate(
                PROMPT,
                max_new_tokens=30,
                eos_token_ids=(),
                sampling=sampling,
                generator=torch.Generator().manual_seed(seed),
            )
            for run in (many, one)
        )
        assert mine.tokens == theirs.tokens and mine.accept_lengths == theirs.accept_lengths
        answers.add(tuple(mine.tokens))
    assert len(answers) > 1
    step = many._device_step(sampling)
    assert step is not None and isinstance(step.chain, DeviceChain) and one._chain is None


class _Replayed:
    """A CUDA graph's stand-in on a CPU: a replay runs the captured step again."""

    def __init__(self, step: Callable[[], None]) -> None:
        self.replay = step


def emulate_capture(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Chained runs as on CUDA: a run's step captured once per set of buffers (run three
    times, as :func:`~headway.decode.captured.record_graph`'s two warm-ups and its replay
    run it), then replayed; returns a list that grows by one a capture."""
    captures: list[int] = []

    def record(step: Callable[[], None], device: torch.device) -> _Replayed:
        for _ in range(3):
            step()
        captures.append(1)
        return _Replayed(step)

    monkeypatch.setattr(DeviceChain, "_captures", lambda self: True)
    monkeypatch.setattr(DeviceChain, "_record", staticmethod(record))
    return captures


def test_a_run_can_run_again_to_the_same_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA a run's step runs three times while it is captured (warm-ups, then the
    capture's replay), after which the run starts again from its kept state and replays the
    step: the decoding and the drafter's state (its committed pairs on the device and on the
    host) stay those of runs taken eagerly, and the step is captured once, not once a run."""
    model, _ = target_and_truth("llama")

    def decode(chain: int) -> tuple[list[int], list[int], tuple[int, int]]:
        _, static = _pair("trained", model, SHAPES["tree"])
        decoder = Decoder(model, static, DecodeOptions(verify="captured", chain=chain))
        result = decoder.generate(PROMPT, max_new_tokens=30, eos_token_ids=())
        on_device = int(static._before + static._n)  # committed pairs, as the device has it
        return result.tokens, result.accept_lengths, (on_device, static._committed)

    eager = {chain: decode(chain) for chain in (2, 4)}  # 2: fewer rows than a capture's runs
    captures = emulate_capture(monkeypatch)
    for chain, once in eager.items():
        assert decode(chain) == once
        assert once[2][0] == once[2][1]  # the device and the host agree
    assert len(captures) == 2  # once a decoder, not once a run


def test_a_run_and_a_single_step_do_not_share_outputs() -> None:
    """A run's graph and a single step's bind their outputs (the plan's ``out`` and
    ``hidden``, the drafter's kept tree) to their own tensors, each at its capture: so a run
    verifies through a plan of its own, and a static drafter whose step ran inside a run
    drops its own graph at its next single step (recaptured there, rebound). Shared, a run
    recaptured after a single step's capture left the single step reading the run's stale
    output: other tokens than greedy's on an H100 (fp32, 2026-11-27)."""
    model, _ = target_and_truth("llama")
    _, static = _pair("trained", model, SHAPES["tree"])
    decoder = Decoder(model, static, DecodeOptions(verify="captured", chain=4))
    decoder.generate(PROMPT, max_new_tokens=3, eos_token_ids=())  # single steps: 3 < 4
    decoder.generate(PROMPT, max_new_tokens=30, eos_token_ids=())  # runs
    verifier = decoder._verifier
    assert verifier is not None
    kinds = {key[-1] for key in verifier._plans}
    assert kinds == {True, False}  # a chained plan and a single step's, apart
    static._graph = object()  # as if its single-step graph were captured
    with static.chain_context(), torch.inference_mode():
        static.chain_propose()  # in a run's capture: nothing freed there
    assert static._graph is not None and static._rebind
    with torch.inference_mode():
        static._draft(on_device=True)  # the next single step: dropped (captured anew on CUDA)
    assert static._graph is None and not static._rebind


def test_medusa_heads_chain_their_steps(monkeypatch: pytest.MonkeyPatch) -> None:
    """Medusa heads' chained runs (the heads on the state a run's last step kept, on the
    device) decode the single steps' tokens and acceptance lengths, across a cache grown
    mid-generation and with every body run three times (a capture's warm-ups), with one
    host read a run; the CPU proxy finds no graph fault in decoders used before counting."""
    monkeypatch.setattr(captured, "MIN_CAPACITY", 16)
    model, _ = target_and_truth("llama")
    drafter = random_medusa(model)
    one = Decoder(model, drafter, DecodeOptions(verify="captured", chain=1))
    many = Decoder(model, drafter, DecodeOptions(verify="captured", chain=4))
    expected = [one.generate(p, max_new_tokens=n, eos_token_ids=()) for p, n in RUNS]
    for patched in (False, True):
        if patched:
            emulate_capture(monkeypatch)
        for (prompt, new), theirs in zip(RUNS, expected, strict=True):
            mine = many.generate(prompt, max_new_tokens=new, eos_token_ids=())
            assert mine.tokens == theirs.tokens == hf_greedy(model, prompt, new, eos=None)
            assert mine.accept_lengths == theirs.accept_lengths
    assert isinstance(many._chain, DeviceChain) and one._chain is None
    single = count_decoding(one, [PROMPT], max_new_tokens=24, eos_token_ids=())
    chained = count_decoding(many, [PROMPT], max_new_tokens=24, eos_token_ids=())
    assert chained.syncs < single.syncs / 2
    # decoders used before counting: the buffers they built are the device's, no fault
    assert single.graph_faults == chained.graph_faults == {}
    plain = Decoder(model, None, DecodeOptions(verify="captured", chain=4))
    plain.generate(PROMPT, max_new_tokens=12, eos_token_ids=())
    assert count_decoding(plain, [PROMPT], max_new_tokens=12, eos_token_ids=()).graph_faults == {}
