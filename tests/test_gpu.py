"""The decoder and the regeneration engine on CUDA (issue #15): run with ``make test-gpu`` on a
machine with a GPU; without one every test here is skipped.

fp32 on the GPU must keep the CPU's guarantees: tree logits equal each path decoded alone, and
greedy output equals transformers' ``generate`` token for token, for every drafter here.
"""

from __future__ import annotations

from typing import Any, Literal

import pytest
import torch

from headway.decode.captured import StaticForward
from headway.decode.forwards import EagerForward, TargetForward
from headway.decode.generate import Decoder, Drafter, generate
from headway.decode.kv import new_cache, prefill, tree_forward
from headway.decode.options import DecodeOptions
from headway.decode.tree import root_to_leaf_paths
from headway.drafters.eagle3_drafter import Eagle3Drafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.drafters.oracle import OracleDrafter
from headway.drafters.static_eagle import StaticEagle3Drafter
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config, Eagle3Model
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.heads.vocab import DraftVocab
from tests.test_device_step import sampled_device_steps
from tests.test_eagle3 import CHAIN as EAGLE3_CHAIN
from tests.test_eagle3 import TREE as EAGLE3_TREE
from tests.test_eagle3 import tiny4
from tests.test_eagle_drafter import Recorder
from tests.test_generate import hf_greedy as cpu_hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")
PROMPT = [1, 5, 17, 33, 8, 40, 41, 9]


def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' greedy decoding on CUDA (tests/test_generate.py's, given a CUDA prompt)."""
    return cpu_hf_greedy(model, torch.tensor(prompt, device=CUDA), new_tokens, eos=None)


def make_drafter(name: str, truth: list[int]) -> Drafter | None:
    """The drafters the CUDA equality tests run: none, an oracle tree and prompt lookup."""
    return {
        "none": None,
        "oracle-tree": OracleDrafter(truth, 4, width=3),
        "prompt-lookup": PromptLookupDrafter(num_draft_tokens=5, max_nodes=12),
    }[name]


@pytest.mark.parametrize("family", TINY_FAMILIES)
@torch.no_grad()
def test_tree_logits_equal_each_path_on_cuda(family: str) -> None:
    model = tiny_model(family).to(CUDA)
    prompt = torch.tensor([PROMPT], device=CUDA)
    parents = torch.tensor([-1, -1, 0, 0, 2, 1])
    block = torch.tensor([[50, 30, 31, 32, 33, 34, 35]], device=CUDA)  # root, then the nodes
    cache = new_cache(model)
    prefill(model, cache, prompt)
    logits, _ = tree_forward(model, cache, block, parents, len(PROMPT), ())
    for path in root_to_leaf_paths(parents):
        sequence = torch.cat([prompt[0], block[0, torch.tensor(path, device=CUDA)]])
        plain = model(sequence[None]).logits[0, len(PROMPT) :]
        torch.testing.assert_close(logits[path], plain, atol=1e-4, rtol=0)


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("drafter_name", ["none", "oracle-tree", "prompt-lookup"])
def test_greedy_output_equals_transformers_on_cuda(family: str, drafter_name: str) -> None:
    model = tiny_model(family).to(CUDA)
    truth = hf_greedy(model, PROMPT, 40)
    drafter = make_drafter(drafter_name, truth)
    result = generate(
        model,
        torch.tensor(PROMPT, device=CUDA),
        drafter=drafter,
        max_new_tokens=40,
        eos_token_ids=(),
    )
    assert result.tokens == truth


@pytest.mark.parametrize("family", TINY_FAMILIES)
@pytest.mark.parametrize("drafter_name", ["none", "oracle-tree", "prompt-lookup"])
def test_captured_verify_equals_transformers_on_cuda(family: str, drafter_name: str) -> None:
    """``verify="captured"``: verify forwards replayed from CUDA graphs (one per padded block
    size, captured on first use) give transformers' greedy output, twice from one Decoder."""
    model = tiny_model(family).to(CUDA)
    truth = hf_greedy(model, PROMPT, 40)
    drafter = make_drafter(drafter_name, truth)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
    assert isinstance(decoder.target, StaticForward) and decoder.target.capture
    for _ in range(2):
        result = decoder.generate(
            torch.tensor(PROMPT, device=CUDA), max_new_tokens=40, eos_token_ids=()
        )
        assert result.tokens == truth
    if drafter is None:  # plain decoding runs as the device step: one graph a step of its own
        assert decoder._verifier is not None
        graphs = [plan.graph for plan in decoder._verifier._plans.values()]
    else:
        graphs = [shape.graph for shape in decoder.target._shapes.values()]
    assert graphs and all(graph is not None for graph in graphs)


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_captured_logits_equal_the_eager_path_on_cuda(family: str) -> None:
    """The replayed graph's logits equal the eager forward's at every step of a tree decode
    (first use captures, later uses replay with new inputs)."""
    model = tiny_model(family).to(CUDA)
    prompt = torch.tensor([PROMPT], device=CUDA)
    parents = torch.tensor([-1, 0, 0, 1, -1])
    paths: dict[str, TargetForward] = {
        "eager": EagerForward(model),
        "captured": StaticForward(model),
    }
    logits: dict[str, list[torch.Tensor]] = {name: [] for name in paths}
    with torch.inference_mode():
        for name, path in paths.items():
            path.begin(64)
            path.prefill(prompt, ())
            length = len(PROMPT)
            for step in range(4):
                block = torch.tensor([[7 + step, 11, 12 + step, 13, 14, 15]])
                out, _ = path.verify(block, parents, length, ())
                logits[name].append(out.clone())
                path.compact(length, torch.tensor([0, 2]))
                length += 2
    for eager, captured in zip(logits["eager"], logits["captured"], strict=True):
        torch.testing.assert_close(captured, eager, atol=1e-4, rtol=0)


