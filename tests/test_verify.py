"""Acceptance rules on forced logits (greedy, typical) and on hand-made distributions (sampling)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from headway.decode.keyed_noise import draw_keyed
from headway.decode.sampling import (
    SamplingParams,
    probs_from_logits,
    top_p_drop,
    top_p_drop_reference,
)
from headway.decode.tree import DraftTree, empty_tree
from headway.decode.verify import (
    AcceptanceRule,
    TypicalParams,
    verify,
    verify_greedy,
    verify_sampling,
    verify_typical,
)

VOCAB = 100
#        root
#       /    \
#     b1(10)  b2(11)
#    /  \       \
#  b3(12) b4(13) b6(15)
#   |
#  b5(14)
TREE = DraftTree(torch.tensor([10, 11, 12, 13, 14, 15]), torch.tensor([-1, -1, 0, 0, 2, 1]))


def forced_logits(argmax: dict[int, int]) -> torch.Tensor:
    """Logits ``[7, VOCAB]`` whose argmax at block entry b is ``argmax[b]`` (default token 0)."""
    logits = torch.randn(TREE.size + 1, VOCAB, generator=torch.Generator().manual_seed(0))
    for block in range(TREE.size + 1):
        logits[block, argmax.get(block, 0)] = 100.0
    return logits


@pytest.mark.parametrize(
    ("argmax", "path", "tokens"),
    [
        ({0: 10, 1: 12, 3: 14, 5: 7}, [0, 1, 3, 5], [10, 12, 14, 7]),  # deepest path, bonus at leaf
        ({0: 10, 1: 13, 4: 8}, [0, 1, 4], [10, 13, 8]),  # second grandchild
        ({0: 11, 2: 15, 6: 9}, [0, 2, 6], [11, 15, 9]),  # second child of the root
        ({0: 11, 1: 12, 3: 14, 2: 3}, [0, 2], [11, 3]),  # right tokens under a wrong node: no
        ({0: 99}, [0], [99]),  # nothing matches: bonus only
    ],
)
def test_greedy_accepts_the_longest_matching_path(
    argmax: dict[int, int], path: list[int], tokens: list[int]
) -> None:
    accepted = verify_greedy(TREE, forced_logits(argmax))
    assert accepted.path.tolist() == path
    assert accepted.tokens.tolist() == tokens
    assert accepted.accept_length == len(tokens)


def test_greedy_on_an_empty_tree_is_one_plain_step() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 42] = 1.0
    accepted = verify_greedy(empty_tree(), logits)
    assert accepted.path.tolist() == [0]
    assert accepted.tokens.tolist() == [42]


def test_greedy_prefers_the_first_of_equally_deep_paths() -> None:
    twins = DraftTree(torch.tensor([5, 5, 6, 6]), torch.tensor([-1, -1, 0, 1]))
    logits = torch.zeros(5, VOCAB)
    logits[0, 5] = logits[1, 6] = logits[2, 6] = logits[3, 1] = logits[4, 2] = 1.0
    assert verify_greedy(twins, logits).tokens.tolist() == [5, 6, 1]


# Sampling: a 6-token vocabulary with hand-made target distributions.
SMALL = 6
ROOT_P = torch.tensor([0.25, 0.05, 0.30, 0.10, 0.20, 0.10])
AFTER = torch.tensor(  # target probs after each first token
    [
        [0.40, 0.10, 0.10, 0.10, 0.20, 0.10],
        [0.10, 0.10, 0.10, 0.50, 0.10, 0.10],
        [0.05, 0.35, 0.05, 0.30, 0.05, 0.20],
        [0.20, 0.20, 0.20, 0.20, 0.10, 0.10],
        [0.10, 0.30, 0.30, 0.10, 0.10, 0.10],
        [0.50, 0.10, 0.10, 0.10, 0.10, 0.10],
    ]
)
LEAF_P = torch.full((SMALL,), 1.0 / SMALL)
ROOT_Q = torch.tensor([0.10, 0.30, 0.20, 0.20, 0.10, 0.10])
CHILD_Q = torch.tensor([0.30, 0.10, 0.10, 0.25, 0.15, 0.10])
SAMPLES = 12_000


def block_probs(tree: DraftTree) -> torch.Tensor:
    """Target probs per block entry: ROOT_P at the root, AFTER[token] at depth 1, LEAF_P below."""
    rows = [ROOT_P]
    for token, depth in zip(tree.tokens.tolist(), tree.depths[1:].tolist(), strict=True):
        rows.append(AFTER[token] if depth == 1 else LEAF_P)
    return torch.stack(rows)


def deterministic_tree(generator: torch.Generator) -> DraftTree:
    """Root children 2, 0, 4 (2 has children 1, 3; 0 has child 5): fixed candidates."""
    return DraftTree(torch.tensor([2, 0, 4, 1, 3, 5]), torch.tensor([-1, -1, -1, 0, 0, 1]))


def drafted_tree(generator: torch.Generator) -> DraftTree:
    """3 root children drawn from ROOT_Q without replacement, 2 grandchildren each from CHILD_Q
    (a drafter that samples its candidates: any way of choosing them stays lossless)."""
    first = torch.multinomial(ROOT_Q, 3, replacement=False, generator=generator)
    tokens, parents = first.tolist(), [-1, -1, -1]
    for child in range(3):
        second = torch.multinomial(CHILD_Q, 2, replacement=False, generator=generator)
        tokens += second.tolist()
        parents += [child, child]
    return DraftTree(torch.tensor(tokens), torch.tensor(parents))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


def keys(generator: torch.Generator) -> torch.Tensor:
    """Noise keys of a tree's three levels (headway.decode.keyed_noise)."""
    return torch.randint(0, 2**32, (3,), generator=generator)


