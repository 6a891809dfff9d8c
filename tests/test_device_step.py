"""The device step (headway/decode/device_step.py, device_tree.py): the device bookkeeping
computes what the host's does, and greedy decoding with a static EAGLE drafter over the captured
verify path gives the host step's tokens and acceptance lengths, step for step, while reading
the device once a step; on CUDA, captured: tests/test_gpu.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from headway.decode import captured
from headway.decode.captured import StaticForward
from headway.decode.device_chain import DeviceChain
from headway.decode.device_step import DeviceStep, DeviceVerify
from headway.decode.device_tree import (
    accept_greedy,
    accept_sampled,
    subtree_on_device,
    tree_layout,
)
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.decode.sampling import SamplingParams, probs_from_logits
from headway.decode.tree import DraftTree, ancestor_mask, depths, subtree
from headway.decode.verify import verify_greedy, verify_sampling
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.drafters.static_eagle import StaticEagle3Drafter
from headway.eval.dispatch_decoding import CAPTURED_BODIES, count_decoding
from headway.heads.eagle import TargetHead
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads
from tests.test_eagle3 import PROMPT, fit_method, target_and_truth, tiny4
from tests.test_generate import (
    chi_square,
    every_first_then_greedy,
    exact_two_token_probs,
    hf_greedy,
)
from tests.test_static_eagle import SHAPES, _pair
from tests.test_verify import AFTER, ROOT_P, SMALL, block_probs, deterministic_tree
from tests.tiny import TINY_VOCAB

TREES = {
    "chain": [-1, 0, 1, 2],
    "star": [-1, -1, -1, -1],
    "mixed": [-1, -1, 0, 0, 1, 2, 2, 5, 3],
}


KINDS = ("eagle1", "random", "trained")
"""The static drafters of tests/test_static_eagle.py's ``_pair``."""


def random_tree(nodes: int, generator: torch.Generator) -> list[int]:
    """A random topologically ordered parent list of ``nodes`` nodes."""
    return [int(torch.randint(-1, i, (), generator=generator)) for i in range(nodes)]


