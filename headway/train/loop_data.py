"""What the training loop reads: the train / held-out split, packed or padded batches, and where
each batch's target features come from (an online forward, or the offline cache)."""

from __future__ import annotations

import logging
from functools import partial
from pathlib import Path
from typing import Any

import datasets
import torch
from torch.utils.data import Dataset
from transformers import PreTrainedTokenizerBase

from headway.errors import TrainingError
from headway.hardware import mixed_precision
from headway.run_config import RunConfig
from headway.target import Target, fingerprint
from headway.train.batching import pack, padding_share
from headway.train.data import DataReport, build_datasets, pad_collate, pad_id_of
from headway.train.features import (
    CachedFeatureDataset,
    FeatureSource,
    OnlineFeatures,
    cached_hidden,
)
from headway.train.packed_features import (
    PackedFeatureDataset,
    collate_cached,
    collate_packed_features,
)

logger = logging.getLogger(__name__)


def source_datasets(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase
) -> tuple[datasets.Dataset, list[DataReport]]:
    """``data.sources`` tokenized as the loop trains on them (no features, no packing): the
    dataset and a report per source."""
    return build_datasets(
        tokenizer,
        config.data.sources,
        max_length=config.data.max_length,
        skip_bad_rows=config.data.skip_bad_rows,
        limit=config.data.limit,
        loop_repeats=config.data.loop_repeats,
    )


def split_held_out(dataset: Any, eval_fraction: float, seed: int) -> tuple[Any, Any]:
    """Deterministic train / held-out split of a map-style dataset (at least one held-out row)."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = max(1, round(len(dataset) * eval_fraction)) if eval_fraction > 0 else 0
    held_out = min(held_out, len(dataset) - 1)
    subset = torch.utils.data.Subset
    return subset(dataset, order[held_out:]), subset(dataset, order[:held_out])


def training_data(config: RunConfig, target: Target) -> tuple[Dataset[Any], Dataset[Any], Any]:
    """Train and held-out datasets and their collate function."""
    pad_id = pad_id_of(target.tokenizer)
    if config.data.features == "offline":
        assert config.data.features_dir is not None  # checked by DataConfig
        cached = CachedFeatureDataset(Path(config.data.features_dir))
        if cached.settings["target"] != fingerprint(target.model).to_dict():
            raise TrainingError(
                f"{config.data.features_dir} was cached from another target; recache it"
            )
        if not config.data.pack:
            train_set, eval_set = split_held_out(
                cached, config.data.eval_fraction, config.train.seed
            )
            return train_set, eval_set, partial(collate_cached, pad_token_id=pad_id)
        blocks = PackedFeatureDataset(cached, config.data.max_length, pad_id)
        logger.info(
            "packed %d cached samples into %d blocks of %d tokens (%.1f%% padding)",
            *(blocks.samples, len(blocks), config.data.max_length, 100 * blocks.padding),
        )
        train_set, eval_set = split_held_out(blocks, config.data.eval_fraction, config.train.seed)
        return train_set, eval_set, collate_packed_features
    dataset, reports = source_datasets(config, target.tokenizer)
    for report in reports:
        logger.info("%s", report.summary())
    if config.data.pack:
        samples = len(dataset)
        dataset = pack(dataset, block_length=config.data.max_length, pad_token_id=pad_id)
        share = padding_share(dataset)
        logger.info(
            "packed %d samples into %d blocks of %d tokens (%.1f%% padding)",
            *(samples, len(dataset), config.data.max_length, 100 * share),
        )
    train_set, eval_set = split_held_out(dataset, config.data.eval_fraction, config.train.seed)
    return train_set, eval_set, partial(pad_collate, pad_token_id=pad_id)


def feature_source(config: RunConfig, target: Target, layers: tuple[int, ...]) -> FeatureSource:
    """Where a method's target features come from: none (Medusa-2 runs the target itself), the
    offline cache, or the frozen target run now (under the run's mixed precision)."""
    if not layers:  # the method runs the target itself (medusa2): no extra frozen forward
        return lambda batch: {}
    if config.data.features == "offline":
        return partial(cached_hidden, layers=layers)
    # Mixed precision covers the frozen target's forward too (on a CPU most of a step's time).
    mixed = mixed_precision(config.train.mixed_precision, target.model.device)
    autocast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed)  # as the loop decides
    return OnlineFeatures(target.model, layers, autocast=autocast)
