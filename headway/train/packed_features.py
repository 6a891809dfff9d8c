"""Batches of offline features (``data.features=offline``): padded (:func:`collate_cached`) or,
with ``data.pack=true``, packed into blocks.

A feature cache holds each sample's hidden states computed alone (:func:`cache_features`), and a
packed online forward computes each sample of a block as if it were alone too (positions
restarting per sample, attention kept inside it). So concatenating cached samples gives a block
exactly like the one an online packed step would see, without the target's forward: the same
columns as :func:`~headway.train.batching.pack` (``input_ids``, ``loss_mask``,
``attention_mask``, ``position_ids``, ``document_ids``) plus ``hidden.L`` ``[block, H]``,
padded as ``pack`` pads (hidden states with zeros). Samples are placed in cache order, a new
block starting where the next sample does not fit, as ``pack`` does
(``tests/test_packed_features.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from headway.errors import DataError
from headway.train.batching import PAD_VALUES, pad_collate, plan_blocks
from headway.train.features import CachedFeatureDataset, hidden_key

__all__ = ["PackedFeatureDataset", "collate_cached", "collate_packed_features"]


class PackedFeatureDataset(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Blocks of ``block_length`` tokens made of whole cached samples (module docstring).

    Args:
        cached: the feature cache.
        block_length: tokens per block (``data.max_length``); every sample must fit one.
        pad_token_id: the tokenizer's pad id, for ``input_ids`` past the last sample.
    """

    def __init__(self, cached: CachedFeatureDataset, block_length: int, pad_token_id: int) -> None:
        self.cached, self.block_length, self.pad_token_id = cached, block_length, pad_token_id
        lengths = [cached.sample_length(index) for index in range(len(cached))]
        try:
            self.blocks = plan_blocks(lengths, block_length)
        except ValueError as error:
            raise DataError(
                f"{cached.directory}: {error}; cache with `--max-length {block_length}` or "
                f"less, or raise data.max_length to {max(lengths)}"
            ) from error
        self.samples = len(lengths)
        self.padding = 1 - sum(lengths) / max(1, len(self.blocks) * block_length)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        rows = [self.cached[sample] for sample in self.blocks[index]]
        lengths = [len(row["input_ids"]) for row in rows]
        pad = self.block_length - sum(lengths)
        block = {
            "input_ids": _ids([row["input_ids"] for row in rows], pad, self.pad_token_id),
            "loss_mask": _ids([row["loss_mask"] for row in rows], pad, _value("loss_mask")),
            "attention_mask": _ids([torch.ones(n) for n in lengths], pad, _value("attention_mask")),
            "position_ids": _ids([torch.arange(n) for n in lengths], pad, _value("position_ids")),
            "document_ids": _ids(
                [torch.full((n,), d) for d, n in enumerate(lengths)], pad, _value("document_ids")
            ),
        }
        for layer in self.cached.layers:
            states = [row[hidden_key(layer)] for row in rows]
            states.append(states[0].new_zeros(pad, states[0].shape[-1]))
            block[hidden_key(layer)] = torch.cat(states)
        if "target_argmax" in rows[0]:
            block["target_argmax"] = _ids([row["target_argmax"] for row in rows], pad, 0)
        return block


def _value(column: str) -> int:
    value = PAD_VALUES[column]
    assert value is not None
    return value


def _ids(parts: Sequence[Tensor], pad: int, value: int) -> Tensor:
    """Concatenated int64 ``[sum + pad]``, the last ``pad`` entries ``value``."""
    return torch.cat([*(part.long() for part in parts), torch.full((pad,), value)])


def collate_packed_features(blocks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Stack blocks of one length: every column ``[B, block]``, ``hidden.L`` ``[B, block, H]``."""
    return {name: torch.stack([block[name] for block in blocks]) for name in blocks[0]}


def collate_cached(rows: Sequence[Mapping[str, Tensor]], *, pad_token_id: int) -> dict[str, Tensor]:
    """Right-pad cached samples: ids/masks via :func:`pad_collate`, hidden states with zeros."""
    batch = pad_collate(
        [
            {"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()}
            for r in rows
        ],
        pad_token_id=pad_token_id,
    )
    length = batch["input_ids"].shape[1]
    for name in rows[0]:
        if name.startswith("hidden.") or name == "target_argmax":  # [T, H] or [T]: zeros
            pads = [(0, 0) * (r[name].dim() - 1) + (0, length - len(r[name])) for r in rows]
            batch[name] = torch.stack([F.pad(r[name], p) for r, p in zip(rows, pads, strict=True)])
    return batch
