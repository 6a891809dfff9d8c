"""Batched greedy speculative steps (:mod:`headway.decode.batch_step`): rows of different prompts,
each with its own trees and acceptances, decode through one static cache to each row's own greedy
output, as transformers decodes that prompt alone (fp32), across a growth of the cache too; a
step reads the device once for all rows, and what a GPU would capture is device work only."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode.batch_step import BatchVerify
from headway.decode.captured import MIN_CAPACITY, StaticForward
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import seeds_of
from tests.test_generate import hf_greedy
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_config, tiny_model

NEW_TOKENS = 24
DEPTH = 4
BRANCHES = 3  # random branches: every row's tree has 1 + DEPTH + BRANCHES nodes


def _tree(truth: list[int], done: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """A wrong first child of the root, then a chain whose first ``k`` tokens (``k`` drawn per
    step) continue the row's reference answer after its ``done`` tokens, then wrong ones, and
    random branches: an accepted path skips block entries, so its keys/values must move."""
    right = truth[done : done + DEPTH] + [0] * DEPTH
    k = rng.randint(0, DEPTH)
    decoy = (right[0] + 2) % TINY_VOCAB
    tokens = [decoy, *(right[i] if i < k else (right[i] + 1) % TINY_VOCAB for i in range(DEPTH))]
    parents = [-1, -1, *range(1, DEPTH)]
    for _ in range(BRANCHES):
        parents.append(rng.randint(-1, len(tokens) - 1))
        tokens.append(rng.randrange(3, TINY_VOCAB))
    return tokens, parents


def _decode(
    step: BatchVerify, prompts: Sequence[Tensor], truths: list[list[int]], new_tokens: int
) -> list[list[int]]:
    """Prefill, then batched steps until every row has ``new_tokens``; each row's tokens."""
    rng = random.Random(0)
    generated = [[int(root)] for root in step.prefill(prompts).tolist()]
    while min(len(row) for row in generated) < new_tokens:
        _step(step, generated, truths, rng)
    return generated


def _step(
    step: BatchVerify, generated: list[list[int]], truths: list[list[int]], rng: random.Random
) -> None:
    """One batched step of every row (trees of :func:`_tree`), its tokens appended."""
    trees = [_tree(truth, len(row), rng) for truth, row in zip(truths, generated, strict=True)]
    committed = step.step(
        torch.tensor([row[-1] for row in generated]),
        torch.tensor([tokens for tokens, _ in trees]),
        torch.tensor([parents for _, parents in trees]),
    )
    for row, tokens in zip(generated, committed, strict=True):
        row += tokens


def _prompts(sizes: Sequence[int], seed: int = 3) -> list[Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, TINY_VOCAB, (size,), generator=generator) for size in sizes]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_rows_decode_through_one_cache_as_each_alone(family: str) -> None:
    """Four prompts of 3, 11, 6 and 1 tokens, each row its own trees (0-4 drafted tokens right
    a step, so rows commit different counts and move different columns)."""
    model = tiny_model(family)
    prompts = _prompts((3, 11, 6, 1))
    truths = [hf_greedy(model, p, NEW_TOKENS + DEPTH + 1, eos=None) for p in prompts]
    step = BatchVerify(StaticForward(model, batch=len(prompts)), max_depth=DEPTH)
    with torch.no_grad():
        generated = _decode(step, prompts, truths, NEW_TOKENS)
    for row, (tokens, truth) in enumerate(zip(generated, truths, strict=True)):
        assert tokens[:NEW_TOKENS] == truth[:NEW_TOKENS], row
    lengths = step.lengths.tolist()
    assert len(set(lengths)) > 1 and lengths == [
        len(p) + len(g) - 1 for p, g in zip(prompts, generated, strict=True)
    ]


def test_a_row_growing_the_cache_keeps_every_rows_output() -> None:
    """A 240-token prompt beside a 5-token one: the long row passes the smallest cache's
    ``MIN_CAPACITY`` columns mid-decoding, the cache grows (every row's columns kept) and the
    step's buffers are made again for the new one."""
    config = tiny_config("llama")
    config.max_position_embeddings = 600
    torch.manual_seed(0)
    model = type(tiny_model("llama"))(config).eval()
    prompts = _prompts((240, 5))
    truths = [hf_greedy(model, p, 40 + DEPTH + 1, eos=None) for p in prompts]
    forward = StaticForward(model, batch=2)
    step = BatchVerify(forward, max_depth=DEPTH)
    with torch.no_grad():
        generated = _decode(step, prompts, truths, 40)
    assert forward.cache.capacity > MIN_CAPACITY
    assert [row[:40] for row in generated] == [truth[:40] for truth in truths]


