"""The EAGLE drafter: EAGLE-2 trees are ancestor-closed, topological and within budget; the batched
tree forward over the draft cache equals recomputing every path on its own; greedy output equals
transformers' greedy decoding with random and trained drafters; the draft KV rollback equals a
fresh drafter; sampling stays the target's distribution (trees sized by cost:
tests/test_eagle_sizing.py)."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any, TypeVar

import pytest
import torch
from torch import Tensor

from headway.decode.generate import Drafter, generate
from headway.decode.sampling import SamplingParams
from headway.decode.tree import DraftTree, ancestor_mask
from headway.drafters.eagle_drafter import EagleDrafter, select_nodes
from headway.drafters.tree_budget import AUTO_CANDIDATES, auto_total_tokens
from headway.errors import ConfigError
from headway.heads.eagle import EagleConfig, EagleModel, TargetHead, additive_mask
from headway.heads.io import save_heads
from headway.target import fingerprint
from headway.train.losses_eagle import eagle_loss
from tests.drafting import heads_drafter
from tests.test_generate import (
    chi_square,
    every_first_then_greedy,
    exact_two_token_probs,
    hf_greedy,
    sharp_gpt2,
)
from tests.tiny import TINY_FAMILIES, TINY_VOCAB, tiny_model

PROMPT = torch.tensor([1, 5, 17, 33, 8, 40, 41, 9])
NEW_TOKENS = 32
LAST = 2  # the tiny models have 2 layers: output_hidden_states[2] is the LM head's input
CHAIN: dict[str, Any] = {"top_k": 1, "depth": 4, "total_tokens": 5}
TREE: dict[str, Any] = {"top_k": 4, "depth": 4, "total_tokens": 12}


# ------------------------------------------------------------------------------ helpers


def last_features(model: Any, ids: Tensor) -> Tensor:
    """The target's LM-head inputs ``[B, T, H]`` for ``ids`` ``[B, T]``."""
    with torch.no_grad():
        return model(ids, output_hidden_states=True).hidden_states[LAST]


def fit_drafter(model: Any, sequences: Tensor, *, steps: int = 150, seed: int = 0) -> EagleModel:
    """Briefly train a draft model teacher-forced on ``sequences`` ``[B, T]`` (full loss mask)."""
    torch.manual_seed(seed)
    draft = EagleModel(EagleConfig.from_target(model))
    head = TargetHead.of(model)
    features = last_features(model, sequences)
    batch, length = sequences.shape
    next_ids = torch.cat([sequences[:, 1:], sequences[:, :1]], dim=1)  # the last row is unused
    embeddings = head.embed_tokens(next_ids, torch.float32).detach()
    causal = additive_mask(torch.ones(length, length, dtype=torch.bool).tril(), torch.float32)
    optimizer = torch.optim.Adam(draft.parameters(), lr=1e-2)
    for _ in range(steps):
        predicted = draft(
            features,
            embeddings,
            position_ids=torch.arange(length)[None],
            attention_mask=causal[None, None],
        )
        loss = eagle_loss(predicted, features, torch.ones(batch, length), lm_head=head.logits).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return draft.eval()


def random_drafter(model: Any, seed: int = 1, **settings: Any) -> EagleDrafter:
    torch.manual_seed(seed)
    draft = EagleModel(EagleConfig.from_target(model))
    return EagleDrafter(draft, TargetHead.of(model), hidden_layer=LAST, **settings)


@cache
def target_and_truth(family: str) -> tuple[Any, list[int]]:
    model = tiny_model(family)
    return model, hf_greedy(model, PROMPT, NEW_TOKENS, eos=None)


@cache
def trained(family: str) -> EagleModel:
    """A draft model fitted on the target's own greedy continuation of PROMPT."""
    model, truth = target_and_truth(family)
    return fit_drafter(model, torch.cat([PROMPT, torch.tensor(truth)])[None])


FedDrafter = TypeVar("FedDrafter", bound=Drafter)


def fed(drafter: FedDrafter, model: Any, sequence: Tensor) -> FedDrafter:
    """``drafter`` after begin + observe of every pair of ``sequence`` in one go (true features)."""
    drafter.begin(sequence[:1])
    drafter.observe(sequence[1:], (last_features(model, sequence[None])[0, :-1],))
    return drafter


