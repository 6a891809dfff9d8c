"""The drafter the quickstart evaluates: prompt lookup merged with confidence-gated Medusa heads.

- The heads are read back from the *exported* folder (:func:`headway.heads.export.import_medusa`),
  so the evaluation also proves that the export loads.
- :class:`ConfidentMedusaDrafter` drafts the heads' top-1 chain only while its probability stays
  above a threshold calibrated on held-out data (:mod:`headway.eval.calibrate`), over a draft
  vocabulary of the training data's most frequent tokens (a cheaper ``[V', H]`` projection).
- :class:`MergedDrafter` proposes the union of several drafters' trees, merged as a prefix tree
  (:func:`headway.decode.drafters.trie_tree`) within a node budget, the first drafter's paths
  first, and counts which drafter proposed each accepted token.

Drafts never affect what is committed (the float32 target verifies every token), so none of this
touches exactness; it only decides how much verification work is spent, and on what.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor

from headway.decode.drafters import PromptLookupDrafter, trie_tree
from headway.decode.generate import Drafter
from headway.decode.tree import DraftTree, chain, empty_tree, root_to_leaf_paths
from headway.errors import HeadwayError
from headway.eval.calibrate import (
    GateCalibration,
    choose_threshold,
    head1_scores,
    verify_break_even,
)
from headway.heads.drafter_medusa import check_final_hidden, final_hidden_layer
from headway.heads.export import import_medusa
from headway.heads.medusa import MedusaHead, MedusaHeads
from headway.target import Target, resolve_dtype
from headway.train.regenerate import read_jsonl

__all__ = [
    "ConfidentMedusaDrafter",
    "MergedDrafter",
    "build_quickstart_drafter",
    "draft_vocabulary",
    "tree_paths",
]


def tree_paths(tree: DraftTree) -> list[list[int]]:
    """The token sequences of every root-to-leaf path of ``tree`` (none for an empty tree)."""
    if tree.size == 0:
        return []
    tokens = tree.tokens.tolist()
    return [[tokens[block - 1] for block in path[1:]] for path in root_to_leaf_paths(tree.parents)]


class ConfidentMedusaDrafter:
    """Medusa heads drafting only what they are sure of: a chain of each head's top-1 token, cut
    where the product of the heads' probabilities falls below ``threshold`` (often empty).

    Why: on a CPU, verifying even one drafted token costs ~1.6x a plain forward (small-M matrix
    products), so a draft pays only when it is likely accepted; an empty draft costs nothing
    beyond the heads. The same reasoning as EAGLE-2's confidence-scored trees (Li et al. 2024),
    applied to a chain. ``vocab`` optionally restricts the heads' output to the given token ids
    (e.g. the most frequent tokens of the training data, as EAGLE-3 / FR-Spec do), which makes
    the heads' ``[V, H]`` projection that much cheaper; probabilities are then normalised over
    that vocabulary.

    Args:
        heads: trained :class:`~headway.heads.medusa.MedusaHeads` (any dtype, target's device).
        hidden_layer: index of the LM head's input in ``output_hidden_states``.
        threshold: minimum cumulative probability of a drafted token.
        max_depth: heads used at most (chain length).
        vocab: optional LongTensor ``[V']`` of target token ids the heads may propose.
    """

    def __init__(
        self,
        heads: MedusaHeads,
        *,
        hidden_layer: int,
        threshold: float,
        max_depth: int,
        vocab: Tensor | None = None,
    ) -> None:
        if not 0 < threshold <= 1 or not 1 <= max_depth <= heads.config.num_heads:
            raise ValueError(
                f"need 0 < threshold <= 1 and 1 <= max_depth <= {heads.config.num_heads}, got "
                f"{threshold} and {max_depth}"
            )
        self.hidden_layers: tuple[int, ...] = (hidden_layer,)
        self.threshold, self.vocab = threshold, vocab
        used = [cast(MedusaHead, head) for head in list(heads.heads)[:max_depth]]
        self.blocks = [head.blocks for head in used]
        weights = [head.lm_head.weight for head in used]
        self.weights = [w if vocab is None else w[vocab.to(w.device)].contiguous() for w in weights]
        self._last_hidden: Tensor | None = None

    def begin(self, prompt_ids: Tensor) -> None:
        self._last_hidden = None

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        """Keep the state that predicted the next root, as
        :class:`~headway.heads.drafter_medusa.MedusaDrafter` does."""
        self._last_hidden = hidden[0][-1]

    @torch.inference_mode()
    def propose(self, sequence: Tensor) -> DraftTree:
        """Top-1 tokens of heads 1, 2, ... while their cumulative probability >= threshold."""
        if self._last_hidden is None:
            return empty_tree()
        hidden = self._last_hidden.to(self.weights[0].dtype)
        tokens: list[int] = []
        confidence = 1.0
        for blocks, weight in zip(self.blocks, self.weights, strict=True):
            z = hidden
            for block in blocks:
                z = block(z)
            probs = torch.softmax(F.linear(z, weight).float(), dim=-1)
            best = int(probs.argmax())
            confidence *= float(probs[best])
            if confidence < self.threshold:
                break
            tokens.append(best if self.vocab is None else int(self.vocab[best]))
        return chain(tokens)


class MergedDrafter:
    """Several drafters as one: each proposes, and their trees are merged into one prefix tree of
    at most ``max_nodes`` nodes, earlier drafters' paths first. Each drafter observes exactly the
    hidden states it asked for. ``accepted_by_source[i]`` counts the accepted drafted tokens that
    drafter i proposed (credited to the first drafter whose path holds them).

    Args:
        drafters: the drafters, in priority order.
        max_nodes: node budget of the merged tree.
    """

    def __init__(self, drafters: Sequence[Drafter], *, max_nodes: int) -> None:
        if not drafters or max_nodes < 1:
            raise ValueError("MergedDrafter needs at least one drafter and max_nodes >= 1")
        self.drafters = list(drafters)
        self.max_nodes = max_nodes
        self.hidden_layers: tuple[int, ...] = tuple(
            sorted({layer for drafter in drafters for layer in drafter.hidden_layers})
        )
        self.accepted_by_source = [0] * len(self.drafters)
        self._proposed: list[list[list[int]]] | None = None

    def begin(self, prompt_ids: Tensor) -> None:
        for drafter in self.drafters:
            drafter.begin(prompt_ids)

    def observe(self, new_tokens: Tensor, hidden: tuple[Tensor, ...]) -> None:
        self._credit(new_tokens.tolist()[:-1])
        for drafter in self.drafters:
            own = tuple(hidden[self.hidden_layers.index(layer)] for layer in drafter.hidden_layers)
            drafter.observe(new_tokens, own)

    def propose(self, sequence: Tensor) -> DraftTree:
        self._proposed = [tree_paths(drafter.propose(sequence)) for drafter in self.drafters]
        return trie_tree([path for paths in self._proposed for path in paths], self.max_nodes)

    def _credit(self, accepted: list[int]) -> None:
        """Credit the accepted drafted tokens of the last step to the first drafter that proposed
        them (nothing after the prefill, which follows no proposal)."""
        proposed, self._proposed = self._proposed, None
        if proposed is None or not accepted:
            return
        for index, paths in enumerate(proposed):
            if any(path[: len(accepted)] == accepted for path in paths):
                self.accepted_by_source[index] += len(accepted)
                return


def _heads_from_export(export_dir: Path, target: Target, dtype: str) -> MedusaHeads:
    """Medusa heads read back from an exported folder, in ``dtype``, on the target's device."""
    imported = import_medusa(export_dir)
    heads = MedusaHeads(imported.config)
    heads.load_state_dict(imported.state_dict)
    device = target.model.get_output_embeddings().weight.device
    return heads.to(device=device, dtype=resolve_dtype(dtype)).eval()


def _gate(
    heads: MedusaHeads,
    target: Target,
    plan: Any,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]],
    vocab: Tensor | None,
) -> GateCalibration:
    """The plan's fixed confidence, or one calibrated on held-out ``samples`` (see
    :mod:`headway.eval.calibrate`)."""
    if plan.confidence is not None:
        return GateCalibration(plan.confidence, 0.0, 0, 0.0, 0.0)
    if not samples:
        raise HeadwayError("calibrating the confidence gate needs held-out samples")
    prefix = torch.as_tensor(list(samples[0][0])[:256], device=target.model.device)
    break_even = verify_break_even(target.model, prefix)
    head = cast(MedusaHead, heads.heads[0])
    confidence, correct = head1_scores(target.model, head, samples, vocab=vocab)
    return choose_threshold(confidence, correct, break_even=break_even)


