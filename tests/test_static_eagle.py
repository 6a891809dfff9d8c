"""Static-shape EAGLE drafting (headway/drafters/static_eagle.py): the same trees as the eager
drafter step for step, the target's output, a cache that grows mid-generation, and a step with
no host read (what a CUDA graph needs); on CUDA, captured: tests/test_gpu.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.decode.captured import COMPILED_CAPACITY
from headway.decode.gemm import apply_gemm
from headway.decode.generate import Decoder, generate
from headway.decode.keyed_noise import Coupling
from headway.decode.options import DecodeOptions
from headway.decode.packed import packing_available
from headway.decode.sampling import SamplingParams
from headway.drafters import static_eagle
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.eagle_drafter import EagleDrafter
from headway.drafters.static_eagle import StaticEagle3Drafter, StaticEagleDrafter
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import seeds_of
from headway.hardware import has_cxx_compiler
from headway.heads.eagle import EagleConfig, EagleModel, TargetHead
from headway.heads.eagle3 import Eagle3Model
from headway.heads.vocab import DraftVocab
from tests.drafting import heads_drafter
from tests.test_eagle3 import CHAIN, PROMPT, TREE, random_draft, target_and_truth, trained
from tests.test_eagle_drafter import Recorder, save_run
from tests.test_generate import hf_greedy
from tests.tiny import TINY_VOCAB

SHAPES = {"chain": CHAIN, "tree": TREE, "wide": {"top_k": 3, "depth": 3, "total_tokens": 30}}


def _pair(kind: str, model: Any, shape: dict[str, Any]) -> tuple[Any, Any]:
    """(eager, static) drafters of one draft model."""
    head = TargetHead.of(model)
    if kind == "eagle1":
        torch.manual_seed(3)
        eagle1 = EagleModel(EagleConfig.from_target(model)).eval()
        layer = model.config.num_hidden_layers
        return (
            EagleDrafter(eagle1, head, hidden_layer=layer, **shape),
            StaticEagleDrafter(eagle1, head, hidden_layer=layer, **shape),
        )
    draft = trained("llama") if kind == "trained" else random_draft(model)
    if kind == "eagle3.1":  # fc_norm and norm_output (EAGLE-3.1), norm weights off one
        torch.manual_seed(5)
        config = replace(draft.config, fc_norm=True, norm_output=True)
        draft = Eagle3Model(config)
        draft.set_vocab(DraftVocab.identity(64, TINY_VOCAB))
        with torch.no_grad():
            for name, parameter in draft.named_parameters():
                if "norm" in name:
                    parameter.add_(0.2 * torch.randn_like(parameter))
        draft.eval()
    return Eagle3Drafter(draft, head, **shape), StaticEagle3Drafter(draft, head, **shape)


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["eagle1", "random", "trained", "eagle3.1"])
def test_static_drafting_proposes_the_eager_trees(kind: str, shape: str) -> None:
    model, truth = target_and_truth("llama")
    eager, static = (Recorder(d) for d in _pair(kind, model, SHAPES[shape]))
    for sizing in ("drafter", "cost"):
        runs = [
            Decoder(model, recorder, DecodeOptions(sizing=sizing), verify_costs=[1.0] * 64)
            for recorder in (eager, static)
        ]
        results = [run.generate(PROMPT, max_new_tokens=32, eos_token_ids=()) for run in runs]
        assert results[0].tokens == results[1].tokens == truth
        assert results[0].accept_lengths == results[1].accept_lengths
    warm = SamplingParams(temperature=0.8)  # both coupled to the same noise: the same trees
    sampled = [
        Decoder(model, recorder).generate(
            PROMPT, max_new_tokens=24, eos_token_ids=(), sampling=warm,
            generator=torch.Generator().manual_seed(2),
        )
        for recorder in (eager, static)
    ]  # fmt: skip
    assert sampled[0].tokens == sampled[1].tokens != truth[:24]
    assert sampled[0].accept_lengths == sampled[1].accept_lengths
    assert len(eager.proposals) == len(static.proposals) > 0
    for (_, mine), (_, theirs) in zip(static.proposals, eager.proposals, strict=True):
        assert torch.equal(mine.tokens, theirs.tokens)
        assert torch.equal(mine.parents, theirs.parents)
        if theirs.scores is not None:
            assert mine.scores is not None
            torch.testing.assert_close(mine.scores, theirs.scores, rtol=1e-5, atol=1e-7)


def test_a_long_sequence_grows_the_cache_and_keeps_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(static_eagle, "MIN_CAPACITY", 16)  # grows twice: 16 -> 64 -> 128
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    prompt = torch.arange(1, 40) % 90 + 3
    result = generate(model, prompt, drafter=static, max_new_tokens=48, eos_token_ids=())
    assert result.tokens == hf_greedy(model, prompt, 48, None)
    assert static._cache.capacity == 128


@pytest.mark.parametrize("coupled", [False, True])
def test_a_drafting_step_reads_nothing_on_the_host(coupled: bool) -> None:
    """The step a CUDA graph captures dispatches no op whose result the host must wait for
    (coupled too: the noise keys come from the staged seed and the device's pair count)."""
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    generate(model, PROMPT, drafter=static, max_new_tokens=4, eos_token_ids=())
    static.couple(Coupling(seed=11, temperature=0.7) if coupled else None)
    counter = DispatchCounter(*seeds_of(static))
    with counter, torch.inference_mode():
        static._step()
    assert counter.counts.syncs == 0 and counter.counts.launches > 0
    assert counter.counts.graph_faults == {}


def test_capture_is_refused_off_cuda() -> None:
    model, _ = target_and_truth("llama")
    draft = random_draft(model)

    class Captured(StaticEagle3Drafter):
        capture = True

    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        Captured(draft, TargetHead.of(model), **CHAIN)


def test_the_spec_option_builds_the_static_drafter(tmp_path: Path) -> None:
    model, truth = target_and_truth("llama")
    run = save_run(tmp_path / "eagle", model, EagleModel(EagleConfig.from_target(model)))
    static = heads_drafter(run, model, drafting="static", top_k=2, depth=3)
    assert isinstance(static, StaticEagleDrafter) and (static.top_k, static.depth) == (2, 3)
    assert isinstance(heads_drafter(run, model), EagleDrafter)
    result = generate(model, PROMPT, drafter=static, max_new_tokens=32, eos_token_ids=())
    assert result.tokens == truth


def test_a_step_makes_only_the_proposal_asked_for() -> None:
    """One step's host tree (``propose``) and device subtree (``propose_on_device``) are the
    same nodes; a step builds only the one asked for, and asking for the other switches."""
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    generate(model, PROMPT, drafter=static, max_new_tokens=4, eos_token_ids=())
    host = static.propose(PROMPT)
    static._out = None
    on_device = static.propose_on_device()
    assert on_device is not None and static._out is None  # the host tree was not built
    assert torch.equal(on_device[0].cpu(), host.tokens)
    assert torch.equal(on_device[1].cpu(), host.parents)
    again = static.propose(PROMPT)
    assert torch.equal(again.tokens, host.tokens) and torch.equal(again.parents, host.parents)


def test_every_dropped_graph_takes_its_memory_pool_with_it() -> None:
    """A graph pool handle kept after its graphs are gone crashed the next capture (issue #32):
    a grown cache, new input buffers and a switched proposal each drop both."""
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    generate(model, PROMPT, drafter=static, max_new_tokens=4, eos_token_ids=())
    hidden = static._in_hidden
    for drop in (
        lambda: static._reserve(static._cache.capacity + 1),
        lambda: static._buffer(PROMPT[:2], tuple(h[:2].double() for h in hidden), 2),
        lambda: static.propose_on_device(),
    ):
        static._graph, static._pool = object(), object()
        drop()
        assert static._graph is None and static._pool is None


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
def test_compiled_drafting_decodes_the_eager_trees_without_recompiling() -> None:
    """drafting="compiled" (the whole step, draft forwards and tree bookkeeping, through
    torch.compile, here inductor on the CPU), device steps chained: the eager drafter's tokens
    and acceptance lengths from ONE compiled graph (nothing in a step guards on a per-step
    Python number, so no step compiles again), a second prompt compiles nothing new (the draft
    cache starts large enough), and host proposals (a second graph) decode the same; a GEMM
    route applied to the draft layers is left to torch.compile (it cannot lower a packed one).
    The compiled verify forward: tests/test_captured.py."""
    from torch._dynamo.utils import counters

    model, truth = target_and_truth("llama")
    eager, static = _pair("trained", model, SHAPES["tree"])
    if packing_available():  # a packed CPU route on the draft layers: compiled, none is taken
        apply_gemm(static.model, "packed")
    static.compile_steps()
    before = counters["stats"]["unique_graphs"]  # what other tests in this process compiled
    decoder = Decoder(model, static, DecodeOptions(verify="captured", chain=4))
    reference = Decoder(model, eager, DecodeOptions(sizing="drafter"))
    for new in (30, 20):
        mine = decoder.generate(PROMPT, max_new_tokens=new, eos_token_ids=())
        theirs = reference.generate(PROMPT, max_new_tokens=new, eos_token_ids=())
        assert mine.tokens == theirs.tokens == truth[:new]
        assert mine.accept_lengths == theirs.accept_lengths
        if new == 30:
            graphs = counters["stats"]["unique_graphs"] - before
    assert counters["stats"]["unique_graphs"] - before == graphs == 1
    assert static._compiled_step is not None and static._cache.capacity == COMPILED_CAPACITY
    hosted = Decoder(model, static, DecodeOptions(verify="captured", device_trees=False))
    mine = hosted.generate(PROMPT, max_new_tokens=12, eos_token_ids=())
    assert mine.tokens == truth[:12] and counters["stats"]["unique_graphs"] - before == 2