def _counted_bodies(
    step: BatchVerify, model: Any, roots: Tensor, monkeypatch: pytest.MonkeyPatch
) -> DispatchCounter:
    """A dispatch counter over ``step``'s tensors and the model's, every step body counted
    in its ``captured`` region (what a GPU records as a graph)."""
    tensors, devices = seeds_of(step, 4, every_tensor=True)
    counter = DispatchCounter([*tensors, *model.parameters(), *model.buffers(), roots], devices)
    body = BatchVerify._body

    def captured(self: BatchVerify, plan: Any) -> None:
        with counter.region("captured"):
            body(self, plan)

    monkeypatch.setattr(BatchVerify, "_body", captured)
    return counter


def test_a_step_reads_the_device_once_and_its_body_is_device_work_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The dispatch counter of ``headway.eval.dispatch``: one host read a step for all rows,
    and the body a GPU records as a graph reads nothing back and copies nothing in."""
    model = tiny_model("llama")
    prompts = _prompts((3, 9, 5))
    truths = [hf_greedy(model, p, 16 + DEPTH + 1, eos=None) for p in prompts]
    step = BatchVerify(StaticForward(model, batch=len(prompts)), max_depth=DEPTH)
    roots = step.prefill(prompts)  # the buffers exist before counting
    counter = _counted_bodies(step, model, roots, monkeypatch)
    monkeypatch.setattr(step, "prefill", lambda prompts: roots)
    steps = []
    original = step.step

    def counted(*args: Any) -> list[list[int]]:
        steps.append(1)
        return original(*args)

    monkeypatch.setattr(step, "step", counted)
    with torch.inference_mode(), counter:
        generated = _decode(step, prompts, truths, 16)
    assert [row[:16] for row in generated] == [truth[:16] for truth in truths]
    assert counter.counts.syncs == len(steps) + 1 > 4  # and the read of the first tokens
    assert counter.counts.graph_faults == {}


def test_a_sampled_steps_body_computes_its_noise_on_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sampled, each row's noise is a hash of its seed and positions computed in the body
    (headway.decode.keyed_noise): no host read or copy there, one read a step."""
    from headway.decode.sampling import SamplingParams

    model = tiny_model("llama")
    prompts = _prompts((3, 9, 5))
    hot = SamplingParams(temperature=1.0)
    step = BatchVerify(StaticForward(model, batch=len(prompts)), max_depth=DEPTH)
    roots = step.prefill(prompts, hot, torch.tensor([5, 6, 7]))
    counter = _counted_bodies(step, model, roots, monkeypatch)
    rng = random.Random(1)
    generated = [[int(root)] for root in roots.tolist()]
    with torch.inference_mode(), counter:
        for _ in range(5):
            trees = [_tree(row, 0, rng) for row in generated]
            committed = step.step(
                torch.tensor([row[-1] for row in generated]),
                torch.tensor([tokens for tokens, _ in trees]),
                torch.tensor([parents for _, parents in trees]),
                sampling=hot,
            )
            for row, tokens in zip(generated, committed, strict=True):
                row += tokens
    assert counter.counts.syncs == 5 and counter.counts.graph_faults == {}
    assert min(len(row) for row in generated) >= 6


def test_rows_leaving_the_batch_leave_the_others_as_they_were() -> None:
    """Three rows step together; then the batch keeps rows 2 and 0 (in that order) and they go
    on to their own greedy outputs over a cache of two rows."""
    model = tiny_model("llama")
    prompts = _prompts((7, 3, 12))
    truths = [hf_greedy(model, p, 24 + DEPTH + 1, eos=None) for p in prompts]
    forward = StaticForward(model, batch=3)
    step = BatchVerify(forward, max_depth=DEPTH)
    rng = random.Random(1)
    with torch.no_grad():
        generated = [[int(root)] for root in step.prefill(prompts).tolist()]
        turn = 0
        while turn < 4 or min(len(row) for row in generated) < 24:
            turn += 1
            if turn == 5:
                step.keep_rows([2, 0])
                generated, truths = [generated[2], generated[0]], [truths[2], truths[0]]
            _step(step, generated, truths, rng)
    assert forward.cache.batch == step.batch == 2 and step.lengths.shape == (2,)
    assert [row[:24] for row in generated] == [truth[:24] for truth in truths]


