"""Chat data to token ids and an assistant-only loss mask: the door to the data modules.

    samples, report = load_conversations("data/chat.jsonl")          # rows -> Sample
    dataset, report = build_dataset(tokenizer, "chitchat", max_length=2048)
    loader = DataLoader(dataset, collate_fn=partial(pad_collate, pad_token_id=pad_id_of(tok)))
    blocks = pack(dataset, block_length=2048, pad_token_id=pad_id_of(tok))

Reading and validating rows lives in :mod:`headway.corpus.sources`, chat templates and loss masks
in :mod:`headway.train.chat_format`, padding and packing in :mod:`headway.train.batching`; this
module ties them into a ``datasets.Dataset`` and renders samples for ``headway data inspect``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
from transformers import PreTrainedTokenizerBase

from headway.corpus.merge_turns import merge_turns
from headway.corpus.samples import BadRowError, DataReport, Message, Sample
from headway.corpus.sources import CHITCHAT, load_conversations, no_samples_message
from headway.errors import DataError
from headway.train.batching import document_attention_mask, pack, pad_collate
from headway.train.chat_format import (
    TokenizedSample,
    chat_template_of,
    tokenize_sample,
)

__all__ = [
    "CHITCHAT",
    "DataReport",
    "Message",
    "Sample",
    "TokenizedSample",
    "build_dataset",
    "build_datasets",
    "document_attention_mask",
    "format_inspection",
    "inspect_samples",
    "load_conversations",
    "pack",
    "pad_collate",
    "pad_id_of",
    "tokenize_sample",
]

TOKENIZED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "skip_reason": datasets.Value("string"),  # "" for kept samples
        "origin": datasets.Value("string"),
        "truncated": datasets.Value("bool"),
        "loop_removed": datasets.Value("int32"),
    }
)
NO_TRAINED_TOKEN = "no trained token within max_length"
GREEN, RESET = "\x1b[32m", "\x1b[0m"


def build_dataset(
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path,
    *,
    max_length: int,
    skip_bad_rows: bool = False,
    limit: int | None = None,
    num_proc: int | None = None,
    loop_repeats: int = 0,
) -> tuple[datasets.Dataset, DataReport]:
    """Load ``source`` and tokenize every sample; returns a dataset with columns ``input_ids``
    and ``loss_mask`` (each row ``[seq]``, ``seq <= max_length``) and the report.

    Samples with no trained token left after truncation to ``max_length`` are always skipped and
    counted (the row is fine, the length budget is not); bad rows raise DataError unless
    ``skip_bad_rows``. Raises DataError if nothing is left. ``num_proc`` tokenizes in that many
    processes: rendering chat templates is pure Python, slow for long conversations.
    ``loop_repeats > 0`` takes the assistant tokens of repetition loops past that many periods
    out of the samples (:mod:`headway.generation.repetition`). Rows of one conversation
    (:mod:`headway.corpus.merge_turns`) are trained once, in the deepest of them.
    """
    samples, report = load_conversations(source, skip_bad_rows=skip_bad_rows, limit=limit)
    (merged,) = merge_turns([samples])
    report.merged = merged.merged
    dataset = _tokenized(
        tokenizer, merged.samples, report, max_length, skip_bad_rows, loop_repeats, num_proc
    )
    assert dataset is not None  # a source's deepest rows stay in it
    return dataset, report


def _tokenized(
    tokenizer: PreTrainedTokenizerBase,
    samples: list[Sample],
    report: DataReport,
    max_length: int,
    skip_bad_rows: bool,
    loop_repeats: int,
    num_proc: int | None = None,
) -> datasets.Dataset | None:
    """``samples`` of ``report.source`` tokenized (``input_ids``, ``loss_mask``), ``report``
    filled in; None where every row of the source went into deeper rows of other sources."""
    if not samples and report.merged:
        report.samples = 0
        return None
    source = report.source
    if any(sample.messages is not None for sample in samples):
        chat_template_of(tokenizer, source)  # fail once, early, naming the source
    records = [{"messages": s.messages, "text": s.text, "origin": s.origin} for s in samples]
    tokenized = datasets.Dataset.from_list(records).map(
        _tokenize_batch,
        batched=True,
        remove_columns=["messages", "text"],
        features=TOKENIZED_FEATURES,
        fn_kwargs={
            "tokenizer": tokenizer,
            "max_length": max_length,
            "skip": skip_bad_rows,
            "loop_repeats": loop_repeats,
        },
        num_proc=num_proc,
        desc="tokenize",
    )
    for reason, origin in zip(tokenized["skip_reason"], tokenized["origin"], strict=True):
        if reason:
            report.record_skip(reason, origin)
    kept = tokenized.filter(lambda reason: not reason, input_columns="skip_reason")
    report.samples = len(kept)
    if not report.samples:
        too_short = f", or raise data.max_length (now {max_length})"
        hint = too_short if report.skipped[NO_TRAINED_TOKEN] else ""
        raise DataError(no_samples_message(report) + hint)
    report.truncated = sum(kept["truncated"])
    report.tokens = sum(len(ids) for ids in kept["input_ids"])
    report.trained_tokens = sum(sum(mask) for mask in kept["loss_mask"])
    report.loop_removed = sum(kept["loop_removed"])
    return kept.select_columns(["input_ids", "loss_mask"])


def build_datasets(
    tokenizer: PreTrainedTokenizerBase,
    sources: Sequence[str | Path],
    *,
    max_length: int,
    skip_bad_rows: bool = False,
    limit: int | None = None,
    loop_repeats: int = 0,
) -> tuple[datasets.Dataset, list[DataReport]]:
    """:func:`build_dataset` over several sources, concatenated in order (``input_ids`` and
    ``loss_mask`` columns), with one report per source. The rows of one conversation in several
    sources (a ``--continue-from`` folder beside the folders it went on from) are trained once,
    in the deepest row (:mod:`headway.corpus.merge_turns`; each report counts its rows merged).

    The last result is kept for the process, keyed by the arguments and the sources' file sizes
    and times: the training loop and EAGLE-3's draft-vocabulary count ask for the same data one
    after the other, and tokenizing a corpus of thousands of conversations is slow."""
    key = (
        id(tokenizer),
        getattr(tokenizer, "name_or_path", ""),
        getattr(tokenizer, "chat_template", None),
        len(tokenizer),
        tuple(str(source) for source in sources),
        _stamps(sources),
        max_length,
        skip_bad_rows,
        limit,
        loop_repeats,
    )
    if key in _LAST_BUILT:
        dataset, reports = _LAST_BUILT[key]
        return dataset, copy.deepcopy(reports)
    loaded = [
        load_conversations(source, skip_bad_rows=skip_bad_rows, limit=limit) for source in sources
    ]
    merged = merge_turns([samples for samples, _ in loaded])
    parts, reports = [], []
    for (_, report), kept in zip(loaded, merged, strict=True):
        report.merged = kept.merged
        part = _tokenized(tokenizer, kept.samples, report, max_length, skip_bad_rows, loop_repeats)
        parts.extend([part] if part is not None else [])
        reports.append(report)
    dataset = datasets.concatenate_datasets(parts)
    _LAST_BUILT.clear()
    _LAST_BUILT[key] = (dataset, copy.deepcopy(reports))
    return dataset, reports


_LAST_BUILT: dict[tuple[Any, ...], tuple[datasets.Dataset, list[DataReport]]] = {}


def _stamps(sources: Sequence[str | Path]) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of every file under the sources that are paths (built-in source
    names such as ``chitchat`` have none: their packages do not change under a process)."""
    stamps = []
    for source in sources:
        path = Path(source)
        files = sorted(path.rglob("*")) if path.is_dir() else [path] if path.is_file() else []
        for file in files:
            if file.is_file():
                stat = file.stat()
                stamps.append((str(file), stat.st_size, stat.st_mtime_ns))
    return tuple(stamps)


