"""The EAGLE drafter: an EAGLE-1 draft model proposing EAGLE-2 dynamic draft trees (EAGLE-3
drafters reuse it through three hooks, :mod:`headway.drafters.eagle3_drafter`).

Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty"
(arXiv:2401.15077) for the draft model; Li et al. 2024, "EAGLE-2: Faster Inference of Language
Models with Dynamic Draft Trees" (arXiv:2406.16858, §4) for the tree.

**Draft KV cache.** The drafter keeps the draft layer's ``DynamicCache`` across steps. It holds
one entry per *committed* pair (``f_t``, ``x_{t+1}``), where ``f_t`` is the TRUE target feature:
:meth:`EagleDrafter.observe` receives ``hidden[0][i]``, the target state whose LM head produced
``new_tokens[i]``, so (``hidden[0][i]``, ``new_tokens[i]``) is exactly such a pair. Each observe
first crops the cache back to the committed pairs (dropping the tree entries of the last propose)
and then feeds the new pairs in one causal forward. Its last output is f̂ at the root's position,
the start of the next tree.

**EAGLE-2 tree** (:meth:`EagleDrafter.propose`). Level 1 is the top-k of ``lm_head(f̂_root)``.
Then, ``depth - 1`` times: run the draft layer on the *frontier* (the best ``top_k`` nodes of the
last level) in ONE batched forward over the draft cache, each frontier node seeing the committed
pairs, its ancestors and itself (a 4-D tree mask; a node at depth d reads its parent's predicted
feature and its own token, at position ``committed + d - 1``); give every frontier node its top-k
children; score every node by its cumulative draft log-probability (the sum along its path); keep
the best ``top_k`` children as the next frontier. Finally keep the global best ``total_tokens - 1``
nodes of all expanded ones (the reference's ``total_tokens`` counts the root).

That selection is ancestor-closed: a child's score is its parent's plus a log-probability ``<= 0``
(so never larger), and ties are broken by creation order (a stable sort over nodes listed parents
first), so every kept node's parent ranks before it and is kept too. Sorting the kept indices
restores creation order, which is topological. Chain drafting is ``top_k=1``.

Depth convention: ``depth`` is the deepest tree level (number of drafted tokens on the longest
path). The reference's ``depth=d`` runs d draft forwards after level 1, i.e. our ``depth=d+1``.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import ExitStack
from typing import Any, Protocol, cast

import torch
from torch import Tensor, nn
from transformers import DynamicCache

from headway.decode.gemm import gemm_route, routed_linears
from headway.decode.keyed_noise import Coupling
from headway.decode.kv import crop_cache
from headway.decode.tree import DraftTree, empty_tree, subtree
from headway.drafters.coupled import coupled_children
from headway.drafters.specs import EagleSpec
from headway.heads.eagle import EagleConfig, EagleModel, TargetHead, additive_mask

__all__ = [
    "DEFAULT_DEPTH",
    "DEFAULT_TOP_K",
    "DEFAULT_TOTAL_TOKENS",
    "EagleDrafter",
    "FeatureDraftModel",
    "eagle_model",
    "select_nodes",
]

logger = logging.getLogger(__name__)

DEFAULT_TOP_K: int = EagleSpec.top_k
DEFAULT_DEPTH: int = EagleSpec.depth
DEFAULT_TOTAL_TOKENS: int = cast(int, EagleSpec.total_tokens)
"""The defaults :class:`~headway.drafters.specs.EagleSpec` states (the one place they live),
sized for a CPU (verify cost grows beyond about ten nodes, and each level costs one ``[V, H]``
LM-head pass) and the weak drafters tiny data gives (DESIGN.md). The EAGLE-2
reference uses top_k 10, total_tokens 60 and 6-8 levels on GPUs; re-tune for strong drafters."""


def select_nodes(scores: Tensor, count: int) -> Tensor:
    """Indices of the ``count`` best ``scores`` ``[n]``; ties go to the lower index (stable)."""
    return torch.sort(scores, descending=True, stable=True).indices[:count]


class FeatureDraftModel(Protocol):
    """What :class:`EagleDrafter` needs of a draft model: one draft step over T pairs with the
    interface of :meth:`EagleModel.forward` (EAGLE-1) and
    :meth:`~headway.heads.eagle3.Eagle3Model.forward` (EAGLE-3), returning the states that are
    fed back as the next pairs' features."""

    config: Any
    fc: nn.Linear

    def new_cache(self) -> DynamicCache: ...

    def eval(self) -> Any: ...

    def __call__(
        self,
        features: Tensor,
        token_embeddings: Tensor,
        *,
        position_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        cache: DynamicCache | None = None,
    ) -> Tensor: ...


