"""What a recipe trains on, before the run (``headway data stats``): its ``data.sources``
tokenized, merged and packed as the loop builds them, the passes its steps make over them, and
the share of the trained tokens its draft vocabulary holds. Only the tokenizer is needed."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from transformers import PreTrainedTokenizerBase

from headway.corpus.samples import DataReport
from headway.heads.vocab import choose_vocab, token_counts
from headway.run_config import RunConfig
from headway.train.batching import pack, padding_share
from headway.train.data import pad_id_of
from headway.train.loop_data import source_datasets, split_held_out
from headway.train.vocab_counts import coverage

__all__ = ["DataStats", "data_stats", "stats_json", "stats_table", "steps_line"]


@dataclass(frozen=True)
class DataStats:
    """A recipe's data as the loop would see it.

    Attributes:
        reports: one per source, as training logs them (rows, samples, merges, tokens).
        units: what a batch row is: packed blocks (``data.pack``) or samples.
        held_out: units kept for the held-out evaluation (``data.eval_fraction``).
        padding: share of padding in the packed blocks (None unpacked: it depends on batches).
        step_units: units the run's steps take (steps x batch x accumulation x processes).
        vocab: the recipe's draft vocabulary size and the share of the trained tokens among its
            most frequent ones, or None (a method drafting over the whole vocabulary).
    """

    reports: list[DataReport]
    units: int
    held_out: int
    padding: float | None
    step_units: int
    vocab: tuple[int, float] | None

    @property
    def passes(self) -> float:
        """Passes the steps make over the training units (held-out ones excluded)."""
        return self.step_units / max(self.units - self.held_out, 1)


def draft_vocab_size(config: RunConfig) -> int:
    """The recipe's draft vocabulary size, 0 where the drafter scores the whole vocabulary."""
    if config.train.method == "eagle3":
        return config.eagle3.draft_vocab_size
    return config.medusa.draft_vocab_size if config.train.method == "medusa1" else 0


def data_stats(
    config: RunConfig, tokenizer: PreTrainedTokenizerBase, *, processes: int = 1
) -> DataStats:
    """Tokenize ``config``'s sources as :func:`~headway.train.loop_data.training_data` does (for
    an offline recipe, as ``headway data cache-features`` does) and count what the run takes."""
    data = config.data
    dataset, reports = source_datasets(config, tokenizer)
    padding = None
    units = len(dataset)
    if data.pack:
        blocks = pack(dataset, block_length=data.max_length, pad_token_id=pad_id_of(tokenizer))
        units, padding = len(blocks), padding_share(blocks)
    _, held_out = split_held_out(range(units), data.eval_fraction, config.train.seed)
    train = config.train
    size = draft_vocab_size(config)
    vocab = None
    if size:
        pairs = zip(dataset["input_ids"], dataset["loss_mask"], strict=True)
        counts = token_counts(pairs, len(tokenizer))
        vocab = (size, coverage(choose_vocab(counts, size), counts))
    return DataStats(
        reports=reports,
        units=units,
        held_out=len(held_out),
        padding=padding,
        step_units=train.max_steps * train.batch_size * train.grad_accum * processes,
        vocab=vocab,
    )


def steps_line(config: RunConfig, units: int, processes: int) -> str:
    """``"2,800 steps x 8 x 1 accumulated x 1 process = 22,400 blocks: 3.06 passes over the
    7,313 training blocks"``: what the run's steps take of its ``units`` training rows."""
    train = config.train
    unit = "blocks" if config.data.pack else "samples"
    taken = train.max_steps * train.batch_size * train.grad_accum * processes
    return (
        f"{train.max_steps:,} steps x {train.batch_size} x {train.grad_accum} accumulated x "
        f"{processes} process{'es' if processes > 1 else ''} = {taken:,} {unit}: "
        f"{taken / max(units, 1):.2f} passes over the {units:,} training {unit}"
    )


def stats_table(stats: DataStats, config: RunConfig, *, processes: int = 1) -> str:
    """The figures as lines a person reads: each source's report, the totals, the passes."""
    lines = [report.summary() for report in stats.reports]
    samples = sum(report.samples for report in stats.reports)
    tokens = sum(report.tokens for report in stats.reports)
    trained = sum(report.trained_tokens for report in stats.reports)
    merged = sum(report.merged for report in stats.reports)
    lines.append(
        f"in all: {samples:,} samples, {tokens:,} tokens, {trained:,} trained "
        f"({trained / max(tokens, 1):.1%})"
        + (f"; {merged:,} rows merged into deeper rows of their conversations" if merged else "")
    )
    data = config.data
    unit = "blocks" if data.pack else "samples"
    if stats.padding is not None:
        lines.append(
            f"packed into {stats.units:,} blocks of {data.max_length:,} tokens "
            f"({stats.padding:.1%} padding)"
        )
    lines.append(
        f"held out: {stats.held_out:,} {unit} (data.eval_fraction {data.eval_fraction}); "
        + steps_line(config, stats.units - stats.held_out, processes)
    )
    if stats.vocab is not None:
        size, share = stats.vocab
        lines.append(
            f"draft vocabulary: the {size:,} most frequent trained tokens hold {share:.1%} of "
            "the trained tokens"
        )
    return "\n".join(lines)


def stats_json(stats: DataStats) -> dict[str, object]:
    """The figures as plain values (``headway data stats --json``)."""
    sources = [asdict(report) for report in stats.reports]  # skipped: counts by reason
    vocab = None
    if stats.vocab is not None:
        vocab = {"size": stats.vocab[0], "trained_share": stats.vocab[1]}
    return {
        "sources": sources,
        "units": stats.units,
        "held_out": stats.held_out,
        "padding": stats.padding,
        "step_units": stats.step_units,
        "passes": stats.passes,
        "draft_vocab": vocab,
    }
