"""EAGLE trees sized by cost: the best prefix of nodes pays for its forward, the verify cost
table is timed on a grid and interpolated, cost-sized trees stay lossless and follow the costs,
and a tree prices its own draft levels."""

from __future__ import annotations

import itertools

import pytest
import torch

from headway.decode.costs import best_prefix, verify_cost_table
from headway.decode.generate import generate
from headway.drafters.eagle_drafter import EagleDrafter
from headway.heads.eagle import TargetHead
from tests.loop_sized import LoopSized
from tests.test_eagle_drafter import (
    LAST,
    NEW_TOKENS,
    PROMPT,
    TREE,
    assert_valid_tree,
    fed,
    target_and_truth,
    trained,
)
from tests.tiny import TINY_FAMILIES


def test_best_prefix_keeps_the_nodes_that_pay_for_their_forward() -> None:
    probabilities = torch.tensor([0.9, 0.5, 0.2, 0.05])
    flat = [0.010] * 5  # verifying more costs nothing: take every node
    assert best_prefix(probabilities, flat) == 4
    steep = [0.010, 0.030, 0.050, 0.070, 0.090]  # each node costs two plain steps: take none
    assert best_prefix(probabilities, steep) == 0
    # 1 -> 1.9 tokens for 1.2x the time pays; the 0.5 node (2.4 for 1.9x) does not
    knee = [0.010, 0.012, 0.019, 0.020, 0.021]
    assert best_prefix(probabilities, knee) == 1
    assert best_prefix(torch.zeros(0), [0.010]) == 0


def test_verify_cost_table_times_a_grid_and_interpolates() -> None:
    timed: list[int] = []

    def seconds(size: int) -> float:
        timed.append(size)
        return 0.001 * size * size

    table = verify_cost_table(None, 10, seconds=seconds)  # type: ignore[arg-type]
    assert timed == [1, 2, 3, 4, 6, 8, 10] * 4  # a warm-up pass, then three passes in turn
    assert len(table) == 10
    assert table[3] == pytest.approx(0.016) and table[4] == pytest.approx((0.016 + 0.036) / 2)
    assert table[8] == pytest.approx((0.064 + 0.100) / 2) and table[9] == pytest.approx(0.1)


def test_a_size_timed_slower_than_a_larger_one_takes_the_larger_ones_time() -> None:
    """Noise (a job beside the timing) cannot make a mid-sized block look dearer than a larger
    one: the table never decreases, and sizes timed in order keep their own times."""
    spiked = {1: 1.0, 2: 1.1, 3: 1.2, 4: 3.0, 6: 1.3, 8: 1.4, 10: 1.5}  # 4: a noisy spike
    table = verify_cost_table(None, 10, seconds=spiked.__getitem__)  # type: ignore[arg-type]
    assert all(a <= b for a, b in itertools.pairwise(table))
    assert table[3] == pytest.approx(1.3)  # size 4 takes size 6's time
    assert [table[m - 1] for m in (1, 2, 3, 6, 8, 10)] == [1.0, 1.1, 1.2, 1.3, 1.4, 1.5]


def test_a_slow_stretch_slows_every_size_alike() -> None:
    """Sizes are timed in turn and each takes the median of its passes: a slow stretch of
    the machine (here the whole second pass, 3x slower) moves no size, where timing each size
    three times before the next would have tripled a few sizes' times against the rest."""
    calls: list[int] = []

    def seconds(size: int) -> float:
        calls.append(size)
        slow = 7 < len(calls) <= 14  # the first timed pass (after the warm-up pass of 7)
        return size * (3.0 if slow else 1.0)

    table = verify_cost_table(None, 10, seconds=seconds)  # type: ignore[arg-type]
    assert table == pytest.approx([float(m) for m in range(1, 11)])
    with pytest.raises(ValueError, match="rounds"):
        verify_cost_table(None, 10, seconds=seconds, rounds=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_cost_sized_trees_stay_lossless_and_follow_the_costs(family: str) -> None:
    model, truth = target_and_truth(family)
    budget = TREE["total_tokens"]
    sequence = torch.cat([PROMPT, torch.tensor(truth[:5])])
    fixed = fed(
        EagleDrafter(trained(family), TargetHead.of(model), hidden_layer=LAST, **TREE),
        model,
        sequence,
    ).propose(sequence)

    def sized(costs: list[float]) -> LoopSized:
        return LoopSized(
            EagleDrafter(trained(family), TargetHead.of(model), hidden_layer=LAST, **TREE), costs
        )

    free = fed(sized([0.01] * budget), model, sequence).propose(sequence)
    assert free.tokens.tolist() == fixed.tokens.tolist()
    assert free.parents.tolist() == fixed.parents.tolist()
    unsure = fed(sized([0.01] + [1.0] * (budget - 1)), model, sequence)
    assert unsure.propose(sequence).size == 0
    # no node could pay, so the tree stopped after level 1: no frontier forward in the draft cache
    assert unsure.drafter._cache.get_seq_length() == sequence.numel() - 1  # type: ignore[attr-defined]
    real = sized(verify_cost_table(model, budget))
    tree = fed(real, model, sequence).propose(sequence)
    if tree.size:
        assert_valid_tree(tree, budget, TREE["depth"])
    result = generate(model, PROMPT, drafter=real, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    with pytest.raises(ValueError, match="verify_costs has 2 entries"):
        sized([0.01, 0.02])


def test_a_cost_sized_tree_prices_its_own_draft_levels() -> None:
    """On a CPU a cost-sized EAGLE tree times each level's draft forward; once a level costs
    more than a plain token, no uncertain node pays for it and the tree stops at the root's
    children (no frontier forward), while a fixed tree never times anything."""
    model, truth = target_and_truth("llama")
    sequence = torch.cat([PROMPT, torch.tensor(truth[:5])])
    fixed = fed(
        EagleDrafter(trained("llama"), TargetHead.of(model), hidden_layer=LAST, **TREE),
        model,
        sequence,
    )
    fixed.propose(sequence)
    assert fixed.level_seconds == 0.0
    drafter = fed(
        EagleDrafter(trained("llama"), TargetHead.of(model), hidden_layer=LAST, **TREE),
        model,
        sequence,
    )
    sized = LoopSized(drafter, [0.01] * TREE["total_tokens"])
    sized.propose(sequence)  # verifying is free and nothing was timed yet: the whole tree grows
    assert drafter.level_seconds > 0.0
    assert drafter._cache.get_seq_length() > drafter._committed  # levels were drafted
    drafter.level_seconds = 0.02  # twice a plain token's 0.01 s
    sized.propose(sequence)
    assert drafter._cache.get_seq_length() == drafter._committed  # no level was drafted