def test_a_long_prompt_joining_the_batch_grows_its_cache() -> None:
    """Two short rows step; a 240-token prompt joins as a third row (its prefill past the
    smallest cache's capacity): the cache grows with every row's columns kept, and all three
    go on to their own greedy outputs."""
    config = tiny_config("llama")
    config.max_position_embeddings = 600
    torch.manual_seed(0)
    model = type(tiny_model("llama"))(config).eval()
    prompts = _prompts((5, 9, 240))
    truths = [hf_greedy(model, p, 24 + DEPTH + 1, eos=None) for p in prompts]
    forward = StaticForward(model, batch=2)
    step = BatchVerify(forward, max_depth=DEPTH)
    rng = random.Random(2)
    with torch.no_grad():
        generated = [[int(root)] for root in step.prefill(prompts[:2]).tolist()]
        turn = 0
        while turn < 3 or min(len(row) for row in generated) < 24:
            turn += 1
            if turn == 3:
                generated.append([int(step.add_rows(prompts[2:])[0])])
            _step(step, generated, truths[: len(generated)], rng)
    assert forward.cache.capacity > MIN_CAPACITY and forward.cache.batch == step.batch == 3
    assert [row[:24] for row in generated] == [truth[:24] for truth in truths]


def test_a_row_left_inactive_commits_nothing() -> None:
    """A finished row steps on beside the others without advancing: its length stays."""
    model = tiny_model("llama")
    prompts = _prompts((4, 7))
    step = BatchVerify(StaticForward(model, batch=2), max_depth=DEPTH)
    roots = step.prefill(prompts)
    tokens, parents = torch.tensor([[5, 6], [5, 6]]), torch.tensor([[-1, 0], [-1, 0]])
    committed = step.step(roots, tokens, parents, torch.tensor([True, False]))
    assert step.lengths.tolist() == [4 + len(committed[0]), 7]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_captured_batched_steps_decode_each_row_as_alone_on_cuda(family: str) -> None:
    """The same rows on CUDA, each step replayed from a CUDA graph (one per tree size)."""
    model = tiny_model(family).to("cuda")
    prompts = [prompt.to("cuda") for prompt in _prompts((3, 11, 6, 1))]
    truths = [hf_greedy(model, p, NEW_TOKENS + DEPTH + 1, eos=None) for p in prompts]
    forward = StaticForward(model, batch=len(prompts))
    step = BatchVerify(forward, max_depth=DEPTH)
    generated = _decode(step, prompts, truths, NEW_TOKENS)
    assert forward.capture and all(plan.graph is not None for plan in step._plans.values())
    assert [row[:NEW_TOKENS] for row in generated] == [t[:NEW_TOKENS] for t in truths]
    # sampled, through the batched decoding loop: each step's graph draws nothing itself
    from headway.decode.batch_decode import decode_batch
    from headway.decode.sampling import SamplingParams
    from headway.drafters.lookup import PromptLookupDrafter

    rows = decode_batch(
        model,
        prompts,
        [PromptLookupDrafter() for _ in prompts],
        max_new_tokens=NEW_TOKENS,
        sampling=SamplingParams(temperature=1.0),
        generator=torch.Generator("cuda").manual_seed(0),
    )
    assert all(len(row.tokens) == NEW_TOKENS for row in rows)
    # Medusa heads, one per row, reading the states each captured step leaves (graph outputs)
    from headway.drafters.medusa_drafter import MedusaDrafter
    from headway.heads.hidden_states import final_hidden_layer
    from headway.heads.medusa import MedusaConfig, MedusaHeads

    torch.manual_seed(1)
    hidden = int(model.config.get_text_config().hidden_size)
    heads = MedusaHeads(
        MedusaConfig(2, 1, hidden, TINY_VOCAB), model.get_output_embeddings().weight
    )
    medusa = [MedusaDrafter(heads.eval(), hidden_layer=final_hidden_layer(model)) for _ in prompts]
    rows = decode_batch(model, prompts, medusa, max_new_tokens=NEW_TOKENS)
    assert [row.tokens for row in rows] == [t[:NEW_TOKENS] for t in truths]


@pytest.mark.parametrize("per_row", [True, False])
def test_the_prefill_takes_each_rows_last_logits_either_way(
    per_row: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model taking ``logits_to_keep`` positions per row runs its LM head on each prompt's
    last entry alone; one taking a count keeps the shortest prompt's last entry on: the first
    tokens are each prompt's greedy next token either way."""
    from headway.decode import batch_step

    monkeypatch.setattr(batch_step, "keeps_per_row", lambda model: per_row)
    model = tiny_model("qwen2")
    prompts = _prompts((2, 13, 7))
    step = BatchVerify(StaticForward(model, batch=3), max_depth=DEPTH)
    firsts = step.prefill(prompts).tolist()
    assert firsts == [hf_greedy(model, p, 1, eos=None)[0] for p in prompts]