def _tokenize_batch(
    batch: dict[str, list[Any]],
    *,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    skip: bool,
    loop_repeats: int,
) -> dict[str, list[Any]]:
    """``datasets.map`` body: tokenize a batch of sample records; a sample that cannot be used
    keeps its row with a ``skip_reason`` (so reasons survive multiprocessing), or raises."""
    out: dict[str, list[Any]] = {key: [] for key in TOKENIZED_FEATURES}
    for messages, text, origin in zip(
        batch["messages"], batch["text"], batch["origin"], strict=True
    ):
        sample = Sample(messages=messages, text=text, origin=origin)
        try:
            tokenized = tokenize_sample(
                tokenizer, sample, max_length=max_length, loop_repeats=loop_repeats
            )
            reason = "" if tokenized.trained_tokens else NO_TRAINED_TOKEN
        except BadRowError as error:
            if not skip:
                raise
            tokenized, reason = TokenizedSample([], []), error.reason
        out["input_ids"].append(tokenized.input_ids)
        out["loss_mask"].append(tokenized.loss_mask)
        out["skip_reason"].append(reason)
        out["origin"].append(origin)
        out["truncated"].append(tokenized.truncated)
        out["loop_removed"].append(tokenized.loop_removed)
    return out


def pad_id_of(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad with: the pad token, else EOS (Llama-3 has no pad token), else 0. Padding
    is masked everywhere, so its value only has to be a valid id."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(token_id, int):
            return token_id
    return 0


def format_inspection(
    tokenizer: PreTrainedTokenizerBase,
    input_ids: list[int],
    loss_mask: list[int],
    *,
    color: bool,
) -> str:
    """Show a tokenized sample with its trained tokens marked, then a one-line summary.

    Trained text is green (ANSI) when ``color``, otherwise each run of trained tokens is wrapped
    in ``[[`` ``]]``. Special tokens are shown as text.
    """
    opening, closing = (GREEN, RESET) if color else ("[[", "]]")
    parts = []
    for text, trained in _decoded_runs(tokenizer, input_ids, loss_mask):
        parts.append(f"{opening}{text}{closing}" if trained else text)
    trained_tokens = sum(loss_mask)
    share = trained_tokens / len(input_ids) if input_ids else 0.0
    marked_as = "green" if color else "inside [[ ]]"
    summary = (
        f"{len(input_ids)} tokens, {trained_tokens} trained ({share:.1%}); trained text is "
        f"{marked_as}"
    )
    return "".join(parts) + "\n" + summary


def _decoded_runs(
    tokenizer: PreTrainedTokenizerBase, input_ids: list[int], loss_mask: list[int]
) -> list[tuple[str, bool]]:
    """``(text, trained)`` per run of equal mask values.

    Each run is the difference between decoding everything up to its end and up to its start:
    decoding a run alone would lose the leading space of SentencePiece tokens.
    """
    runs: list[tuple[str, bool]] = []
    before, start = "", 0
    for end in range(1, len(input_ids) + 1):
        if end < len(input_ids) and loss_mask[end] == loss_mask[start]:
            continue
        upto = _decode(tokenizer, input_ids[:end])
        if upto.startswith(before):
            text = upto[len(before) :]
        else:  # a run boundary split a multi-byte character
            text = _decode(tokenizer, input_ids[start:end])
        runs.append((text, bool(loss_mask[start])))
        before, start = upto, end
    return runs


def _decode(tokenizer: PreTrainedTokenizerBase, input_ids: list[int]) -> str:
    text = tokenizer.decode(input_ids, skip_special_tokens=False)
    assert isinstance(text, str)  # one sequence decodes to one string
    return text


def inspect_samples(
    tokenizer: PreTrainedTokenizerBase,
    source: str | Path,
    *,
    n: int = 1,
    max_length: int = 2048,
    color: bool = False,
    skip_bad_rows: bool = False,
    loop_repeats: int = 0,
) -> str:
    """The first ``n`` samples of ``source`` as :func:`headway data inspect` prints them: a header
    naming each sample's origin, the sample with trained tokens marked, and its summary."""
    samples, report = load_conversations(source, skip_bad_rows=skip_bad_rows, limit=n)
    sections = []
    for sample in samples:
        tokenized = tokenize_sample(
            tokenizer, sample, max_length=max_length, loop_repeats=loop_repeats
        )
        note = f" (truncated to {max_length} tokens)" if tokenized.truncated else ""
        if tokenized.loop_removed:
            note += f" ({tokenized.loop_removed} tokens in repetition loops removed)"
        body = format_inspection(tokenizer, tokenized.input_ids, tokenized.loss_mask, color=color)
        sections.append(f"=== {sample.origin}{note} ===\n{body}")
    if report.skipped:
        sections.append(f"skipped before these: {report.skipped_summary()}")
    return "\n\n".join(sections)