def assert_valid_tree(tree: DraftTree, total_tokens: int, depth: int) -> None:
    """Within budget and depth, topological (DraftTree checks parents[i] < i) and ancestor-closed:
    every node's parent is a node of the tree or the root."""
    assert 0 < tree.size <= total_tokens - 1
    assert int(tree.depths.max()) <= depth
    parents = tree.parents.tolist()
    assert all(-1 <= parent < index for index, parent in enumerate(parents))
    mask = ancestor_mask(tree.parents)
    assert bool(mask[:, 0].all())  # every path reaches the root through kept nodes


# ------------------------------------------------------------------------------ tree selection


def test_select_nodes_breaks_ties_by_creation_order() -> None:
    scores = torch.tensor([0.0, -1.0, 0.0, -0.5, 0.0])
    assert select_nodes(scores, 4).tolist() == [0, 2, 4, 3]


@pytest.mark.parametrize("settings", [CHAIN, TREE, {"top_k": 3, "depth": 6, "total_tokens": 40}])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_trees_are_closed_topological_and_within_budget(family: str, settings: dict) -> None:
    model, truth = target_and_truth(family)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:5])])
    drafter = fed(random_drafter(model, **settings), model, sequence)
    tree = drafter.propose(sequence)
    assert_valid_tree(tree, settings["total_tokens"], settings["depth"])
    with torch.inference_mode():  # closure of the kept set itself, before parents are re-indexed
        _, parents, scores = drafter._expand(drafter._root_feature)  # type: ignore[arg-type]
    kept = set(select_nodes(scores, settings["total_tokens"] - 1).tolist())
    assert all(int(parents[node]) in kept | {-1} for node in kept)
    if settings["top_k"] == 1:
        assert tree.parents.tolist() == [-1, 0, 1, 2]


def test_ties_keep_parents_before_children() -> None:
    """An LM head so sharp that every best child has log-probability exactly 0: the best path's
    nodes all score 0 at every depth. A budget of 2 must keep depths 1 and 2 of that path (an
    unstable tie-break could keep a deeper node without its parent)."""
    model: Any = tiny_model("llama")
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach() * 1e4)
    drafter = random_drafter(model, top_k=3, depth=5, total_tokens=3)
    tree = fed(drafter, model, PROMPT).propose(PROMPT)
    assert tree.parents.tolist() == [-1, 0]
    with torch.inference_mode():
        expanded_tokens, _, scores = drafter._expand(drafter._root_feature)  # type: ignore[arg-type]
    assert int((scores == 0).sum()) == 5  # the tie really happens, once per depth
    assert tree.tokens.tolist() == expanded_tokens[scores == 0][:2].tolist()


