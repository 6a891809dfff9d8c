"""How much of turn-by-turn regeneration's prefill a later turn can take from the turn before.

Reads regenerated conversations (``data/regenerated/<name>/data`` shards), renders each turn's
prompt as regeneration does (the chat template over the conversation so far) and counts the
prompt tokens prefilled when every turn is prefilled whole, against those left when a turn
continues from the longest prefix it shares with the tokens the previous turn's row held (its
prompt and its answer, re-tokenized from the stored text: the engine compares the generated
ids, which re-tokenize to the same ids almost always). Prints both and the rows computed,
answers included.

    .venv/bin/python scripts/history_share.py \
        data/regenerated/smollm2-sharegpt-turns/data --shards 4
"""

from __future__ import annotations

import argparse
from pathlib import Path

from headway.corpus.jsonl import read_jsonl
from headway.decode.batch_decoder import shared_prefix
from headway.target import DEFAULT_TARGET, load_tokenizer
from headway.train.answering import prompt_token_ids


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", type=Path, help="a regenerated folder's data/ with shards")
    parser.add_argument("--shards", type=int, default=4, help="shards read (sorted by name)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="whose tokenizer and template")
    args = parser.parse_args(argv)
    tokenizer = load_tokenizer(args.target)  # the template and ids: no weights needed
    whole = continued = answers = turns = 0
    for path in sorted(args.folder.glob("part-*.jsonl*"))[: args.shards]:
        for row in read_jsonl(path):
            messages = row["messages"]
            held: list[int] = []
            for turn in range(0, len(messages) - 1, 2):
                ids = prompt_token_ids(tokenizer, messages[: turn + 1])
                answer = tokenizer(messages[turn + 1]["content"], add_special_tokens=False)
                whole += len(ids)
                continued += len(ids) - shared_prefix(held, ids)
                answers += len(answer["input_ids"]) + 1  # and its end of turn
                turns += 1
                held = ids + answer["input_ids"]
    print(
        f"{turns} turns: {whole:,} prompt tokens prefilled whole, {continued:,} "
        f"({continued / whole:.0%}) continuing from the turn before; answers {answers:,} tokens; "
        f"rows computed {whole + answers:,} -> {continued + answers:,} "
        f"({(continued + answers) / (whole + answers):.2f})"
    )


if __name__ == "__main__":
    main()