def test_captured_verify_feeds_an_eagle3_drafter_on_cuda() -> None:
    """The graph's hidden-state outputs reach a drafter that reads three target layers, trees
    sized by the captured path's own timing: still transformers' greedy output."""
    model = tiny4("llama").to(CUDA)
    truth = hf_greedy(model, PROMPT, 30)
    torch.manual_seed(1)
    vocab = DraftVocab.identity(64, TINY_VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    drafter = Eagle3Drafter(draft.to(CUDA).eval(), TargetHead.of(model), **EAGLE3_TREE)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured", sizing="cost"))
    prompt = torch.tensor(PROMPT, device=CUDA)
    result = decoder.generate(prompt, max_new_tokens=30, eos_token_ids=())
    assert result.tokens == truth


def long_tiny(layers: int | None = None) -> Any:
    """tests/tiny.py's Llama (or one of ``layers`` layers) with room for prompts of 1,500
    tokens, on CUDA."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    config = tiny_config("llama")
    config.max_position_embeddings = 2048
    if layers is not None:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.eval().to(CUDA)


def cuda_medusa(model: Any) -> MedusaDrafter:
    """Random Medusa heads on ``model`` (CUDA): some drafts right, most wrong; their tree stays
    on the device (the device step)."""
    torch.manual_seed(0)
    lm_head = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, TINY_VOCAB), lm_head)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return MedusaDrafter(heads.to(CUDA).eval(), hidden_layer=final_hidden_layer(model))


@pytest.mark.parametrize("drafter_name", ["none", "prompt-lookup", "medusa"])
def test_a_longer_prompt_grows_the_captured_cache_without_a_crash(drafter_name: str) -> None:
    """One captured Decoder: a short prompt captures graphs, a long one then grows the static
    cache (dropping them and their pool) and captures again, and a short one follows; each
    equals transformers' greedy (plain decoding and Medusa heads run the device step; static
    EAGLE drafting: the test after next)."""
    model = long_tiny()
    drafter = cuda_medusa(model) if drafter_name == "medusa" else make_drafter(drafter_name, [])
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
    for prompt in (PROMPT, [(7 * i) % 90 + 3 for i in range(600)], PROMPT):
        result = decoder.generate(
            torch.tensor(prompt, device=CUDA), max_new_tokens=24, eos_token_ids=()
        )
        assert result.tokens == hf_greedy(model, prompt, 24)


def test_one_decoder_grows_its_captured_cache_across_prompts_of_mixed_lengths() -> None:
    """40 prompts of 5-1,500 tokens through one captured Decoder, each equal to HF greedy."""
    model = long_tiny()
    drafter = PromptLookupDrafter(num_draft_tokens=5)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
    for index in range(40):
        length = 5 + (index * 389) % 1496
        prompt = [(11 * i + index) % 90 + 3 for i in range(length)]
        result = decoder.generate(
            torch.tensor(prompt, device=CUDA), max_new_tokens=12, eos_token_ids=()
        )
        assert result.tokens == hf_greedy(model, prompt, 12), (index, length)


def cuda_eagle3(model: Any) -> Eagle3Model:
    """A random EAGLE-3 draft model for ``model`` (a 4-layer tiny target) on CUDA."""
    torch.manual_seed(1)
    vocab = DraftVocab.identity(64, TINY_VOCAB)
    draft = Eagle3Model(Eagle3Config.from_target(model, draft_vocab_size=vocab.size))
    draft.set_vocab(vocab)
    return draft.to(CUDA).eval()


@pytest.mark.parametrize("sizing", ["drafter", "cost"])
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_captured_static_drafting_proposes_the_eager_trees_on_cuda(
    shape: str, sizing: Literal["drafter", "cost"]
) -> None:
    """EAGLE-3 drafting replayed from one CUDA graph per step (issue #32): the eager drafter's
    trees step for step, and with the captured verify forward transformers' greedy output."""
    model = tiny4("llama").to(CUDA)
    truth = hf_greedy(model, PROMPT, 30)
    draft, settings = cuda_eagle3(model), EAGLE3_CHAIN if shape == "chain" else EAGLE3_TREE
    head = TargetHead.of(model)
    captured = StaticEagle3Drafter(draft, head, **settings)
    assert captured.capture
    eager, static = Recorder(Eagle3Drafter(draft, head, **settings)), Recorder(captured)
    prompt = torch.tensor(PROMPT, device=CUDA)
    for recorder in (eager, static):
        decoder = Decoder(model, recorder, DecodeOptions(verify="captured", sizing=sizing))
        for _ in range(2):  # the second generation replays the graph captured in the first
            result = decoder.generate(prompt, max_new_tokens=30, eos_token_ids=())
            assert result.tokens == truth
    assert len(eager.proposals) == len(static.proposals)
    for (_, mine), (_, theirs) in zip(static.proposals, eager.proposals, strict=True):
        assert torch.equal(mine.tokens, theirs.tokens) and torch.equal(mine.parents, theirs.parents)


def test_captured_static_drafting_survives_a_growing_draft_cache() -> None:
    """A long prompt after a short one grows the static draft cache, dropping the graph and its
    pool; the next capture works and the output stays transformers' greedy."""
    from transformers import AutoModelForCausalLM

    from tests.tiny import tiny_config

    config = tiny_config("llama")
    config.num_hidden_layers, config.max_position_embeddings = 4, 2048
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval().to(CUDA)
    drafter = StaticEagle3Drafter(cuda_eagle3(model), TargetHead.of(model), **EAGLE3_TREE)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
    for prompt in (PROMPT, [(7 * i) % 90 + 3 for i in range(600)], PROMPT):
        result = decoder.generate(
            torch.tensor(prompt, device=CUDA), max_new_tokens=24, eos_token_ids=()
        )
        assert result.tokens == hf_greedy(model, prompt, 24)


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_device_steps_equal_host_steps_on_cuda(shape: str) -> None:
    """The device step (headway/decode/device_step.py): drafting and verification each replayed
    from a CUDA graph, one host read a step; tokens and acceptance lengths as the host step's,
    the output transformers' greedy, the second generation replaying the first one's graphs."""
    model = tiny4("llama").to(CUDA)
    truth = hf_greedy(model, PROMPT, 30)
    settings = EAGLE3_CHAIN if shape == "chain" else EAGLE3_TREE
    draft, head = cuda_eagle3(model), TargetHead.of(model)
    prompt = torch.tensor(PROMPT, device=CUDA)
    runs = []
    for device_trees in (False, True):
        drafter = StaticEagle3Drafter(draft, head, **settings)
        options = DecodeOptions(verify="captured", device_trees=device_trees)
        decoder = Decoder(model, drafter, options)
        runs.append([decoder.generate(prompt, max_new_tokens=30, eos_token_ids=()) for _ in "ab"])
        assert (decoder._verifier is not None) == device_trees
    for host, device in zip(*runs, strict=True):
        assert device.tokens == host.tokens == truth
        assert device.accept_lengths == host.accept_lengths


def test_chained_device_steps_equal_single_steps_on_cuda() -> None:
    """Several greedy device steps a graph replay (headway/decode/device_chain.py), one host
    read a run: the single steps' tokens and acceptance lengths and transformers' greedy
    output, a long prompt after a short one (both caches grow: the run's graph is captured
    again), then a short one."""
    model = long_tiny(layers=4)  # EAGLE-3 fuses three distinct layers
    draft, head = cuda_eagle3(model), TargetHead.of(model)
    decoders = [
        Decoder(model, StaticEagle3Drafter(draft, head, **EAGLE3_TREE), DecodeOptions(
            verify="captured", chain=chain))
        for chain in (1, 4)
    ]  # fmt: skip
    for prompt in (PROMPT, [(7 * i) % 90 + 3 for i in range(600)], PROMPT):
        ids = torch.tensor(prompt, device=CUDA)
        one, many = (run.generate(ids, max_new_tokens=40, eos_token_ids=()) for run in decoders)
        assert many.tokens == one.tokens == hf_greedy(model, prompt, 40)
        assert many.accept_lengths == one.accept_lengths
    assert decoders[1]._chain is not None and decoders[1]._chain._graph is not None


def test_sampled_device_steps_follow_the_target_distribution_on_cuda() -> None:
    """Sampling through the captured device step (noise computed in the graph): the first
    two tokens follow the target's exact two-token distribution (tests/test_device_step.py's
    test, on CUDA)."""
    sampled_device_steps(CUDA)


@pytest.mark.parametrize("drafted", [False, True])
def test_chained_runs_then_single_steps_over_prompts_of_mixed_lengths_on_cuda(
    drafted: bool,
) -> None:
    """Runs of 4 device steps, each generation ending in single steps (41 tokens), over
    prompts whose lengths grow the target's and the drafter's caches at different times:
    transformers' greedy output every time. The run's graph and the single step's once shared
    the plan's outputs, and a run recaptured after the single step's capture left the single
    step reading the run's stale tokens (fp32 on an H100, 2026-11-27: 3/8 MT-bench answers
    equal to HF's)."""
    model = long_tiny(layers=4)
    drafter = None
    if drafted:
        drafter = StaticEagle3Drafter(cuda_eagle3(model), TargetHead.of(model), **EAGLE3_TREE)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured", chain=4))
    for length in (5, 40, 9, 130, 70, 300, 12, 520, 33):
        prompt = [(11 * i + length) % 90 + 3 for i in range(length)]
        ids = torch.tensor(prompt, device=CUDA)
        result = decoder.generate(ids, max_new_tokens=41, eos_token_ids=())
        assert result.tokens == hf_greedy(model, prompt, 41), length


def test_compiled_drafting_steps_equal_transformers_on_cuda() -> None:
    """drafting="compiled" (the whole static step through torch.compile, then captured as a
    CUDA graph), device steps one at a time and 4 a run, a long prompt between short ones:
    transformers' greedy output, and one compiled graph for every step of them."""
    from torch._dynamo.utils import counters

    model = long_tiny(layers=4)
    drafter = StaticEagle3Drafter(cuda_eagle3(model), TargetHead.of(model), **EAGLE3_TREE)
    drafter.compile_steps()
    before = counters["stats"]["unique_graphs"]
    for chain in (1, 4):
        decoder = Decoder(model, drafter, DecodeOptions(verify="captured", chain=chain))
        for prompt in (PROMPT, [(7 * i) % 90 + 3 for i in range(600)], PROMPT):
            result = decoder.generate(
                torch.tensor(prompt, device=CUDA), max_new_tokens=40, eos_token_ids=()
            )
            assert result.tokens == hf_greedy(model, prompt, 40), (chain, len(prompt))
    assert counters["stats"]["unique_graphs"] - before == 1