@pytest.mark.parametrize("make_tree", [deterministic_tree, drafted_tree])
def test_sampling_commits_tokens_distributed_as_the_target(make_tree: object) -> None:
    generator = torch.Generator().manual_seed(1234)
    first = torch.zeros(SMALL)
    second = torch.zeros(SMALL, SMALL)  # [first token, second token] when the first was drafted
    for _ in range(SAMPLES):
        tree = make_tree(generator)  # type: ignore[operator]
        accepted = verify_sampling(tree, block_probs(tree), keys(generator))
        tokens = accepted.tokens.tolist()
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[0], tokens[1]] += 1
    assert total_variation(first, ROOT_P) < 0.02
    for token in range(SMALL):
        if second[token].sum() > 1000:  # enough accepted samples to judge
            assert total_variation(second[token], AFTER[token]) < 0.05, token
    assert second.sum() > SAMPLES / 3  # drafts were accepted often enough to test depth 2


def test_sampling_commits_what_plain_sampling_draws_with_the_same_noise() -> None:
    """Whatever the tree (none, fixed candidates, sampled ones), a step's tokens are plain
    sampling's with the same noise: the first from ROOT_P with key 0, the second (where a
    drafted first token was accepted) from the distribution after it with key 1."""
    generator = torch.Generator().manual_seed(7)
    for _ in range(400):
        u = keys(generator)
        plain = int(draw_keyed(ROOT_P, u[0]))
        assert verify_sampling(empty_tree(), ROOT_P[None], u).tokens.tolist() == [plain]
        for tree in (deterministic_tree(generator), drafted_tree(generator)):
            tokens = verify_sampling(tree, block_probs(tree), u).tokens.tolist()
            assert tokens[0] == plain
            if len(tokens) >= 2:
                assert tokens[1] == int(draw_keyed(AFTER[plain], u[1]))


def test_a_child_is_accepted_as_often_as_the_target_draws_it() -> None:
    """Draw-then-match accepts a deterministic candidate set with its summed target mass (what
    recursive rejection over the siblings gives): root children 2, 0, 4 hold 0.75 of ROOT_P."""
    generator = torch.Generator().manual_seed(3)
    tree = deterministic_tree(generator)
    accepted = sum(
        verify_sampling(tree, block_probs(tree), keys(generator)).accept_length > 1
        for _ in range(SAMPLES)
    )
    assert abs(accepted / SAMPLES - 0.75) < 0.015


def test_sampling_step_always_ends_with_one_bonus() -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(200):
        tree = drafted_tree(generator)
        accepted = verify_sampling(tree, block_probs(tree), keys(generator))
        assert accepted.accept_length == accepted.path.numel() <= 3
        drafted = tree.tokens[accepted.path[1:] - 1]
        assert torch.equal(accepted.tokens[:-1], drafted)


