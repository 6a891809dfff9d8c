"""``headway data stats``: what a training recipe's data holds before the run (samples, trained
tokens, conversations merged, packed blocks, passes, draft-vocabulary coverage)."""

from __future__ import annotations

import argparse
import json

from headway.cli.values import POSITIVE, add_recipe_arguments

DESCRIPTION = """\
Tokenize a recipe's data.sources as `headway train` will (the chat template, the loss mask,
data.max_length, data.loop_repeats, rows of one conversation merged into its deepest row) and
print, before spending a run on it: each source's rows, samples, truncated and skipped rows,
tokens and trained tokens; the totals; the packed blocks and their padding (data.pack); the
held-out share and how many passes train.max_steps make over the rest; and, for EAGLE-3 and
Medusa-1 recipes with a draft vocabulary, the share of the trained tokens it holds. Only the
target's tokenizer is read (no weights). For an offline recipe (data.features=offline) these
are the sources `headway data cache-features` tokenizes; where the cache was written with
--loop-repeats N, count with `data.features=online data.loop_repeats=N` to see what it holds.
"""


def run_stats(args: argparse.Namespace) -> int:
    from headway.config import load_config
    from headway.run_config import RunConfig
    from headway.target import load_tokenizer
    from headway.train.data_stats import data_stats, stats_json, stats_table

    config = load_config(RunConfig, args.config, args.overrides)
    tokenizer = load_tokenizer(
        config.target.name, trust_remote_code=config.target.trust_remote_code
    )
    stats = data_stats(config, tokenizer, processes=args.processes)
    if args.json:
        print(json.dumps(stats_json(stats), indent=2))
    else:
        print(stats_table(stats, config, processes=args.processes))
    return 0


def add_stats(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "stats",
        help="what a recipe's data holds: samples, trained tokens, blocks, passes, vocabulary",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_recipe_arguments(
        parser,
        what="whose data to count, e.g. configs/eagle3-smollm2-gpu-turns.yaml",
        example="data.max_length=3072",
    )
    parser.add_argument(
        "--processes",
        type=POSITIVE,
        default=1,
        help="data-parallel processes the run will use (default 1): each takes "
        "train.batch_size rows a step, so the passes grow with them",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="print the figures as JSON (per source: rows, samples, skipped by reason and "
        "where each reason was first met, truncated, tokens, trained tokens, loop tokens "
        "removed, rows merged; then units, "
        "held out, padding, step units, passes, draft vocabulary) instead of lines",
    )
    parser.set_defaults(handler=run_stats)
