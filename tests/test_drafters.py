"""Training-free drafters: prompt lookup (fast index == plain scan), oracle and adversarial."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from headway.decode.tree import DraftTree
from headway.drafters.lookup import PromptLookupDrafter, prompt_lookup_reference, trie_tree
from headway.drafters.oracle import AdversarialDrafter, OracleDrafter
from tests.loop_sized import LoopSized


def as_lists(tree: DraftTree) -> tuple[list[int], list[int]]:
    return tree.tokens.tolist(), tree.parents.tolist()


def test_trie_merges_shared_prefixes_within_the_budget() -> None:
    continuations = [[5, 6, 7], [5, 6, 8], [9], [5, 1]]
    assert as_lists(trie_tree(continuations, max_nodes=10)) == (
        [5, 6, 7, 8, 9, 1],
        [-1, 0, 1, 1, -1, 0],
    )
    assert as_lists(trie_tree(continuations, max_nodes=4)) == ([5, 6, 7, 8], [-1, 0, 1, 1])
    assert trie_tree([], max_nodes=4).size == 0


def test_prompt_lookup_merges_matches_most_recent_first() -> None:
    drafter = PromptLookupDrafter(max_ngram=3, min_ngram=1, num_draft_tokens=3, max_nodes=10)
    sequence = torch.tensor([1, 2, 3, 4, 2, 3, 9, 9, 2, 3])
    drafter.begin(sequence[:4])
    # [9, 2, 3] never occurred before; [2, 3] ended at 5 (then 9 9 2) and at 2 (then 4 2 3).
    assert as_lists(drafter.propose(sequence)) == ([9, 9, 2, 4, 2, 3], [-1, 0, 1, -1, 3, 4])


def test_prompt_lookup_prefers_longer_ngrams_and_respects_min_ngram() -> None:
    sequence = torch.tensor([7, 8, 1, 9, 8, 2, 7, 8])
    longest = PromptLookupDrafter(min_ngram=1, max_ngram=2, num_draft_tokens=2)
    longest.begin(sequence)
    assert as_lists(longest.propose(sequence)) == ([1, 9], [-1, 0])  # [7, 8] beats [8]
    only_long = PromptLookupDrafter(min_ngram=3, max_ngram=3)
    only_long.begin(sequence)
    assert only_long.propose(sequence).size == 0  # [2, 7, 8] never occurred before


def test_prompt_lookup_index_equals_the_plain_scan() -> None:
    rng = random.Random(0)
    for trial in range(20):
        settings: dict[str, Any] = {
            "max_ngram": rng.randint(1, 4),
            "num_draft_tokens": rng.randint(1, 6),
            "max_nodes": rng.randint(1, 12),
        }
        settings["min_ngram"] = rng.randint(1, settings["max_ngram"])
        drafter = PromptLookupDrafter(**settings)
        sequence = [rng.randrange(4) for _ in range(rng.randint(1, 10))]
        drafter.begin(torch.tensor(sequence))
        for _ in range(30):  # commits of 1-4 tokens, like decoding steps
            fast = drafter.propose(torch.tensor(sequence))
            slow = prompt_lookup_reference(sequence, **settings)
            assert as_lists(fast) == as_lists(slow), (trial, sequence, settings)
            sequence += [rng.randrange(4) for _ in range(rng.randint(1, 4))]


def test_prompt_lookup_restarts_cleanly() -> None:
    drafter = PromptLookupDrafter(min_ngram=1, num_draft_tokens=2)
    first = torch.tensor([3, 4, 5, 3])
    drafter.begin(first)
    assert as_lists(drafter.propose(first)) == ([4, 5], [-1, 0])
    second = torch.tensor([6, 6])
    drafter.begin(second)
    assert as_lists(drafter.propose(second)) == ([6], [-1])
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupDrafter(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        PromptLookupDrafter(num_draft_tokens=0)


PROMPT = torch.tensor([1, 10, 11])
TRUTH = [20, 21, 22, 23]


def test_oracle_chain_and_tree() -> None:
    chain_drafter = OracleDrafter(TRUTH, depth=3)
    chain_drafter.begin(PROMPT)
    after_one = torch.cat([PROMPT, torch.tensor(TRUTH[:1])])  # root = first generated token
    assert as_lists(chain_drafter.propose(after_one)) == ([21, 22, 23], [-1, 0, 1])

    tree_drafter = OracleDrafter(TRUTH, depth=2, width=2)
    tree_drafter.begin(PROMPT)
    # Per level: a wrong sibling (smallest seen id that is not the right one) with the right
    # next token below it, then the right token.
    assert as_lists(tree_drafter.propose(after_one)) == ([1, 22, 21, 1, 22], [-1, 0, -1, 2, 2])
    everything = torch.cat([PROMPT, torch.tensor(TRUTH)])
    assert tree_drafter.propose(everything).size == 0  # nothing left to predict


def test_adversarial_never_proposes_the_right_first_token() -> None:
    drafter = AdversarialDrafter(vocab_size=24, depth=3, width=3, continuation=TRUTH)
    drafter.begin(PROMPT)
    tree = drafter.propose(torch.cat([PROMPT, torch.tensor(TRUTH[:1])]))
    first_level = tree.tokens[tree.parents == -1].tolist()
    assert first_level == [22, 23, 0]  # (21 + offset) % 24, never 21
    assert tree.size == 9  # each wrong token carries the right continuation below it
    assert tree.tokens[tree.parents != -1].tolist() == [22, 23] * 3
    with pytest.raises(ValueError, match="width"):
        AdversarialDrafter(vocab_size=4, depth=2, width=4, continuation=TRUTH)


def test_prompt_lookup_adapts_its_draft_length_to_acceptance() -> None:
    sequence = torch.tensor([5, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1])  # [1] matched: 2 3 4 5 ... follows
    drafter = PromptLookupDrafter(min_ngram=1, num_draft_tokens=6, max_nodes=6)
    drafter.begin(sequence)
    no_hidden: tuple[torch.Tensor, ...] = ()
    drafter.observe(sequence[1:], no_hidden)  # the prefill's observation changes nothing
    assert drafter.propose(sequence).size == 6
    drafter.observe(torch.tensor([2, 0]), no_hidden)  # 1 of 6 accepted: shrink by one
    assert drafter.propose(sequence).size == 5
    drafter.observe(torch.tensor([2, 3, 4, 5, 6, 0]), no_hidden)  # all 5 accepted: grow by two
    assert drafter.propose(sequence).size == 6  # capped at num_draft_tokens
    fixed = PromptLookupDrafter(min_ngram=1, num_draft_tokens=6, max_nodes=6, adaptive=False)
    fixed.begin(sequence)
    fixed.propose(sequence)
    fixed.observe(torch.tensor([0]), no_hidden)
    assert fixed.propose(sequence).size == 6


def test_cost_sized_prompt_lookup_sends_what_pays_and_learns_from_rejections() -> None:
    sequence = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    flat = LoopSized(PromptLookupDrafter(num_draft_tokens=4, max_nodes=4), [0.01] * 5)
    flat.begin(sequence[:1])
    assert as_lists(flat.propose(sequence)) == ([4, 5, 6, 7], [-1, 0, 1, 2])
    steep = LoopSized(PromptLookupDrafter(num_draft_tokens=4, max_nodes=4), [0.01] + [1.0] * 4)
    steep.begin(sequence[:1])
    assert steep.propose(sequence).size == 0
    costs = [0.010, 0.013, 0.014, 0.015, 0.016]
    learning = LoopSized(PromptLookupDrafter(num_draft_tokens=4, max_nodes=4), costs)
    learning.begin(sequence[:1])
    sizes = []
    for _ in range(10):
        sizes.append(learning.propose(sequence).size)
        learning.observe(torch.tensor([9]), ())  # nothing accepted, only the bonus token
    assert sizes[0] == 4 and sizes[-1] == 0 and learning.calibration.scale < 0.3
    with pytest.raises(ValueError, match="verify_costs has 2 entries"):
        LoopSized(PromptLookupDrafter(max_nodes=4), [0.01, 0.02])


def test_a_tree_never_verified_does_not_reach_the_next_prompts_calibration() -> None:
    """Generation can stop right after a proposal (max_new_tokens); the next prompt's first
    observe is the prefill (prompt + first token), which must not count as accepted drafts."""
    sequence = torch.tensor([1, 2, 3, 4, 5, 6, 7, 1, 2, 3])
    drafter = LoopSized(PromptLookupDrafter(num_draft_tokens=4, max_nodes=4), [0.01] * 5)
    drafter.begin(sequence[:1])
    assert drafter.propose(sequence).size == 4
    drafter.begin(sequence)
    drafter.observe(torch.cat([sequence[1:], torch.tensor([8])]), ())  # the prefill: 10 tokens
    assert drafter.calibration.scale == 1.0