def test_typical_acceptance_takes_the_deepest_plausible_path() -> None:
    probs = torch.full((TREE.size + 1, VOCAB), 1e-4)
    probs[0, 10], probs[0, 11] = 0.5, 0.4  # both children plausible
    probs[1, 12], probs[1, 13] = 0.45, 0.45  # both grandchildren of b1 plausible
    probs[3, 14] = 0.01  # b5 is implausible
    probs[3, 77] = 0.9  # bonus after b3 is (almost surely) 77
    probs[4, 66] = 0.9
    probs = probs / probs.sum(-1, keepdim=True)
    u = torch.randint(0, 2**32, (4,), generator=torch.Generator().manual_seed(0))
    accepted = verify_typical(TREE, probs, u, TypicalParams())
    assert accepted.path.tolist()[:2] == [0, 1]
    assert accepted.path.numel() == 3  # depth 2: b3 and b4 tie on depth; b5 is rejected
    probs[1, 13] = 0.6  # now b4 has the higher path likelihood
    probs = probs / probs.sum(-1, keepdim=True)
    assert verify_typical(TREE, probs, u).path.tolist() == [0, 1, 4]


def test_verify_dispatch() -> None:
    logits = forced_logits({0: 10, 1: 12, 3: 14, 5: 7})
    greedy = SamplingParams()
    rules: tuple[AcceptanceRule, ...] = ("lossless", "typical")
    for rule in rules:  # greedy sampling is greedy under either rule
        assert verify(TREE, logits, greedy, None, rule).tokens.tolist() == [10, 12, 14, 7]
    with pytest.raises(ValueError, match="lossless"):
        verify(TREE, logits, greedy, None, "fast")  # type: ignore[arg-type]
    hot_params = SamplingParams(temperature=1.0)
    hot = verify(TREE, logits, hot_params, torch.randint(0, 2**32, (4,)))
    assert hot.tokens.tolist() == [10, 12, 14, 7]  # logits of 100 make sampling deterministic
    with pytest.raises(ValueError, match="noise keys"):
        verify(TREE, logits, hot_params, None)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.3, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=20, top_p=0.75),
        SamplingParams(temperature=1.0, top_k=3),
    ],
    ids=repr,
)
def test_probs_match_transformers_warpers(params: SamplingParams) -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3)) * 3
    logits[1, :4] = logits[1].max() + 1  # a tie at the top-k boundary keeps all tied tokens
    warpers = LogitsProcessorList()
    if params.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        warpers.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        warpers.append(TopPLogitsWarper(params.top_p))
    no_ids: Any = torch.zeros(4, 1, dtype=torch.long)
    expected = warpers(no_ids, logits.clone()).softmax(-1)
    torch.testing.assert_close(probs_from_logits(logits, params), expected)


@pytest.mark.parametrize("scale", [0.3, 2.0, 6.0, 20.0])  # flat (falls back) ... very sharp
@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.9, 0.99])
def test_fast_top_p_equals_the_reference(scale: float, top_p: float) -> None:
    scores = torch.randn(8, 3000, generator=torch.Generator().manual_seed(5)) * scale
    scores[0, :2000] = -torch.inf  # as after top-k
    fast = top_p_drop(scores, top_p, candidate_sizes=(64, 512))
    assert torch.equal(fast, top_p_drop_reference(scores, top_p))


def test_greedy_probs_are_one_hot_and_sampling_is_seeded() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0]])
    assert probs_from_logits(logits, SamplingParams()).tolist() == [[0.0, 1.0, 0.0]]
    probs = torch.tensor([0.2, 0.3, 0.5])
    draws = [int(draw_keyed(probs, torch.tensor(9))) for _ in range(3)]  # one key, one draw
    assert len(set(draws)) == 1


def test_a_draw_never_returns_a_token_without_mass() -> None:
    keys = torch.randint(0, 2**32, (500, 1), generator=torch.Generator().manual_seed(0))
    probs = torch.tensor([[0.0, 0.7, 0.3, 0.0], [0.0, 0.0, 0.0, 2.0]])  # unnormalised is fine
    draws = draw_keyed(probs.expand(500, -1, -1), keys.expand(-1, 2))  # [500, 2]
    assert set(draws[:, 0].tolist()) == {1, 2}
    assert set(draws[:, 1].tolist()) == {3}


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": -0.1},
        {"temperature": float("nan")},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_p": 1.5},
        {"top_p": -0.1},
    ],
)
def test_sampling_params_are_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TypicalParams(posterior_threshold=0.0)
