"""EAGLE drafting of a batch's rows at once (:mod:`headway.drafters.batch_eagle`): every row's
tree is the one its own eager drafter proposes, step for step (best first, as the eager
drafter's scores rank its nodes), so every row is its prompt's
greedy output and accepts what it accepts decoded alone; a row past the draft cache's first
capacity grows it; drafting a step reads the device once for all rows; ``headway.generate_batch``
builds one draft model for a batch (fp32, CPU)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from headway.decode import batch_sizer
from headway.decode.batch_decode import decode_batch
from headway.decode.batch_drafting import BatchDrafter, RowDrafters, Tree
from headway.decode.captured import MIN_CAPACITY
from headway.decode.generate import GenerationResult, generate
from headway.decode.tree import subtree
from headway.drafters.batch_eagle import BatchEagle
from headway.drafters.eagle_drafter import EagleDrafter
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import seeds_of
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_generate import hf_greedy
from tests.test_static_eagle import SHAPES, _pair

NEW_TOKENS = 24


class Recording:
    """A :class:`BatchDrafter` that keeps every step's trees."""

    def __init__(self, inner: BatchDrafter) -> None:
        self.inner = inner
        self.hidden_layers, self.max_nodes = inner.hidden_layers, inner.max_nodes
        self.trees: list[list[Tree]] = []
        self.kept: list[list[int]] = []  # the rows kept each time rows left the batch
        self.added: list[int] = []  # how many rows each time rows joined it

    @property
    def drafts(self) -> bool:
        return self.inner.drafts

    def begin(self, prompts: Sequence[Tensor]) -> None:
        self.inner.begin(prompts)

    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        self.inner.observe(kept, states)

    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        trees = self.inner.propose(sequences, live)
        self.trees.append(trees)
        return trees

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.inner.keep_rows(rows)
        self.kept.append(list(rows))

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        self.inner.add_rows(prompts)
        self.added.append(len(prompts))


def _paths(tree: Tree) -> list[tuple[int, ...]]:
    """A tree as the sorted token paths from the root to each node (order-free)."""
    tokens, parents = tree
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tokens, parents, strict=True):
        paths.append((*(paths[parent] if parent >= 0 else ()), token))
    return sorted(paths)


class RankedRows(RowDrafters):
    """One eager drafter per row, each tree's nodes listed best first by the scores the eager
    drafter gives them (stable: ties keep creation order)."""

    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        trees: list[Tree] = []
        for drafter, sequence, on in zip(self.rows, sequences, live, strict=True):
            if drafter is None or not on:
                trees.append(([], []))
                continue
            tree = drafter.propose(torch.tensor(sequence), floor=-math.inf)
            assert tree.scores is not None
            order = torch.sort(tree.scores, descending=True, stable=True).indices
            ranked = subtree(tree.tokens, tree.parents, order, ranked=True)
            trees.append((ranked.tokens.tolist(), ranked.parents.tolist()))
        return trees


