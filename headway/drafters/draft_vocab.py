"""Draft vocabularies of a drafter's most frequent answer tokens (FR-Spec).

A drafter's LM head scores every token it may propose: a ``[V, H]`` projection per drafted row,
the largest share of a small draft model's work on a CPU. Zhao et al. 2025, "FR-Spec:
Accelerating Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling"
(arXiv:2502.14856), draft over the most frequent tokens only; SGLang loads such a list as
``--speculative-token-map``. Drafts never change what is committed (the target verifies every
token): a narrower head only trades acceptance for cheaper drafting.

- :func:`frequent_answer_tokens` ranks the tokens of the assistant answers in a chat-data folder;
  :func:`write_draft_vocabulary` stores the ranking as ``{"token_ids": [...]}`` (most frequent
  first) and :func:`draft_vocabulary` reads either back, cut to a size.
- :func:`narrow_eagle3` keeps, of an EAGLE-3 drafter's own draft vocabulary (``d2t`` / ``t2d``),
  only the tokens of such a list: its LM head loses the other rows before the model is built.
- :func:`narrow_head` gives an EAGLE-1 drafter, which drafts with the target's whole LM head,
  a copy of only the listed rows (:class:`~headway.drafters.eagle_drafter.EagleDrafter`'s
  ``vocab`` maps its choices back to target ids); :func:`narrow_medusa` cuts every Medusa
  head's own LM head the same way (:class:`~headway.drafters.medusa_drafter.MedusaDrafter`'s
  ``vocab``), and turns heads trained over a draft vocabulary (``token_map``) into the same
  narrowed form.
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from headway.atomic import write_text_atomic
from headway.corpus.merge_turns import merge_turns
from headway.corpus.samples import is_trained_turn
from headway.corpus.sources import load_conversations
from headway.errors import HeadwayError
from headway.heads.eagle import TargetHead
from headway.heads.eagle3 import Eagle3Config
from headway.heads.medusa import MedusaConfig, check_token_map
from headway.heads.vocab import DraftVocab

__all__ = [
    "answer_token_counts",
    "draft_vocabulary",
    "frequent_answer_tokens",
    "narrow_eagle3",
    "narrow_head",
    "narrow_medusa",
    "write_draft_vocabulary",
]


def answer_token_counts(
    data_dirs: Path | Sequence[Path], tokenizer: PreTrainedTokenizerBase
) -> Counter[int]:
    """How often each token id occurs in the trained assistant answers of chat data (folders
    of ``*.jsonl[.gz]`` files, e.g. regenerated data), counted as training reads them: an
    answer kept as context (``"weight": 0``) is not counted, and a conversation held by
    several folders counts once, in its deepest row (:mod:`headway.corpus.merge_turns`). The
    tokenizer's EOS counts once per answer: a drafter must be able to draft an answer's end.

    Raises:
        HeadwayError: the folders hold no trained assistant answers, or a row is malformed
            (naming its file and line).
    """
    counts: Counter[int] = Counter()
    folders = [data_dirs] if isinstance(data_dirs, Path) else list(data_dirs)
    eos = tokenizer.eos_token_id
    loaded = [load_conversations(folder)[0] for folder in folders]
    for merged in merge_turns(loaded):
        for sample in merged.samples:
            for index, message in enumerate(sample.messages or []):
                if is_trained_turn(message, index):
                    counts.update(
                        tokenizer(message["content"], add_special_tokens=False)["input_ids"]
                    )
                    if isinstance(eos, int):
                        counts[eos] += 1
    if not counts:
        names = ", ".join(str(folder) for folder in folders)
        raise HeadwayError(f"{names}: no assistant answers to build a draft vocabulary from")
    return counts


def frequent_answer_tokens(
    data_dirs: Path | Sequence[Path], tokenizer: PreTrainedTokenizerBase, size: int
) -> list[int]:
    """The ``size`` most frequent token ids of :func:`answer_token_counts`, most frequent
    first."""
    return [token for token, _ in answer_token_counts(data_dirs, tokenizer).most_common(size)]


def write_draft_vocabulary(path: Path, token_ids: list[int]) -> Path:
    """Write ``token_ids`` (most frequent first) as a draft-vocabulary file that
    ``draft_vocab=PATH`` reads back without tokenizing the data again; returns ``path``."""
    write_text_atomic(path, json.dumps({"token_ids": token_ids}) + "\n")
    return path


def _read_vocabulary_file(path: Path, vocab_size: int) -> list[int]:
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))["token_ids"]
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as error:
        raise HeadwayError(
            f'{path}: not a draft-vocabulary file ({error}); expected {{"token_ids": [...]}}'
        ) from error
    valid = isinstance(ids, list) and all(
        isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab_size for i in ids
    )
    if not valid or not ids or len(set(ids)) != len(ids):
        raise HeadwayError(
            f"{path}: token_ids must be distinct token ids in [0, {vocab_size}); fix or rewrite it"
        )
    return ids


def draft_vocabulary(source: Path, tokenizer: PreTrainedTokenizerBase, size: int) -> Tensor:
    """The draft vocabulary, sorted, as a LongTensor: the ``size`` most frequent answer tokens of
    a chat-data folder, or the first ``size`` ids of a file written by
    :func:`write_draft_vocabulary` (no tokenizing).

    Raises:
        HeadwayError: no answers in the folder, or a malformed or out-of-range file.
    """
    if source.is_file():
        ids = _read_vocabulary_file(source, len(tokenizer))[:size]
    else:
        ids = frequent_answer_tokens(source, tokenizer, size)
    return torch.tensor(sorted(ids), dtype=torch.long)


def narrow_eagle3(
    config: Eagle3Config, state_dict: dict[str, Tensor], keep: Tensor
) -> tuple[Eagle3Config, dict[str, Tensor]]:
    """An EAGLE-3 drafter (``config``, its ``state_dict``) drafting only the tokens of its draft
    vocabulary that are in ``keep`` (target ids, any order): ``lm_head.weight`` ``[N, H]`` ->
    ``[N', H]``, ``d2t`` / ``t2d`` rebuilt for the N' kept tokens, in draft-id order.

    Raises:
        HeadwayError: no token of ``keep`` is in the drafter's vocabulary.
    """
    vocab = DraftVocab.from_tensors(state_dict["d2t"], state_dict["t2d"])
    targets = vocab.target_ids
    kept = torch.isin(targets, keep.to(targets.device)).nonzero().flatten()
    if kept.numel() == 0:
        raise HeadwayError(
            "none of the draft-vocabulary file's tokens is in the EAGLE-3 drafter's vocabulary; "
            "is it a list for another tokenizer?"
        )
    narrowed = DraftVocab.from_target_ids(targets[kept], vocab.vocab_size)
    state = dict(state_dict)
    state["lm_head.weight"] = state_dict["lm_head.weight"][kept].contiguous()
    state["d2t"], state["t2d"] = narrowed.d2t, narrowed.t2d
    return dataclasses.replace(config, draft_vocab_size=narrowed.size), state


def narrow_head(head: TargetHead, keep: Tensor) -> TargetHead:
    """``head`` with an LM head of only the rows (and bias entries) of the target ids ``keep``
    (int64 ``[N]``, sorted, distinct): a copy ``[N, H]`` on the same device and dtype; the
    embedding is still the target's own.

    Raises:
        HeadwayError: an id beyond the LM head's rows (a list for another tokenizer).
    """
    weight = head.lm_head.weight
    assert isinstance(weight, Tensor)
    _check_ids(keep, weight.shape[0])
    bias = getattr(head.lm_head, "bias", None)
    rows = keep.to(weight.device)
    narrow = nn.Linear(weight.shape[1], rows.numel(), bias=bias is not None)
    narrow = narrow.to(device=weight.device, dtype=weight.dtype).requires_grad_(False)
    narrow.weight.copy_(weight.detach()[rows])
    if bias is not None:
        narrow.bias.copy_(bias.detach()[rows])
    return TargetHead(embed=head.embed, lm_head=narrow)


def narrow_medusa(
    config: MedusaConfig, state_dict: dict[str, Tensor], keep: Tensor | None
) -> tuple[MedusaConfig, dict[str, Tensor], Tensor | None]:
    """Medusa heads (``config``, their ``state_dict``) as the drafters run them: every head's
    ``lm_head.weight`` cut to the rows of the target ids they may propose, and those ids.

    The rows kept: heads trained over a draft vocabulary (``token_map``) keep theirs, and of
    those only the ids in ``keep`` (int64 ``[N]``, sorted, distinct; FR-Spec) where given; whole
    heads keep the rows ``keep`` names. Returns the narrowed config (``vocab_size`` the rows
    kept, no ``token_map``), the state dict, and the target id of each row (``None``: the heads
    are whole and nothing was cut, so row = target id).

    Raises:
        HeadwayError: an id beyond the heads' vocabulary (a list for another tokenizer), or no
            id of ``keep`` in the heads' draft vocabulary.
    """
    if keep is not None:
        _check_ids(keep, config.vocab_size)
    token_map = state_dict.get("token_map")
    if token_map is None and keep is None:
        return config, state_dict, None
    if token_map is None:
        assert keep is not None
        rows = ids = keep.cpu()
    else:
        try:
            token_map = check_token_map(token_map, config)
        except ValueError as error:
            raise HeadwayError(f"Medusa heads: {error}; the weights are damaged") from error
        listed = torch.ones_like(token_map, dtype=torch.bool)
        if keep is not None:
            listed = torch.isin(token_map, keep.cpu())
        if not bool(listed.any()):
            raise HeadwayError(
                "none of the draft-vocabulary list's tokens is in the heads' own draft "
                f"vocabulary of {token_map.numel()} tokens; drop the list"
            )
        rows = listed.nonzero().flatten()
        ids = token_map[rows]
    state = {
        name: tensor[rows.to(tensor.device)].contiguous()
        if name.endswith("lm_head.weight")
        else tensor
        for name, tensor in state_dict.items()
        if name != "token_map"
    }
    narrowed = dataclasses.replace(config, vocab_size=rows.numel(), draft_vocab_size=0)
    return narrowed, state, ids


def _check_ids(keep: Tensor, vocab_size: int) -> None:
    if keep.numel() and int(keep.max()) >= vocab_size:
        raise HeadwayError(
            f"the draft-vocabulary list holds token id {int(keep.max())}, beyond the target's "
            f"{vocab_size} output tokens; is it a list for another tokenizer?"
        )
