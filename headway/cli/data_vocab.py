"""``headway data vocab``: rank the tokens of a target's answers and write a draft-vocabulary
file (FR-Spec), read by the ``draft_vocab`` option of the EAGLE, Medusa and lookup-medusa
drafters."""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.cli.common import add_target_flags
from headway.cli.values import POSITIVE, text
from headway.errors import HeadwayError

COVERAGE_SIZES = (1024, 2048, 4096, 8192, 16384)


def run_vocab(args: argparse.Namespace) -> int:
    from headway.drafters.draft_vocab import answer_token_counts, write_draft_vocabulary
    from headway.target import load_tokenizer

    folders = [Path(folder) for folder in args.data]
    for folder in folders:
        if not folder.is_dir():
            raise HeadwayError(f"{folder}: not a folder of regenerated data (*.jsonl[.gz] files)")
    tokenizer = load_tokenizer(args.target, trust_remote_code=args.trust_remote_code)
    ranked = answer_token_counts(folders, tokenizer).most_common()
    kept = ranked[: args.size]
    total = sum(count for _, count in ranked)
    write_draft_vocabulary(Path(args.out), [token for token, _ in kept])
    print(
        f"{args.out}: {len(kept)} token ids, most frequent first ({total:,} answer tokens, "
        f"{len(ranked):,} distinct)"
    )
    print("| most frequent | share of answer tokens |\n|---|---|")
    running = 0
    for rank, (_, count) in enumerate(ranked, start=1):
        running += count
        if rank in COVERAGE_SIZES or rank == len(ranked):
            print(f"| {rank:,} | {running / total:.1%} |")
    return 0


def add_vocab(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "vocab",
        help="rank the answer tokens of regenerated data into a draft-vocabulary file",
        description="Count the tokens of the assistant answers in regenerated chat-data folders "
        "as training reads them (answers kept as context, weight 0, left out; a conversation "
        "several folders hold counted once, in its deepest row; the tokenizer's EOS once per "
        'answer) and write {"token_ids": [...]}, most frequent '
        "first. A drafter given the file (--draft-option draft_vocab=FILE with EAGLE, Medusa or "
        "lookup-medusa heads) drafts only over its draft_vocab_size first tokens "
        "(FR-Spec): a narrower LM head costs less per drafted row. Prints how much of the "
        "answers the most frequent 1k-16k tokens cover.",
    )
    parser.add_argument(
        "data", nargs="+", help="regenerated data folders (headway data regenerate's data/)"
    )
    parser.add_argument("--out", type=text("--out"), required=True, help="the file to write")
    parser.add_argument(
        "--size",
        type=POSITIVE,
        default=None,
        help="keep only the N most frequent tokens (default: every token that occurs)",
    )
    add_target_flags(parser, weights=False)  # the tokenizer only: no weights are loaded
    parser.set_defaults(handler=run_vocab)