def _whole_trees(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every step sends every row's whole tree (no sizing by this machine's timings, no plain
    step to time)."""
    monkeypatch.setattr(
        batch_sizer.BatchSizer, "nodes", lambda self, parents, drafting=0.0: self.steps.max_depth
    )
    monkeypatch.setattr(batch_sizer, "PLAIN_EVERY", 10**9)


def _drafters(kind: str, model: Any, shape: str, count: int) -> tuple[list[Any], EagleDrafter]:
    """``count`` eager drafters of one draft model, and one more for the batch."""
    made = [_pair(kind, model, SHAPES[shape])[0] for _ in range(count + 1)]
    return made[:count], made[count]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", ["eagle1", "trained", "eagle3.1"])
def test_batch_drafting_proposes_each_rows_own_trees(
    kind: str, shape: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rows of different lengths (one ending early by EOS): the batch drafter's trees are
    each row's eager drafter's, every step; the rows are HF greedy's and accept what each
    accepts decoded alone."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    rows, one = _drafters(kind, model, shape, 3)
    alone, together, runs = three_rows(model, rows, BatchEagle(one, 3))
    for index, (mine, theirs) in enumerate(zip(together.trees, alone.trees, strict=True)):
        assert [_paths(tree) for tree in mine] == [_paths(tree) for tree in theirs], index
    ranked = Recording(RankedRows(rows))  # and best first, as the eager scores rank them
    decode_batch(model, PROMPTS, ranked, max_new_tokens=NEW_TOKENS, stop_check=_stop(model))
    assert together.trees == ranked.trees
    if kind == "trained":  # the fitted drafter's drafts are accepted
        assert max(max(row.accept_lengths) for row in runs) > 2


PROMPTS = [PROMPT, PROMPT[:3], torch.cat([PROMPT, torch.tensor([84, 24, 70, 84, 24])])]
"""Three rows of different lengths (the last ``PROMPT`` and five tokens more)."""


def _stop(model: Any) -> Callable[[list[int]], bool]:
    """A stop check that ends ``PROMPTS[1]``'s row at its 10th token and no other."""
    early = hf_greedy(model, PROMPTS[1], 10, eos=None)
    return lambda generated: generated == early


def three_rows(
    model: Any, rows: list[Any], batch: BatchDrafter
) -> tuple[Recording, Recording, list[GenerationResult]]:
    """:data:`PROMPTS` decoded with one drafter per row (``rows``) and with ``batch``, the
    middle row stopping at its 10th token: each row of the batch is HF greedy's and accepts
    what it accepts one drafter per row and decoded alone. Returns both recordings (at least
    four steps each) and the batch's rows."""
    stop = _stop(model)
    alone, together = Recording(RowDrafters(rows)), Recording(batch)
    runs = [
        decode_batch(model, PROMPTS, drafting, max_new_tokens=NEW_TOKENS, stop_check=stop)
        for drafting in (alone, together)
    ]
    assert len(together.trees) == len(alone.trees) > 3
    for index, (row, prompt) in enumerate(zip(runs[1], PROMPTS, strict=True)):
        assert row.tokens == hf_greedy(model, prompt, len(row.tokens), eos=None), index
        assert row.accept_lengths == runs[0][index].accept_lengths, index
        single = generate(
            model,
            prompt,
            drafter=rows[index],
            max_new_tokens=NEW_TOKENS,
            eos_token_ids=(),
            stop_check=stop,
        )
        assert row.accept_lengths == single.accept_lengths, index
    assert runs[1][1].stop_reason == "stop_sequence"
    assert together.kept == alone.kept != []  # rows that finished left the batch
    assert [len(row.tokens) for row in runs[1]] == [NEW_TOKENS, 10, NEW_TOKENS]
    return alone, together, runs[1]


def test_a_long_row_grows_the_draft_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """A row whose prompt, answer and tree pass ``MIN_CAPACITY`` draft columns beside a short
    one: the draft cache grows mid-decoding (each row's committed columns kept) and both rows'
    trees stay their eager drafters'."""
    _whole_trees(monkeypatch)
    model = copy.deepcopy(target_and_truth("llama")[0])
    model.config.max_position_embeddings = 600  # rotary positions: room past 256
    generator = torch.Generator().manual_seed(2)
    long = torch.randint(3, 60, (MIN_CAPACITY - 20,), generator=generator)
    prompts = [long, PROMPT]
    rows, one = _drafters("trained", model, "tree", 2)
    batch = BatchEagle(one, 2)
    alone, together = Recording(RowDrafters(rows)), Recording(batch)
    for drafting in (alone, together):
        decode_batch(model, prompts, drafting, max_new_tokens=NEW_TOKENS)
    assert batch._cache.capacity > MIN_CAPACITY
    assert len(together.trees) == len(alone.trees) > 3
    for mine, theirs in zip(together.trees, alone.trees, strict=True):
        assert [_paths(tree) for tree in mine] == [_paths(tree) for tree in theirs]