def build_quickstart_drafter(
    export_dir: Path,
    target: Target,
    plan: Any,
    data_dir: Path,
    samples: Sequence[tuple[Sequence[int], Sequence[int]]] = (),
) -> tuple[Drafter, dict[str, Any]]:
    """The quickstart's drafter (module docstring) and its description for the report.

    Args:
        export_dir: the exported heads (``medusa`` or ``medusa-vllm`` layout).
        plan: a :class:`~headway.eval.quickstart_plan.QuickstartPlan`.
        data_dir: the regenerated training data, for the draft vocabulary.
        samples: held-out ``(input_ids, loss_mask)`` pairs to calibrate the confidence gate
            (when ``plan.confidence`` is None).
    """
    heads = _heads_from_export(export_dir, target, plan.draft_dtype)
    layer = final_hidden_layer(target.model)
    check_final_hidden(target.model, layer)
    vocab = None
    if plan.draft_vocab_size:
        vocab = draft_vocabulary(data_dir, target.tokenizer, plan.draft_vocab_size)
    gate = _gate(heads, target, plan, samples, vocab)
    info: dict[str, Any] = {
        "name": f"medusa-{heads.config.num_heads}",
        "export": str(export_dir),
        "heads": heads.config.to_dict(),
        "draft_dtype": plan.draft_dtype,
        "draft_vocab_size": None if vocab is None else int(vocab.numel()),
        "gate": asdict(gate),
    }
    drafters: list[Drafter] = []
    if plan.prompt_lookup:
        drafters.append(
            PromptLookupDrafter(
                min_ngram=plan.lookup_min_ngram,
                max_ngram=plan.lookup_max_ngram,
                num_draft_tokens=plan.lookup_tokens,
                max_nodes=plan.lookup_tokens,
            )
        )
        info["prompt_lookup"] = {
            "min_ngram": plan.lookup_min_ngram,
            "max_ngram": plan.lookup_max_ngram,
            "num_draft_tokens": plan.lookup_tokens,
        }
    if gate.threshold is not None or not drafters:
        medusa = ConfidentMedusaDrafter(
            heads,
            hidden_layer=layer,
            threshold=gate.threshold if gate.threshold is not None else 1.0,
            max_depth=heads.config.num_heads,
            vocab=vocab,
        )
        drafters.append(medusa)
    info["name"] = _drafter_name(heads, gate, plan.prompt_lookup)
    budget = plan.lookup_tokens + heads.config.num_heads
    return MergedDrafter(drafters, max_nodes=budget), info


def _drafter_name(heads: MedusaHeads, gate: GateCalibration, prompt_lookup: bool) -> str:
    medusa = f"medusa-{heads.config.num_heads}"
    if gate.threshold is None:
        medusa += " (gated off: below break-even)"
    else:
        medusa += f" (confidence >= {gate.threshold:.2g})"
    return f"prompt lookup + {medusa}" if prompt_lookup else medusa


def draft_vocabulary(data_dir: Path, tokenizer: Any, size: int) -> Tensor:
    """The ``size`` most frequent token ids of the assistant answers in regenerated data
    (``data_dir/*.jsonl`` with ``messages`` rows), sorted, as a LongTensor."""
    counts: Counter[int] = Counter()
    for path in sorted(data_dir.glob("*.jsonl")):
        for row in read_jsonl(path):
            answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            for answer in answers:
                counts.update(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if not counts:
        raise HeadwayError(f"{data_dir} holds no assistant answers to build a draft vocabulary")
    return torch.tensor(sorted(token for token, _ in counts.most_common(size)), dtype=torch.long)