def reference_tree(drafter: EagleDrafter, model: Any, sequence: Tensor) -> tuple[DraftTree, Tensor]:
    """EAGLE-2 the slow, obvious way: every node's feature recomputed by running the draft model
    over the committed pairs + the node's path from scratch (no cache, no tree mask). Returns the
    kept tree and the scores ``[n]`` of every expanded node."""
    features = last_features(model, sequence[None])[0, :-1]
    tokens, k = sequence[1:], drafter.top_k

    def predict(path_features: list[Tensor], path_tokens: list[int]) -> Tensor:
        feats = torch.cat([features, *(f[None] for f in path_features)])
        ids = torch.cat([tokens, torch.tensor(path_tokens, dtype=torch.long)])
        length = ids.numel()
        causal = additive_mask(torch.ones(length, length, dtype=torch.bool).tril(), torch.float32)
        with torch.no_grad():
            out = drafter.model(
                feats[None],
                drafter.head.embed_tokens(ids, torch.float32)[None],
                position_ids=torch.arange(length)[None],
                attention_mask=causal[None, None],
            )
        return out[0, -1]

    def children(feature: Tensor) -> tuple[list[int], list[float]]:
        best = torch.log_softmax(drafter.head.logits(feature), -1).topk(k)
        return best.indices.tolist(), best.values.tolist()

    nodes: list[dict[str, Any]] = []  # token, parent, score, input feature
    root = predict([], [])
    for token, logp in zip(*children(root), strict=True):
        nodes.append({"token": token, "parent": -1, "score": logp, "input": root})
    frontier = list(range(k))
    for _ in range(drafter.depth - 1):
        level_start = len(nodes)
        for index in frontier:
            path: list[int] = []
            node = index
            while node >= 0:
                path.insert(0, node)
                node = nodes[node]["parent"]
            out = predict([nodes[i]["input"] for i in path], [nodes[i]["token"] for i in path])
            for token, logp in zip(*children(out), strict=True):
                score = nodes[index]["score"] + logp
                nodes.append({"token": token, "parent": index, "score": score, "input": out})
        level = range(level_start, len(nodes))
        frontier = sorted(level, key=lambda i: (-nodes[i]["score"], i))[:k]
    keep = sorted(
        sorted(range(len(nodes)), key=lambda i: (-nodes[i]["score"], i))[: drafter.total_tokens - 1]
    )
    position = {old: new for new, old in enumerate(keep)}
    parents = [position[nodes[i]["parent"]] if nodes[i]["parent"] >= 0 else -1 for i in keep]
    tree = DraftTree(torch.tensor([nodes[i]["token"] for i in keep]), torch.tensor(parents))
    return tree, torch.tensor([node["score"] for node in nodes])


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_batched_tree_forward_equals_per_path_recompute(family: str) -> None:
    model, truth = target_and_truth(family)
    sequence = torch.cat([PROMPT, torch.tensor(truth[:6])])
    drafter = fed(random_drafter(model, top_k=3, depth=4, total_tokens=20), model, sequence)
    tree = drafter.propose(sequence)
    expected, expected_scores = reference_tree(drafter, model, sequence)
    assert tree.tokens.tolist() == expected.tokens.tolist()
    assert tree.parents.tolist() == expected.parents.tolist()
    with torch.inference_mode():
        _, _, scores = drafter._expand(drafter._root_feature)  # type: ignore[arg-type]
    torch.testing.assert_close(scores, expected_scores, rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------ decoding


@pytest.mark.parametrize("mode", ["chain", "tree"])
@pytest.mark.parametrize("kind", ["random", "trained"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_greedy_output_equals_transformers(family: str, kind: str, mode: str) -> None:
    model, truth = target_and_truth(family)
    settings = CHAIN if mode == "chain" else TREE
    if kind == "random":
        drafter = random_drafter(model, **settings)
    else:
        drafter = EagleDrafter(trained(family), TargetHead.of(model), hidden_layer=LAST, **settings)
    result = generate(model, PROMPT, drafter=drafter, max_new_tokens=NEW_TOKENS, eos_token_ids=())
    assert result.tokens == truth
    if kind == "trained":  # drafts line up with what training taught: most steps accept a lot
        assert result.tau > 2.5, result.accept_lengths


class Recorder:
    """Wraps a drafter and keeps every (sequence, proposed tree)."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.hidden_layers = inner.hidden_layers
        self.max_nodes = inner.max_nodes
        self.proposals: list[tuple[Tensor, DraftTree]] = []

    def begin(self, prompt_ids: Tensor) -> None:
        self.inner.begin(prompt_ids)

    def couple(self, coupling: Any) -> None:
        """Hand a sampled sequence's noise on (coupled drafting), where the drafter takes it."""
        couple = getattr(self.inner, "couple", None)
        if couple is not None:
            couple(coupling)

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self.inner.observe(new_tokens, hidden)

    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        tree = self.inner.propose(sequence, floor)
        self.proposals.append((sequence.clone(), tree))
        return tree


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_kv_rollback_gives_the_drafts_of_a_fresh_drafter(family: str) -> None:
    model, _ = target_and_truth(family)
    recorder = Recorder(
        EagleDrafter(trained(family), TargetHead.of(model), hidden_layer=LAST, **TREE)
    )
    generate(model, PROMPT, drafter=recorder, max_new_tokens=20, eos_token_ids=())
    assert len(recorder.proposals) > 3
    fresh = EagleDrafter(trained(family), TargetHead.of(model), hidden_layer=LAST, **TREE)
    for sequence, tree in recorder.proposals:
        again = fed(fresh, model, sequence).propose(sequence)
        assert again.tokens.tolist() == tree.tokens.tolist()
        assert again.parents.tolist() == tree.parents.tolist()


def test_propose_before_observe_is_empty_and_begin_resets() -> None:
    model, truth = target_and_truth("qwen2")
    drafter = random_drafter(model, **TREE)
    assert drafter.propose(PROMPT).size == 0
    sequence = torch.cat([PROMPT, torch.tensor(truth[:3])])
    first = fed(drafter, model, sequence).propose(sequence)
    # committed pairs + one tree's frontier entries (depth - 1 forwards of top_k nodes) ...
    grown = sequence.numel() - 1 + (TREE["depth"] - 1) * TREE["top_k"]
    assert drafter._cache.get_seq_length() == grown
    again = drafter.propose(sequence)  # ... and proposing again first drops the old tree
    assert drafter._cache.get_seq_length() == grown
    assert again.tokens.tolist() == first.tokens.tolist()
    drafter.begin(PROMPT)
    assert drafter.propose(PROMPT).size == 0
    assert fed(drafter, model, sequence).propose(sequence).tokens.tolist() == first.tokens.tolist()


def test_tree_auto_times_the_target_and_weighs_the_assumed_gain() -> None:
    model, _ = target_and_truth("llama")
    flat = {size: 0.010 for size in AUTO_CANDIDATES}  # verify costs the same at every size
    assert auto_total_tokens(model, seconds=flat.__getitem__) == AUTO_CANDIDATES[-1]
    linear = {size: 0.001 * size for size in AUTO_CANDIDATES}  # cost grows faster than gain
    assert auto_total_tokens(model, seconds=linear.__getitem__) == AUTO_CANDIDATES[0]
    knee = {size: 0.010 if size <= 12 else 0.030 for size in AUTO_CANDIDATES}
    assert auto_total_tokens(model, seconds=knee.__getitem__) == 12
    measured = auto_total_tokens(model, prefix_tokens=8)  # real timing of the tiny target
    assert measured in AUTO_CANDIDATES


def save_run(directory: Path, target: Any, draft: EagleModel) -> Path:
    """An EAGLE-1 run directory of ``draft`` for ``target``."""
    return save_heads(
        directory,
        method="eagle1",
        head_config=draft.config.to_dict(),
        state_dict=draft.state_dict(),
        target_fingerprint=fingerprint(target),
        target_name="org/tiny-llama",
    )


def test_spec_options_and_the_auto_tree(tmp_path: Path) -> None:
    model, _ = target_and_truth("llama")
    run = save_run(tmp_path / "eagle", model, EagleModel(EagleConfig.from_target(model)))
    auto = heads_drafter(run, model, total_tokens="auto")
    assert isinstance(auto, EagleDrafter) and auto.total_tokens in AUTO_CANDIDATES
    sized = heads_drafter(run, model, top_k=2, depth=3)
    assert isinstance(sized, EagleDrafter) and (sized.top_k, sized.depth) == (2, 3)
    with pytest.raises(ConfigError, match=r"tree names Medusa trees.*total_tokens=auto"):
        heads_drafter(run, model, tree="auto")
    with pytest.raises(ConfigError, match="total_tokens=1 must be >= 2"):
        heads_drafter(run, model, total_tokens=1)
    with pytest.raises(ConfigError, match="did you mean 'top_k'"):
        heads_drafter(run, model, topk=2)
    with pytest.raises(ConfigError, match=r"decoding option.*--sizing cost"):
        heads_drafter(run, model, sizing="cost")


# ------------------------------------------------------------------------------ sampling

SAMPLES = 1500


def test_sampling_follows_the_target_distribution() -> None:
    """The first two sampled tokens follow the exact two-token distribution of the target, with a
    drafter trained on (PROMPT, t1, greedy t2) for every first token t1, so drafts are accepted."""
    model = sharp_gpt2()
    params = SamplingParams(temperature=1.0)
    first, second = exact_two_token_probs(model, params)
    extended = every_first_then_greedy(second)
    draft = fit_drafter(model, extended, steps=120)
    drafter = Recorder(
        EagleDrafter(
            draft, TargetHead.of(model), hidden_layer=LAST, top_k=3, depth=2, total_tokens=7
        )
    )
    generator = torch.Generator().manual_seed(5)
    counts = torch.zeros(TINY_VOCAB * TINY_VOCAB)
    accepted = 0
    for _ in range(SAMPLES):
        result = generate(
            model,
            PROMPT,
            drafter=drafter,
            max_new_tokens=2,
            sampling=params,
            eos_token_ids=(),
            generator=generator,
        )
        counts[result.tokens[0] * TINY_VOCAB + result.tokens[1]] += 1
        tree = drafter.proposals[-1][1]
        # A rejected candidate has zero residual mass, so t2 is a depth-1 node only if accepted.
        accepted += result.tokens[1] in tree.tokens[tree.parents == -1].tolist()
    exact = (first[:, None] * second).flatten()
    assert not bool(counts[exact == 0].any())
    statistic, bound = chi_square(counts, exact)
    assert statistic < bound, (statistic, bound)
    assert accepted > SAMPLES / 3  # the drafts decided the second token often enough to matter


# ------------------------------------------------------------------------------ per-step sizing