def test_drafting_a_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch counter of ``headway.eval.dispatch``: each step's drafting of every row
    (the tree levels of all rows, the selections) reads the device once, for all rows, and
    its device work (:meth:`BatchEagle.trees_on_device`) is what a CUDA graph can hold: no
    host read, no host tensor baked in, no random op."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    _, one = _drafters("trained", model, "tree", 0)
    batch = BatchEagle(one, len(prompts))
    reads: list[int] = []
    faults: list[dict[str, int]] = []
    propose, on_device = BatchEagle.propose, BatchEagle.trees_on_device

    def counted(self: BatchEagle, sequences: Sequence[list[int]], live: Sequence[bool]) -> Any:
        tensors, devices = seeds_of(self, 4, every_tensor=True)
        weights = [*one.model.parameters(), *one.head.embed.parameters()]
        counter = DispatchCounter([*tensors, *weights, *model.parameters()], devices)

        def captured(self: BatchEagle, roots: Tensor) -> Tensor:
            with counter.region("captured"):
                return on_device(self, roots)

        with counter, pytest.MonkeyPatch.context() as patch:
            patch.setattr(BatchEagle, "trees_on_device", captured)
            trees = propose(self, sequences, live)
        reads.append(counter.counts.syncs)
        faults.append(dict(counter.counts.graph_faults))
        return trees

    monkeypatch.setattr(BatchEagle, "propose", counted)
    decode_batch(model, prompts, batch, max_new_tokens=NEW_TOKENS)
    assert len(reads) > 3 and set(reads) == {1}, reads
    assert faults == [{}] * len(faults), faults


