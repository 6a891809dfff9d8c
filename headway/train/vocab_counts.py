"""The draft vocabulary a run trains over: the N most frequent trained tokens of its data.

Shared by EAGLE-3 (``eagle3.draft_vocab_size``, its ``d2t``/``t2d``) and Medusa-1
(``medusa.draft_vocab_size``, its ``token_map``): the tokens are counted over the same dataset
the loop builds (all of it, held-out rows included, as the EAGLE reference's ``scandata`` counts
its whole training file), then :func:`~headway.heads.vocab.choose_vocab` picks them.
"""

from __future__ import annotations

import logging
from pathlib import Path

from headway.errors import ConfigError
from headway.heads.vocab import DraftVocab, TokenCounts, choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.target import Target
from headway.train.features import CachedFeatureDataset
from headway.train.loop_data import source_datasets

__all__ = ["coverage", "log_coverage", "training_token_counts", "training_vocab"]

logger = logging.getLogger(__name__)


def training_vocab(
    config: RunConfig, target: Target, feature_layers: tuple[int, ...], size: int
) -> DraftVocab:
    """The ``size`` most frequent trained tokens of the run's data, their coverage logged."""
    counts = training_token_counts(config, target, feature_layers)
    vocab = choose_vocab(counts, size)
    log_coverage(vocab, counts)
    return vocab


def training_token_counts(
    config: RunConfig, target: Target, feature_layers: tuple[int, ...]
) -> TokenCounts:
    """Token counts of the data the loop trains on: the offline feature cache (checked to hold
    ``feature_layers``), else the tokenized ``data.sources``
    (:func:`~headway.train.loop_data.source_datasets`)."""
    vocab_size = int(target.model.get_output_embeddings().weight.shape[0])
    if config.data.features == "offline":
        assert config.data.features_dir is not None  # checked by DataConfig
        cached = CachedFeatureDataset(Path(config.data.features_dir))
        if not set(feature_layers) <= set(cached.layers):
            raise ConfigError(
                f"{config.data.features_dir} caches layers {list(cached.layers)} but "
                f"{config.train.method} trains on {list(feature_layers)}; rerun `headway data "
                f"cache-features` with "
                f"--layers {','.join(map(str, feature_layers))}"
            )
        samples = (cached[index] for index in range(len(cached)))
        return token_counts(((s["input_ids"], s["loss_mask"]) for s in samples), vocab_size)
    dataset, _ = source_datasets(config, target.tokenizer)
    return token_counts(zip(dataset["input_ids"], dataset["loss_mask"], strict=True), vocab_size)


def coverage(vocab: DraftVocab, counts: TokenCounts) -> float:
    """The share of the trained tokens that the draft vocabulary ``vocab`` holds."""
    return int(counts.trained[vocab.target_ids].sum()) / max(int(counts.trained.sum()), 1)


def log_coverage(vocab: DraftVocab, counts: TokenCounts) -> None:
    """Log which share of the trained tokens the draft vocabulary ``vocab`` covers."""
    logger.info(
        "draft vocabulary: %d of %d tokens, %.1f%% of the trained tokens",
        vocab.size,
        vocab.vocab_size,
        100.0 * coverage(vocab, counts),
    )