class EagleDrafter:
    """An EAGLE draft model as a :class:`~headway.decode.generate.Drafter` with EAGLE-2 trees.

    EAGLE-1 as it stands; EAGLE-3 (:class:`~headway.drafters.eagle3_drafter.Eagle3Drafter`) reuses
    all of it and overrides three small hooks: :meth:`pair_features` (what the committed pairs
    read from the target's hidden states), :meth:`candidate_logits` (the draft head and its
    candidates' target ids, which :meth:`top_children` ranks) and :meth:`_vocabulary_size`.

    Args:
        model: the trained draft model (:class:`~headway.heads.eagle.EagleModel` for EAGLE-1), on
            the target's device and dtype.
        head: the target's frozen embedding and LM head (:meth:`TargetHead.of`).
        hidden_layer: index (or indices) into the target's ``output_hidden_states`` the pairs
            read: the LM head's input for EAGLE-1.
        top_k: children per expanded node and frontier width (1 = chain drafting).
        depth: deepest tree level (tokens on the longest drafted path).
        total_tokens: N, the tree budget counting the root: at most N - 1 drafted nodes.
        vocab: EAGLE-1 drafting over these target ids only (int64 ``[N]``, sorted; FR-Spec),
            ``head``'s LM head then holding only their rows (``[N, H]``,
            :func:`~headway.drafters.draft_vocab.narrow_head`); ``None``: every token.

    When the decoding loop sizes trees by cost (``propose`` gets a ``floor``), every node is
    scored by its cumulative draft probability and the loop sends the best that pay for their
    share of the verify forward; the tree also stops growing once no frontier node reaches the
    floor, which saves draft forwards on unsure steps. On a CPU the drafter times its levels
    (:attr:`level_seconds`) so that the loop can price one more level into that floor. A
    sampled sequence is drafted with the target's noise (:meth:`couple`,
    :mod:`headway.drafters.coupled`).
    """

    couples = True  # whether it drafts a sampled sequence with its noise (couple)

    def __init__(
        self,
        model: FeatureDraftModel,
        head: TargetHead,
        *,
        hidden_layer: int | tuple[int, ...],
        top_k: int = DEFAULT_TOP_K,
        depth: int = DEFAULT_DEPTH,
        total_tokens: int = DEFAULT_TOTAL_TOKENS,
        vocab: Tensor | None = None,
    ) -> None:
        if top_k < 1 or depth < 1 or total_tokens < 2:
            raise ValueError(
                f"need top_k >= 1, depth >= 1 and total_tokens >= 2 (the root and one node), got "
                f"top_k={top_k}, depth={depth}, total_tokens={total_tokens}"
            )
        self.model = model.eval()
        self.head = head
        self._vocab = None if vocab is None else vocab.to(model.fc.weight.device)
        layers = (hidden_layer,) if isinstance(hidden_layer, int) else tuple(hidden_layer)
        self.hidden_layers: tuple[int, ...] = layers
        self.top_k = min(top_k, self._vocabulary_size())
        self.depth, self.total_tokens = depth, total_tokens
        self.max_nodes = total_tokens - 1
        # The draft model and the LM head multiply their few-row inputs on the routes applied
        # to them (apply_gemm), each decided now on its own layers: a small fc may not gain
        # where the LM head does.
        gemm_route(cast(nn.Module, model))
        gemm_route(head.lm_head)
        weight = model.fc.weight
        self._device, self._dtype = weight.device, weight.dtype
        self.level_seconds = 0.0
        self.coupling: Coupling | None = None  # sampled: the sequence's noise (couple)
        self._position = 0  # the sequence position of the last tree's first level
        """Seconds one tree level's draft forward takes (a running mean, measured on a CPU when
        the tree is cost-sized; 0 until then and on a GPU, where timing would need a sync)."""
        self.begin(torch.empty(0, dtype=torch.long))

    def _vocabulary_size(self) -> int:
        """How many tokens the draft head chooses from (the target's whole vocabulary, or the
        narrowed one)."""
        return int(self.model.config.vocab_size if self._vocab is None else self._vocab.numel())

    def pair_features(self, hidden: tuple[Tensor, ...]) -> Tensor:
        """Features ``[k, H]`` of newly committed pairs from the target states ``hidden``
        (one ``[k, H_t]`` per layer of :attr:`hidden_layers`): EAGLE-1 reads the last one as is."""
        return hidden[0].to(self._device, self._dtype)

    def top_children(self, states: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` best next tokens after each of ``states`` ``[n, H]``: (fp32 draft
        log-probabilities, target token ids), each ``[n, k]``, best first."""
        logits, ids = self.candidate_logits(states)
        best = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
        return best.values, ids[best.indices]

    def candidate_logits(self, states: Tensor) -> tuple[Tensor, Tensor]:
        """The draft head's logits ``[n, N]`` after ``states`` ``[n, H]`` and the target ids
        ``[N]`` of its N candidates (:meth:`top_children` ranks them; coupled drafting adds
        the target's noise first)."""
        logits = self.head.logits(states)
        ids = torch.arange(logits.shape[-1], device=logits.device)
        return logits, ids if self._vocab is None else self._vocab

    def couple(self, coupling: Coupling | None) -> None:
        """Draft the coming sequence with its sampling noise (:mod:`headway.drafters.coupled`),
        or, with ``None``, by the draft's top-k alone (greedy decoding); a drafter whose
        :attr:`couples` is False always drafts by the top-k."""
        self.coupling = coupling if self.couples else None

    def _children(self, states: Tensor, k: int, level: int) -> tuple[Tensor, Tensor]:
        """:meth:`top_children` of nodes whose children sit at tree ``level`` (1: the root's);
        coupled, ranked with the target's noise at that position."""
        if self.coupling is None:
            return self.top_children(states, k)
        logits, ids = self.candidate_logits(states)
        key = self._noise_key(level)
        return coupled_children(logits, ids, k, key, self.coupling.temperature)

    def _noise_key(self, level: int) -> Tensor:
        """The noise key of tree ``level``'s position (the root's children at level 1)."""
        assert self.coupling is not None
        return self.coupling.key(self._position + level - 1, self._device)

    def begin(self, prompt_ids: Tensor) -> None:
        """Forget the previous sequence: empty draft cache, no root feature, no coupling (the
        loop couples a sampled sequence after this)."""
        self._cache = self.model.new_cache()
        self.coupling = None
        self._committed = 0  # pairs (f_t, x_{t+1}) in the cache
        self._root_feature: Tensor | None = None  # [H], f̂ at the root's position

    def routed(self) -> ExitStack:
        """The draft model's and the LM head's linear layers on small-block products
        (:func:`~headway.decode.gemm.routed_linears`; draft forwards have a few rows)."""
        stack = ExitStack()
        model = cast(nn.Module, self.model)
        stack.enter_context(routed_linears(model, pad_single=True))
        stack.enter_context(routed_linears(self.head.lm_head, pad_single=True))
        return stack

    @torch.inference_mode()
    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Roll the draft cache back to the committed pairs, then feed the new pairs
        (``hidden[0][i]`` ``[H]``, ``new_tokens[i]``) with their true target features."""
        with self.routed():
            self._observe(new_tokens, hidden)

    def _observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        crop_cache(self._cache, self._committed)
        count = new_tokens.numel()
        features = self.pair_features(hidden)[None]  # [1, k, H]
        embeddings = self.head.embed_tokens(new_tokens.to(self._device), self._dtype)[None]
        # plain causal attention over the committed pairs, positions committed .. committed + k - 1
        predicted = self.model(features, embeddings, cache=self._cache)
        self._committed += count
        self._root_feature = predicted[0, -1]

    def _forward_frontier(
        self, features: Tensor, tokens: Tensor, ancestors: Tensor, level: int
    ) -> Tensor:
        """One batched draft forward of the frontier.

        Args:
            features: ``[F, H]``, each frontier node's parent's predicted feature.
            tokens: ``[F]``, the frontier nodes' tokens.
            ancestors: bool ``[F, S]``, which of the S tree entries already in the cache are
                ancestors of each node.
            level: the frontier's pair position past the committed pairs (0 for the root's
                children): a constant of the tree's shape, so a compiled step (static
                drafting) reads no per-step Python number.

        Returns:
            ``[F, H]``, each node's predicted feature (the cache grows by F entries).
        """
        count = tokens.numel()
        visible = torch.cat(
            [
                torch.ones(count, self._committed, dtype=torch.bool, device=self._device),
                ancestors,
                torch.eye(count, dtype=torch.bool, device=self._device),
            ],
            dim=1,
        )
        predicted = self.model(
            features[None],
            self.head.embed_tokens(tokens, self._dtype)[None],
            position_ids=torch.full((1, count), self._committed + level, device=self._device),
            attention_mask=additive_mask(visible, self._dtype)[None, None],
            cache=self._cache,
        )
        return predicted[0]

    def _expand(
        self, root_feature: Tensor, floor: float | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Grow the EAGLE-2 candidate tree; returns tokens, parents and cumulative scores of
        every expanded node ``[n]``, parents listed before their children. Starts by dropping the
        previous tree's entries from the draft cache; with a ``floor`` (cost-sized) on a CPU,
        times each level and stops early once no frontier node's score reaches the floor."""
        self._drop_tree()
        k = self.top_k
        root_scores, root_tokens = self._children(root_feature[None], k, 1)
        tokens, scores = [root_tokens[0]], [root_scores[0]]
        parents = [torch.full((k,), -1, dtype=torch.long, device=self._device)]
        expanded = k  # nodes so far; the next level's first node index
        frontier = torch.arange(k, device=self._device)  # node index of each frontier node
        frontier_tokens, frontier_scores = root_tokens[0], root_scores[0]
        features = root_feature.expand(k, -1)
        ancestors = torch.zeros(k, 0, dtype=torch.bool, device=self._device)
        # A fixed-size tree always grows to `depth`; a cost-sized one stops once no frontier node
        # could pay for itself. The check reads a score on the host, so it runs on a CPU only: on
        # a GPU a sync per level costs more than the small forwards it saves, and the loop's
        # sizer still trims what does not pay (the one sync of a step). Either way the output
        # is the target's: sizing only decides how much is drafted.
        timed = floor is not None and self._device.type == "cpu"
        limit = floor if timed and floor is not None else -math.inf
        for level in range(1, self.depth):
            if limit > -math.inf and float(frontier_scores.max()) < limit:
                break  # no descendant can pay
            started = time.perf_counter() if timed else 0.0  # no clock read to trace when compiled
            predicted = self._forward_frontier(features, frontier_tokens, ancestors, level - 1)
            child_logp, child_tokens = self._children(predicted, k, level + 1)  # [F, k] each
            if timed:  # on a CPU the work is done when the call returns
                self._time_level(time.perf_counter() - started)
            child_scores = (frontier_scores[:, None] + child_logp).flatten()
            tokens.append(child_tokens.flatten())
            scores.append(child_scores)
            parents.append(frontier[:, None].expand(-1, k).reshape(-1))  # no host read
            pick = select_nodes(child_scores, k)
            parent_row = pick // k
            frontier = expanded + pick
            expanded += child_scores.numel()
            frontier_tokens, frontier_scores = tokens[-1][pick], child_scores[pick]
            features = predicted[parent_row]
            just_forwarded = torch.eye(parent_row.numel(), dtype=torch.bool, device=self._device)
            ancestors = torch.cat([ancestors[parent_row], just_forwarded[parent_row]], dim=1)
        return torch.cat(tokens), torch.cat(parents), torch.cat(scores)

    def _drop_tree(self) -> None:
        """Forget the last tree's entries in the draft cache (keep the committed pairs)."""
        crop_cache(self._cache, self._committed)

    def _time_level(self, seconds: float) -> None:
        """Fold one level's measured seconds into :attr:`level_seconds` (mean of the last ~10)."""
        previous = self.level_seconds
        self.level_seconds = seconds if previous == 0.0 else 0.9 * previous + 0.1 * seconds

    @torch.inference_mode()
    def propose(self, sequence: Tensor, floor: float | None = None) -> DraftTree:
        """The best ``total_tokens - 1`` nodes of an EAGLE-2 tree below the root (the last id
        of ``sequence``, whose pair is already in the draft cache); empty before any observe.
        With a ``floor`` (the loop sizes the tree), each node scored by its cumulative draft
        probability."""
        if self._root_feature is None:
            return empty_tree()
        self._position = sequence.numel()  # where the root's children sit
        with self.routed():
            tokens, parents, scores = self._expand(self._root_feature, floor)
        best = select_nodes(scores, self.total_tokens - 1)
        tree = subtree(tokens.cpu(), parents.cpu(), best.cpu())
        if floor is None:
            return tree
        kept_scores = scores[best.sort().values].exp().float().cpu()  # in node order
        return DraftTree(tree.tokens, tree.parents, scores=kept_scores)


def eagle_model(
    config: EagleConfig, state_dict: dict[str, Tensor], target_model: Any
) -> EagleModel:
    """An :class:`~headway.heads.eagle.EagleModel` of trained weights on ``target_model``'s
    device and dtype.

    Raises:
        ValueError: the target's LM head or embedding does not have the drafter's sizes.
    """
    embed = target_model.get_input_embeddings().weight
    lm_head = target_model.get_output_embeddings().weight
    expected = (config.vocab_size, config.hidden_size)
    if tuple(lm_head.shape) != expected or embed.shape[1] != config.hidden_size:
        raise ValueError(
            f"an EAGLE drafter of hidden size {config.hidden_size} and vocabulary "
            f"{config.vocab_size} cannot run on a target whose LM head is {list(lm_head.shape)} "
            f"and embedding {list(embed.shape)}, not even with force"
        )
    model = EagleModel(config)
    model.load_state_dict(state_dict)
    return model.to(device=lm_head.device, dtype=lm_head.dtype)