def test_a_steps_pairs_learned_in_one_shape_are_device_work_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``fixed`` (CUDA's default): each step's pairs are padded to one shape and learned from
    staged buffers, what a CUDA graph replays: the dispatch counter finds no graph fault and no
    host read in it, and the trees are those learned without padding."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    faults: list[dict[str, int]] = []
    learn = BatchEagle.learn

    def counted(self: BatchEagle, tokens: Tensor, states: Any, count: Tensor) -> None:
        if tokens is not self._in_tokens:  # the prompts' pairs, of their own width
            learn(self, tokens, states, count)
            return
        seeds, devices = seeds_of(self, 4, every_tensor=True)
        counter = DispatchCounter([*seeds, *model.parameters()], devices)
        with counter, counter.region("captured"):
            learn(self, tokens, states, count)
        faults.append({**counter.counts.graph_faults, "syncs": counter.counts.syncs})

    monkeypatch.setattr(BatchEagle, "learn", counted)
    recordings = []
    for fixed in (False, True):
        _, one = _drafters("trained", model, "tree", 0)
        batch = BatchEagle(one, 2)  # the three prompts two at a time: rows leave and join
        batch.fixed = fixed
        recordings.append(Recording(batch))
        decode_batch(model, PROMPTS, recordings[-1], max_new_tokens=NEW_TOKENS, max_batch=2)
    assert recordings[0].trees == recordings[1].trees
    assert len(faults) > 3 and faults == [{"syncs": 0}] * len(faults), faults


def test_capturing_batch_drafting_needs_cuda() -> None:
    """Off CUDA the drafting runs uncaptured; asking for CUDA graphs there is refused."""
    model, _ = target_and_truth("llama")
    _, one = _drafters("trained", model, "tree", 0)
    assert not BatchEagle(one, 2).capture
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        BatchEagle(one, 2, capture=True)


def test_generate_batch_keeps_one_eagle_model_between_calls(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``headway.generate_batch`` with a saved EAGLE-1 drafter builds its draft model once over
    two calls (kept as ``headway.generate`` keeps it) and drafts every row with it; prompt
    lookup stays one drafter per row; every output is the one ``headway.generate`` gives."""
    import headway
    from headway import named_drafters
    from headway.heads.eagle import EagleConfig, EagleModel
    from tests.test_eagle_drafter import save_run
    from tests.tiny import tiny_model
    from tests.tokenizers_fixture import smollm2_tokenizer

    tokenizer = smollm2_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.save_pretrained(tmp_path / "tiny")
    tokenizer.save_pretrained(tmp_path / "tiny")
    target = headway.load_target(str(tmp_path / "tiny"), dtype="float32", device="cpu")
    torch.manual_seed(1)
    run = save_run(tmp_path / "run", target.model, EagleModel(EagleConfig.from_target(model)))
    built: list[Any] = []
    build = named_drafters.build_drafter

    def counting(*args: Any) -> Any:
        built.append(build(*args))
        return built[-1]

    monkeypatch.setattr(named_drafters, "build_drafter", counting)
    batches: list[Any] = []
    propose = BatchEagle.propose

    def counted(self: BatchEagle, *args: Any) -> Any:
        batches.append(self)
        return propose(self, *args)

    monkeypatch.setattr(BatchEagle, "propose", counted)
    prompts = ["one two three", "four", "five six"]
    for drafter in (None, headway.api.BATCH_DRAFTER):  # heads alone draft (the default)
        rows = headway.generate_batch(
            target, prompts, drafter=drafter, heads=run, max_new_tokens=10, chat=False
        )
        alone = [
            headway.generate(target, text, drafter=str(run), max_new_tokens=10, chat=False)
            for text in prompts
        ]
        assert [row.token_ids for row in rows] == [row.token_ids for row in alone]
    assert len(built) == 1 and batches and all(b.drafter is built[0] for b in batches)
    lookup = api_drafting(target, 3)
    assert isinstance(lookup, list) and len(lookup) == 3 and len({id(d) for d in lookup}) == 3


def api_drafting(target: Any, batch: int) -> Any:
    """What ``headway.generate_batch`` drafts a batch of prompt lookup with."""
    from headway import api

    drafting, give_back = api._batch_drafting(target, "prompt-lookup", None, None, batch)
    give_back()
    return drafting


@pytest.mark.parametrize("kind", ["eagle1", "trained"])
def test_a_sampled_batch_drafts_each_row_with_its_own_noise(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Sampled (temperature 0.8), the batch drafter couples each row to its prompt's noise:
    every row accepts what it accepts with its own coupled eager drafter in the batch, and the
    first row what it accepts decoded alone with the same seed (its text too); uncoupled, the
    acceptance differs."""
    from headway.decode.sampling import SamplingParams

    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    warm = SamplingParams(temperature=0.8)
    rows, one = _drafters(kind, model, "tree", 3)

    def run(drafting: Any) -> list[GenerationResult]:
        return decode_batch(
            model, PROMPTS, drafting, max_new_tokens=NEW_TOKENS, sampling=warm,
            generator=torch.Generator().manual_seed(6),
        )  # fmt: skip

    together, alone = run(BatchEagle(one, 3)), run(RowDrafters(rows))
    assert [row.tokens for row in together] == [row.tokens for row in alone]
    assert [row.accept_lengths for row in together] == [row.accept_lengths for row in alone]
    single = generate(
        model, PROMPTS[0], drafter=rows[0], max_new_tokens=NEW_TOKENS, eos_token_ids=(),
        sampling=warm, generator=torch.Generator().manual_seed(6),
    )  # fmt: skip
    assert single.tokens == together[0].tokens
    assert single.accept_lengths == together[0].accept_lengths
    uncoupled = BatchEagle(one, 3)
    uncoupled.couple = lambda seeds, temperature: None  # type: ignore[method-assign]
    plain = run(uncoupled)
    assert [row.tokens for row in plain] == [row.tokens for row in together]
    assert [row.accept_lengths for row in plain] != [row.accept_lengths for row in together]
