"""Medusa drafting of a batch's rows at once (:mod:`headway.drafters.batch_medusa`): every row's
tree is the one its own Medusa drafter proposes, step for step, so every row is its prompt's
greedy output and accepts what it accepts decoded alone; drafting a step reads the device once
for all rows (fp32, CPU)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from headway.decode.batch_decode import decode_batch
from headway.decode.batch_drafting import RowDrafters
from headway.decode.generate import generate
from headway.drafters.batch_eagle import BatchEagle
from headway.drafters.batch_medusa import BatchMedusa
from headway.drafters.medusa_drafter import MedusaDrafter
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import seeds_of
from headway.heads.hidden_states import final_hidden_layer
from headway.heads.medusa import MedusaConfig, MedusaHeads
from tests.test_batch_eagle import (
    NEW_TOKENS,
    PROMPTS,
    Recording,
    _paths,
    _stop,
    _whole_trees,
    three_rows,
)
from tests.test_batch_eagle import _drafters as eagle_drafters
from tests.test_eagle3 import PROMPT, target_and_truth
from tests.test_generate import hf_greedy
from tests.tiny import TINY_VOCAB

CHOICES: dict[str, Any] = {"default": "default", "deep": [[0], [1], [0, 0], [0, 0, 0], [1, 0]]}


def _drafters(model: Any, choices: Any, count: int) -> list[MedusaDrafter]:
    """``count`` drafters over one set of random heads (sharpened, so some drafts land)."""
    torch.manual_seed(1)
    heads = MedusaHeads(MedusaConfig(3, 1, 32, TINY_VOCAB), model.lm_head.weight)
    heads = heads.to(model.device).eval()  # on the model's device before its route is chosen
    layer = final_hidden_layer(model)
    return [MedusaDrafter(heads, hidden_layer=layer, choices=choices) for _ in range(count)]


@pytest.mark.parametrize("choices", sorted(CHOICES))
def test_batch_medusa_proposes_each_rows_own_trees(
    choices: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three rows of different lengths, one stopping early: the batch's trees are each row's
    own drafter's, every step; every row is HF greedy's and accepts what it accepts alone."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    rows = _drafters(model, CHOICES[choices], 4)
    alone, together, _ = three_rows(model, rows[:3], BatchMedusa(rows[3], 3))
    assert together.trees == alone.trees


def test_medusa_drafting_a_step_reads_the_device_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dispatch counter: each step's drafting of every row reads the device once."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    prompts = [PROMPT, PROMPT[:4], PROMPT[2:]]
    drafter = _drafters(model, "default", 1)[0]
    batch = BatchMedusa(drafter, len(prompts))
    reads: list[int] = []
    propose = BatchMedusa.propose

    def counted(self: BatchMedusa, sequences: Sequence[list[int]], live: Sequence[bool]) -> Any:
        _, devices = seeds_of(self, 4, every_tensor=True)
        assert self._states is not None  # the device's: the rows' states and the heads
        counter = DispatchCounter([self._states, *drafter.heads.parameters()], devices)
        with counter:
            trees = propose(self, sequences, live)
        reads.append(counter.counts.syncs)
        return trees

    monkeypatch.setattr(BatchMedusa, "propose", counted)
    decode_batch(model, prompts, batch, max_new_tokens=NEW_TOKENS)
    assert len(reads) > 3 and set(reads) == {1}, reads


@pytest.mark.parametrize("kind", ["eagle3", "medusa"])
def test_rows_joining_a_batch_draft_as_they_would_alone(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five prompts through a batch of two rows (one stopping at its 10th token): the drafting
    of all rows at once (EAGLE-3, Medusa) takes the waiting prompts in as rows finish and
    proposes what one drafter per row proposes; every output is HF greedy's and accepts what
    it accepts decoded alone."""
    _whole_trees(monkeypatch)
    model, _ = target_and_truth("llama")
    prompts = [*PROMPTS, PROMPT[2:], PROMPT[:6]]
    if kind == "medusa":
        drafters: list[Any] = list(_drafters(model, "default", 3))
        batch: Any = BatchMedusa(drafters[2], 2)
    else:
        drafters, one = eagle_drafters("trained", model, "tree", 2)
        batch = BatchEagle(one, 2)
    alone, together = Recording(RowDrafters(drafters[:2])), Recording(batch)
    stop = _stop(model)
    runs = [
        decode_batch(
            model, prompts, drafting, max_new_tokens=NEW_TOKENS, stop_check=stop, max_batch=2
        )
        for drafting in (alone, together)
    ]
    assert sum(together.added) == 3 and together.added == alone.added
    assert [[_paths(t) for t in step] for step in together.trees] == [
        [_paths(t) for t in step] for step in alone.trees
    ]
    for index, (row, prompt) in enumerate(zip(runs[1], prompts, strict=True)):
        assert row.tokens == hf_greedy(model, prompt, len(row.tokens), eos=None), index
        assert row.accept_lengths == runs[0][index].accept_lengths, index
        single = generate(
            model, prompt, drafter=drafters[0], max_new_tokens=NEW_TOKENS, eos_token_ids=(),
            stop_check=stop,
        )  # fmt: skip
        assert row.accept_lengths == single.accept_lengths, index


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["eagle1", "medusa"])
def test_batch_drafting_with_rows_joining_on_cuda(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five prompts through two captured rows on CUDA, drafted at once (an EAGLE-1 draft
    model, its drafting captured too, or Medusa heads; random, so most drafts are rejected):
    rows leave and join, each step's graph is captured again for the changed batch, every
    output is HF greedy's, and EAGLE's captured trees are its uncaptured ones."""
    from headway.drafters.eagle_drafter import EagleDrafter
    from headway.heads.eagle import EagleConfig, EagleModel, TargetHead
    from tests.tiny import tiny_model

    _whole_trees(monkeypatch)  # the same proposals in both runs, whatever the timings
    model = tiny_model("llama").to("cuda")
    prompts = [p.to("cuda") for p in [*PROMPTS, PROMPT[2:], PROMPT[:6]]]
    truths = [hf_greedy(model, prompt, NEW_TOKENS, eos=None) for prompt in prompts]
    torch.manual_seed(1)
    if kind == "medusa":
        batch: Any = BatchMedusa(_drafters(model, "default", 1)[0], 2)
    else:
        draft = EagleModel(EagleConfig.from_target(model)).to("cuda").eval()
        layer = int(model.config.num_hidden_layers)
        eagle = EagleDrafter(draft, TargetHead.of(model), hidden_layer=layer)
        batch = BatchEagle(eagle, 2)
        eager = Recording(BatchEagle(eagle, 2, capture=False))
        decode_batch(model, prompts, eager, max_new_tokens=NEW_TOKENS, max_batch=2)
    recorded = Recording(batch)
    rows = decode_batch(model, prompts, recorded, max_new_tokens=NEW_TOKENS, max_batch=2)
    assert [row.tokens for row in rows] == truths
    if kind == "eagle1":
        assert batch._drafting.graph is not None and recorded.trees == eager.trees
