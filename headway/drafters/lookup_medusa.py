"""The ``lookup-medusa`` drafter (the quickstart's): prompt lookup merged with confidence-gated
Medusa heads.

- :class:`~headway.drafters.confident_drafter.ConfidentMedusaDrafter` drafts the heads' top-1
  chain only while its cumulative probability stays at or above ``confidence`` (the quickstart
  calibrates it on held-out data, :mod:`headway.quickstart.calibrate`), optionally over a draft
  vocabulary of the training data's most frequent tokens (a cheaper ``[V', H]`` projection).
- :class:`~headway.drafters.merged.MergedDrafter` proposes the union of prompt lookup's tree and
  the heads' chain, merged as a prefix tree within a node budget, prompt lookup's paths first,
  and counts which drafter proposed each accepted token.

Drafts never affect what is committed (the target verifies every token), so none of this
touches exactness; it only decides how much verification work is spent, and on what.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor
from transformers.tokenization_utils_base import PreTrainedTokenizerBase

from headway.atomic import write_text_atomic
from headway.corpus.jsonl import read_jsonl
from headway.decode.generate import Drafter
from headway.drafters.confident_drafter import ConfidentMedusaDrafter
from headway.drafters.lookup import PromptLookupDrafter
from headway.drafters.merged import MergedDrafter
from headway.drafters.specs import LookupMedusaSpec
from headway.errors import HeadwayError
from headway.heads.hidden_states import check_final_hidden, final_hidden_layer
from headway.heads.loading import FoundHeads
from headway.heads.medusa import MedusaConfig, MedusaHeads
from headway.target import Target, resolve_dtype

__all__ = [
    "draft_vocabulary",
    "frequent_answer_tokens",
    "lookup_medusa_drafter",
    "write_draft_vocabulary",
]


def lookup_medusa_drafter(
    target: Target, spec: LookupMedusaSpec, found: FoundHeads
) -> MergedDrafter:
    """The drafter of ``spec`` on ``target``, with the Medusa heads ``found`` in ``spec.heads``.

    Raises:
        HeadwayError: the heads are not Medusa heads, or the draft vocabulary's data holds no
            answers.
    """
    if not isinstance(found.config, MedusaConfig):
        raise HeadwayError(f"{spec.heads}: lookup-medusa needs Medusa heads, found {found.method}")
    device = target.model.get_output_embeddings().weight.device
    dtype = resolve_dtype(spec.draft_dtype)
    heads = MedusaHeads.trained(found.config, found.state_dict, device=device, dtype=dtype)
    layer = final_hidden_layer(target.model)
    check_final_hidden(target.model, layer)
    vocab = None
    if spec.draft_vocab:
        vocab = draft_vocabulary(Path(spec.draft_vocab), target.tokenizer, spec.draft_vocab_size)
    drafters: list[Drafter] = []
    if spec.lookup:
        drafters.append(
            PromptLookupDrafter(
                min_ngram=spec.lookup_min_ngram,
                max_ngram=spec.lookup_max_ngram,
                num_draft_tokens=spec.lookup_tokens,
                max_nodes=spec.lookup_tokens,
            )
        )
    num_heads = found.config.num_heads
    drafters.append(
        ConfidentMedusaDrafter(
            heads, hidden_layer=layer, threshold=spec.confidence, max_depth=num_heads, vocab=vocab
        )
    )
    budget = (spec.lookup_tokens if spec.lookup else 0) + num_heads
    return MergedDrafter(drafters, max_nodes=budget)


def frequent_answer_tokens(
    data_dir: Path, tokenizer: PreTrainedTokenizerBase, size: int
) -> list[int]:
    """The ``size`` most frequent token ids of the assistant answers in regenerated data
    (``data_dir/*.jsonl[.gz]`` with ``messages`` rows), most frequent first."""
    counts: Counter[int] = Counter()
    for path in sorted(data_dir.glob("*.jsonl*")):
        for row in read_jsonl(path):
            answers = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
            for answer in answers:
                counts.update(tokenizer(answer, add_special_tokens=False)["input_ids"])
    if not counts:
        raise HeadwayError(f"{data_dir} holds no assistant answers to build a draft vocabulary")
    return [token for token, _ in counts.most_common(size)]


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
