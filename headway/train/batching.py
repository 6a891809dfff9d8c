"""Batch tokenized samples: pad them to a rectangle, or pack them into fixed-length blocks.

Both take rows with ``input_ids`` and ``loss_mask`` (``[seq]`` lists of ints, as produced by
:func:`headway.train.data.build_dataset`) and pad on the right, where padding never shifts a
sample's positions. Padding is never trained (``loss_mask`` 0) and never attended to
(``attention_mask`` 0).

Packing concatenates whole samples into blocks of ``block_length`` tokens, next-fit in order: a
sample that does not fit in the current block starts the next one (samples are never split, so no
assistant turn is separated from its prompt). ``position_ids`` restart at 0 for every sample and
``document_ids`` number the samples within a block, so attention can be restricted to each sample
(:func:`document_attention_mask`, or flash-attention's varlen path, which reads the position
restarts).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import datasets
import torch

# What each column is padded with; columns not listed here are not batched.
PAD_VALUES: dict[str, int | None] = {
    "input_ids": None,  # the tokenizer's pad id, given by the caller
    "loss_mask": 0,
    "attention_mask": 0,
    "position_ids": 0,
    "document_ids": -1,
}

PACKED_FEATURES = datasets.Features(
    {
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "loss_mask": datasets.Sequence(datasets.Value("int8")),
        "attention_mask": datasets.Sequence(datasets.Value("int8")),
        "position_ids": datasets.Sequence(datasets.Value("int32")),
        "document_ids": datasets.Sequence(datasets.Value("int32")),
    }
)


def pad_collate(
    features: Sequence[Mapping[str, Sequence[int]]],
    *,
    pad_token_id: int,
    pad_to_multiple_of: int | None = None,
) -> dict[str, torch.Tensor]:
    """Right-pad a list of rows into int64 tensors ``[batch, seq]``.

    ``seq`` is the longest row, rounded up to ``pad_to_multiple_of``. Returns ``input_ids``,
    ``loss_mask``, ``attention_mask`` (1 on real tokens; taken from the rows if they carry it),
    plus ``position_ids`` / ``document_ids`` when the rows have them (packed blocks). Use it as a
    DataLoader ``collate_fn`` through ``functools.partial(pad_collate, pad_token_id=...)``.
    """
    if not features:
        raise ValueError("pad_collate needs at least one row")
    rows = [_with_attention_mask(row) for row in features]
    longest = max(len(row["input_ids"]) for row in rows)
    if pad_to_multiple_of:
        longest = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    batch = {}
    for key, pad_value in PAD_VALUES.items():
        if key not in rows[0]:
            continue
        value = pad_token_id if pad_value is None else pad_value
        batch[key] = torch.tensor(
            [list(row[key]) + [value] * (longest - len(row[key])) for row in rows],
            dtype=torch.long,
        )
    return batch


def _with_attention_mask(row: Mapping[str, Sequence[int]]) -> Mapping[str, Sequence[int]]:
    if "attention_mask" in row:
        return row
    return {**row, "attention_mask": [1] * len(row["input_ids"])}


def pack(
    rows: Iterable[Mapping[str, Sequence[int]]], *, block_length: int, pad_token_id: int
) -> datasets.Dataset:
    """Pack tokenized rows into a dataset of blocks, every column ``[block_length]``.

    Columns: ``input_ids``, ``loss_mask``, ``attention_mask`` (0 on the padding that ends a block),
    ``position_ids`` (0, 1, ... per sample; 0 on padding) and ``document_ids`` (0, 1, ... per
    sample within the block; -1 on padding). Example with ``block_length=5``, samples of 2, 2
    and 3 tokens: blocks ``[a a b b -]`` and ``[c c c - -]``; position_ids ``[0 1 0 1 0]``,
    ``[0 1 2 0 0]``; document_ids ``[0 0 1 1 -1]``, ``[0 0 0 -1 -1]``.

    Raises ValueError if a row is longer than ``block_length`` (tokenize with
    ``max_length <= block_length``).
    """
    if block_length < 1:
        raise ValueError(f"block_length must be >= 1, got {block_length}")
    samples = list(rows)
    try:
        plan = plan_blocks([len(row["input_ids"]) for row in samples], block_length)
    except ValueError as error:
        raise ValueError(f"{error}; build the dataset with max_length <= {block_length}") from error
    blocks: dict[str, list[list[int]]] = {key: [] for key in PACKED_FEATURES}
    current: dict[str, list[int]] = {key: [] for key in PACKED_FEATURES}
    for block in plan:
        for document, row in enumerate(samples[index] for index in block):
            length = len(row["input_ids"])
            current["input_ids"] += row["input_ids"]
            current["loss_mask"] += row["loss_mask"]
            current["attention_mask"] += [1] * length
            current["position_ids"] += range(length)
            current["document_ids"] += [document] * length
        _close_block(current, blocks, block_length, pad_token_id)
    return datasets.Dataset.from_dict(blocks, features=PACKED_FEATURES)


def plan_blocks(lengths: Sequence[int], block_length: int) -> list[list[int]]:
    """Sample indices of each block: in order, a block closed where the next sample would not
    fit (what :func:`pack` and offline packing both place). Raises ValueError for a sample
    longer than ``block_length``."""
    blocks: list[list[int]] = []
    current: list[int] = []
    used = 0
    for index, length in enumerate(lengths):
        if length > block_length:
            raise ValueError(
                f"sample {index} has {length} tokens and does not fit a block of {block_length}"
            )
        if current and used + length > block_length:
            blocks.append(current)
            current, used = [], 0
        current.append(index)
        used += length
    if current:
        blocks.append(current)
    return blocks


def _close_block(
    current: dict[str, list[int]],
    blocks: dict[str, list[list[int]]],
    block_length: int,
    pad_token_id: int,
) -> None:
    """Pad the block being filled to ``block_length``, move it to ``blocks``, start afresh."""
    for key, column in current.items():
        pad_value = PAD_VALUES[key]
        value = pad_token_id if pad_value is None else pad_value
        blocks[key].append(column + [value] * (block_length - len(column)))
        current[key] = []


def document_attention_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """Boolean attention mask ``[batch, 1, seq, seq]`` for packed blocks (True = may attend):
    causal, and only within one sample. ``document_ids`` is ``[batch, seq]`` as made by
    :func:`pack`; padding (-1) attends only to padding, so no row of the mask is empty.

    Pass it (or its additive form) as a 4-D ``attention_mask`` with the block's ``position_ids``.
    """
    seq = document_ids.shape[-1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=document_ids.device).tril()
    same_document = document_ids[:, :, None] == document_ids[:, None, :]
    return (same_document & causal)[:, None, :, :]


def target_inputs(batch: Mapping[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Keyword arguments for a stock HF forward over ``batch`` (``input_ids`` ``[B, T]``).

    A padded batch passes its 2-D ``attention_mask``. A packed one (it has ``document_ids``)
    passes a 4-D additive mask ``[B, 1, T, T]`` in ``dtype`` (causal, within one sample:
    :func:`document_attention_mask`) and ``position_ids`` restarting at every sample, so each
    sample is computed as if it were alone.
    """
    if "document_ids" not in batch:
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    visible = document_attention_mask(batch["document_ids"])
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": mask,
        "position_ids": batch["position_ids"],
    }


def padding_share(blocks: datasets.Dataset) -> float:
    """The fraction of a packed dataset's token slots that are padding (``attention_mask`` 0)."""
    slots = sum(len(row) for row in blocks["attention_mask"])
    return 1 - sum(sum(row) for row in blocks["attention_mask"]) / max(slots, 1)