@pytest.mark.parametrize("seed", range(20))
def test_device_bookkeeping_computes_the_hosts(seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    parents = torch.tensor(
        TREES[sorted(TREES)[seed % 3]] if seed < 3 else random_tree(1 + seed % 12, generator)
    )
    nodes = parents.numel()
    found_depths, found_mask = tree_layout(parents, nodes)
    assert torch.equal(found_depths, depths(parents))
    assert torch.equal(found_mask, ancestor_mask(parents))
    # greedy acceptance: argmax at random, often equal to the drafted token
    vocab = 4
    tokens = torch.randint(0, vocab, (nodes,), generator=generator)
    argmax = torch.randint(0, vocab, (nodes + 1,), generator=generator)
    ids = torch.cat([torch.tensor([7]), tokens, torch.zeros(3, dtype=torch.long)])  # padded
    argmax = torch.cat([argmax, torch.zeros(3, dtype=torch.long)])
    logits = torch.nn.functional.one_hot(argmax[: nodes + 1], vocab).float()
    expected = verify_greedy(DraftTree(tokens, parents), logits)
    rows = int(found_depths.max()) + 1
    count, path, committed = accept_greedy(ids, parents, found_depths, found_mask, argmax, rows)
    assert int(count) == expected.accept_length
    assert path[: int(count)].tolist() == expected.path.tolist()
    assert committed[: int(count)].tolist() == expected.tokens.tolist()
    # a subtree of the best-scored nodes, kept ancestor-closed
    scores = -found_depths[1:].double() - torch.rand(nodes, generator=generator)
    keep = scores.sort(descending=True).indices[: max(1, nodes // 2)]
    mine = subtree_on_device(tokens, parents, keep)
    theirs = subtree(tokens, parents, keep)
    assert torch.equal(mine[0], theirs.tokens) and torch.equal(mine[1], theirs.parents)


def _decoders(model: Any, drafter: Any) -> list[Decoder]:
    return [
        Decoder(model, drafter, DecodeOptions(verify="captured", device_trees=on))
        for on in (False, True)
    ]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", KINDS)
def test_device_steps_are_the_host_steps(kind: str, shape: str) -> None:
    model, truth = target_and_truth("llama")
    _, static = _pair(kind, model, SHAPES[shape])
    host, device = _decoders(model, static)
    results = [run.generate(PROMPT, max_new_tokens=32, eos_token_ids=()) for run in (host, device)]
    assert results[0].tokens == results[1].tokens == truth
    assert results[0].accept_lengths == results[1].accept_lengths
    assert device._verifier is not None and host._verifier is None  # the path each one took


def test_a_growing_cache_and_a_second_prompt_keep_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(captured, "MIN_CAPACITY", 16)  # the target's cache grows mid-answer
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    host, device = _decoders(model, static)
    for prompt in (PROMPT, torch.arange(1, 40) % 90 + 3, PROMPT[:3]):
        mine, theirs = (
            run.generate(prompt, max_new_tokens=48, eos_token_ids=()) for run in (device, host)
        )
        assert mine.tokens == theirs.tokens and mine.accept_lengths == theirs.accept_lengths
    assert isinstance(device.target, StaticForward) and device.target.cache.capacity > 16


def test_the_device_step_stops_where_the_host_step_must_take_over() -> None:
    """An EOS inside an accepted tree ends both paths alike; typical acceptance and cost sizing
    take the host step; near the context limit the loop falls back to the host step."""
    model, truth = target_and_truth("llama")
    _, static = _pair("trained", model, SHAPES["tree"])
    host, device = _decoders(model, static)
    eos = [truth[10]]
    results = [run.generate(PROMPT, max_new_tokens=40, eos_token_ids=eos) for run in (host, device)]
    assert results[0].tokens == results[1].tokens and results[1].stop_reason == "eos"
    typical = Decoder(model, static, DecodeOptions(verify="captured", acceptance="typical"))
    assert typical._device_step(SamplingParams(temperature=1.0)) is None
    sized = Decoder(model, static, DecodeOptions(verify="captured", sizing="cost"))
    assert sized._device_step(SamplingParams()) is None
    long_prompt = torch.arange(model.config.max_position_embeddings - 6) % 90 + 3
    mine, theirs = (
        run.generate(long_prompt, max_new_tokens=5, eos_token_ids=()) for run in (device, host)
    )
    assert mine.tokens == theirs.tokens and mine.stop_reason == theirs.stop_reason


def test_a_device_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """One host read a device step (the host step: two); chained, one read a run of up to
    ``DecodeOptions.chain`` steps (the last steps of a generation one at a time)."""
    model, _ = target_and_truth("llama")
    _, static = _pair("random", model, SHAPES["tree"])
    host, _ = _decoders(model, static)
    device = Decoder(model, static, DecodeOptions(verify="captured", chain=1))
    chained = Decoder(model, static, DecodeOptions(verify="captured", chain=4))
    runs: list[str] = []
    for owner, name in ((DeviceChain, "run"), (DeviceVerify, "run")):
        method = getattr(owner, name)
        monkeypatch.setattr(owner, name, _counted(method, runs, owner.__name__))
    counts = {
        name: count_decoding(run, [PROMPT], max_new_tokens=24, eos_token_ids=())
        for name, run in (("host", host), ("device", device), ("chained", chained))
    }
    assert counts["device"].syncs == counts["device"].steps + 1  # and the first token's
    assert counts["host"].syncs == 2 * counts["host"].steps + 1
    assert counts["device"].host_ops < counts["host"].host_ops / 2
    assert isinstance(device._device_step(SamplingParams()), DeviceStep)
    chained_runs = runs[-(len(runs) - runs.index("DeviceChain")) :]  # the chained decoder's
    assert counts["chained"].syncs == len(chained_runs) + 1 < counts["device"].syncs / 2
    assert chained_runs.count("DeviceChain") >= 2 and counts["chained"].graph_faults == {}


def _counted(method: Any, calls: list[str], name: str) -> Any:
    def run(*args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        return method(*args, **kwargs)

    return run


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("kind", ["none", "eagle1", "trained"])
def test_what_a_gpu_would_capture_is_device_work_only(kind: str, temperature: float) -> None:
    """The bodies a GPU records as CUDA graphs (the verify forward, the device step, a static
    drafter's step) read nothing back, take no host vector, run no host op and draw no random
    number (headway.eval.dispatch's graph faults): on a CPU nothing is captured, so this is
    the check that the graphs replay what the CPU runs."""
    model, _ = target_and_truth("llama")
    drafters: list[Any] = [None]
    if kind != "none":
        drafters = [_pair(kind, model, SHAPES[shape])[1] for shape in sorted(SHAPES)]
    sampling = SamplingParams(temperature=temperature)
    for drafter in drafters:
        for run in _decoders(model, drafter):
            counts = count_decoding(
                run, [PROMPT], max_new_tokens=16, eos_token_ids=(), sampling=sampling
            )
            assert counts.replayed > 0 and counts.graph_faults == {}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bodies_a_gpu_runs_three_times_before_replaying_give_the_same_output(
    temperature: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On CUDA a graph's body runs twice eagerly (warm-up), is captured, then replayed: every
    body a GPU captures must do no harm when run again. Here each runs three times per call,
    and decoding (host and device steps, greedy and sampled from one seed) stays the same."""
    model, _ = target_and_truth("llama")
    sampling = SamplingParams(temperature=temperature)

    def outputs() -> list[tuple[list[int], list[int]]]:
        found = []
        for drafter in [None] + [_pair(kind, model, SHAPES["tree"])[1] for kind in KINDS]:
            for run in _decoders(model, drafter):
                generator = torch.Generator().manual_seed(7)
                result = run.generate(
                    PROMPT, max_new_tokens=20, eos_token_ids=(), sampling=sampling,
                    generator=generator,
                )  # fmt: skip
                found.append((result.tokens, result.accept_lengths))
        return found

    once = outputs()
    for owner, name in CAPTURED_BODIES:
        body = getattr(owner, name)

        def thrice(*args: Any, body: Any = body, **kwargs: Any) -> None:
            for _ in range(3):
                body(*args, **kwargs)

        monkeypatch.setattr(owner, name, thrice)
    assert outputs() == once


def test_plain_captured_decoding_takes_the_device_step() -> None:
    model, _ = target_and_truth("llama")
    host, _ = _decoders(model, None)
    device = Decoder(model, None, DecodeOptions(verify="captured", chain=1))
    for prompt in (PROMPT, torch.arange(1, 30) % 90 + 3):
        mine, theirs = (
            run.generate(prompt, max_new_tokens=20, eos_token_ids=()) for run in (device, host)
        )
        assert mine.tokens == theirs.tokens and mine.accept_lengths == theirs.accept_lengths
    assert device._verifier is not None and host._verifier is None
    on_device, on_host = (
        count_decoding(run, [PROMPT], max_new_tokens=12, eos_token_ids=()) for run in (device, host)
    )
    assert on_device.syncs == on_host.syncs == on_device.steps + 1  # one read a step already
    assert on_device.host_ops < on_host.host_ops / 2  # but it laid out and accepted empty trees


@pytest.mark.parametrize("chain", [2, 5, 8])
def test_chained_plain_decoding_is_plain_decoding(
    chain: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several plain greedy tokens a run (``DecodeOptions.chain``, each token the next one's
    input on the device): transformers' greedy output and one acceptance length a token, for
    lengths that are and are not multiples of the chain, across a cache that grows mid-way,
    with an EOS inside a chain (the tokens after it dropped, the cache cut back), and again
    from the same decoder."""
    monkeypatch.setattr(captured, "MIN_CAPACITY", 16)  # grows 16 -> 32 -> ... while decoding
    model, _ = target_and_truth("llama")
    decoder = Decoder(model, None, DecodeOptions(verify="captured", chain=chain))
    one = Decoder(model, None, DecodeOptions(verify="captured", chain=1))
    long_prompt = torch.arange(1, 90) % 90 + 3
    for prompt, new in ((PROMPT, 21), (long_prompt, 60), (PROMPT, 2 * chain)):
        mine = decoder.generate(prompt, max_new_tokens=new, eos_token_ids=())
        assert mine.tokens == hf_greedy(model, prompt, new, eos=None)
        assert mine.accept_lengths == [1] * new
    truth = one.generate(PROMPT, max_new_tokens=24, eos_token_ids=()).tokens
    eos = truth[chain + 2]  # inside the first chain after the first token (or at its end)
    stopped = decoder.generate(PROMPT, max_new_tokens=24, eos_token_ids=(eos,))
    expected = one.generate(PROMPT, max_new_tokens=24, eos_token_ids=(eos,))
    assert stopped.tokens == expected.tokens and stopped.stop_reason == "eos"
    assert isinstance(decoder.target, StaticForward)
    assert decoder.target.cache.length == len(PROMPT) + len(stopped.tokens) - 1
    again = decoder.generate(PROMPT, max_new_tokens=24, eos_token_ids=())
    assert again.tokens == truth


def random_medusa(model: Any) -> MedusaDrafter:
    """Random Medusa heads (3 heads): some drafts right, most wrong."""
    torch.manual_seed(0)
    lm_head = model.get_output_embeddings().weight.detach()
    heads = MedusaHeads(MedusaConfig(3, 1, model.config.hidden_size, TINY_VOCAB), lm_head)
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.add_(0.1 * torch.randn_like(parameter))
    return MedusaDrafter(heads.eval(), hidden_layer=final_hidden_layer(model))


def test_medusa_heads_take_the_device_step() -> None:
    """Medusa's static tree, filled on the device from the heads' top-k: the host step's
    output and acceptance lengths, one host read a step (one step a run; chained runs:
    test_device_chain.py)."""
    model, truth = target_and_truth("llama")
    drafter = random_medusa(model)
    host, device = _decoders(model, drafter)
    results = [run.generate(PROMPT, max_new_tokens=32, eos_token_ids=()) for run in (host, device)]
    assert results[0].tokens == results[1].tokens == truth
    assert results[0].accept_lengths == results[1].accept_lengths
    single = Decoder(model, drafter, DecodeOptions(verify="captured", chain=1))
    counts = count_decoding(single, [PROMPT], max_new_tokens=24, eos_token_ids=())
    assert counts.syncs == counts.steps + 1 and single._verifier is not None


def test_device_sampling_commits_the_hosts_tokens_over_the_same_noise() -> None:
    """The device's draw-then-match walk over test_verify.py's tree of fixed candidates commits
    what the host's :func:`verify_sampling` commits over the same noise, every sample: the
    first token follows the target's root distribution, the second (after an accepted first)
    the target's distribution after it."""
    tree = deterministic_tree(torch.Generator())
    logits = block_probs(tree).log()
    hot = SamplingParams(temperature=1.0)
    probs = probs_from_logits(logits, hot)
    ids = torch.cat([torch.tensor([0]), tree.tokens])
    generator = torch.Generator().manual_seed(99)
    first = torch.zeros(SMALL)
    second = torch.zeros(SMALL, SMALL)
    samples = 6000
    for _ in range(samples):
        keys = torch.randint(0, 2**32, (3,), generator=generator)
        count, _, committed = accept_sampled(ids, tree.parents, logits, hot, keys, 3)
        tokens = committed[: int(count)].tolist()
        assert tokens == verify_sampling(tree, probs, keys).tokens.tolist()
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[0], tokens[1]] += 1
    statistic, bound = chi_square(first, ROOT_P)
    assert statistic < bound, (statistic, bound)
    for token in range(SMALL):
        if second[token].sum() > 500:  # enough accepted samples to judge
            statistic, bound = chi_square(second[token], AFTER[token])
            assert statistic < bound, (token, statistic, bound)
    assert second.sum() > samples / 3  # drafts were accepted often enough to test depth 2


def test_sampled_device_steps_follow_the_target_distribution() -> None:
    sampled_device_steps(torch.device("cpu"))


def sampled_device_steps(device: torch.device) -> None:
    """The first two sampled tokens through the device step (a static EAGLE-3 drafter fitted so
    that its drafts are often accepted, test_eagle3_decode.py's setting) follow the target's
    exact two-token distribution, on ``device`` (tests/test_gpu.py runs it on CUDA)."""
    model = tiny4("gpt2")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 5.0)
    params = SamplingParams(temperature=1.0)
    first, second = exact_two_token_probs(model, params)
    extended = every_first_then_greedy(second)
    draft = fit_method(model, extended, steps=120, size=TINY_VOCAB).draft
    model, draft = model.to(device), draft.to(device)
    drafter = StaticEagle3Drafter(draft, TargetHead.of(model), top_k=3, depth=2, total_tokens=7)
    decoder = Decoder(model, drafter, DecodeOptions(verify="captured"))
    assert decoder._device_step(params) is not None
    generator = torch.Generator(device).manual_seed(5)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB)
    accepted = 0
    for _ in range(1500):
        result = decoder.generate(
            PROMPT.to(device),
            max_new_tokens=3,
            sampling=params,
            eos_token_ids=(),
            generator=generator,
        )
        counts[result.tokens[0] * TINY_VOCAB + result.tokens[1]] += 1
        accepted += result.accept_lengths[1] > 1
    exact = (first[:, None] * second).flatten()
    assert not bool(counts[exact == 0].any())
    statistic, bound = chi_square(counts, exact)
    assert statistic < bound, (statistic, bound)
    assert accepted > 1500 / 3
