"""Regeneration through an OpenAI-compatible server against the in-process engines, on the same
prompts, in one run: answers/s, answer tokens/s, and how many answers are identical.

Start the server first (on the same machine, or anywhere), e.g. on one CPU thread::

    OMP_NUM_THREADS=1 transformers serve FOLDER --device cpu --dtype float32 --port 8000
    OMP_NUM_THREADS=1 .venv/bin/python scripts/bench_server.py --server http://localhost:8000 \\
        --server-model FOLDER --prompts 16 --max-new-tokens 64 --threads 1

The in-process runs (the batch engine with its default prompt lookup at ``--batch-size``, and HF
``generate`` one prompt at a time, which is what ``transformers serve`` without continuous
batching does per request) run while the server idles, then the server runs once per
``--concurrency`` value while this process idles. On a machine shared with other jobs wall time
says little, so each run also reports the CPU seconds it took: this process's, plus the server
process's where ``--server-pid`` names it (read from ``/proc``).
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import random
import time
from collections.abc import Callable, Iterable
from functools import partial
from pathlib import Path

import torch

from headway.generation.server_client import ChatServer, ServerOptions
from headway.target import DEFAULT_TARGET, load_target
from headway.train.answering import Answer, RegenerateOptions, answer_items
from headway.train.prompts import PromptItem, chat_prompts
from headway.train.server_answers import answer_items_through_server, check_server

Answered = Iterable[tuple[PromptItem, list[Answer]]]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", required=True, help="the server's base URL")
    parser.add_argument("--server-model", required=True, help="the name it serves the target as")
    parser.add_argument(
        "--target", default=DEFAULT_TARGET, help="the local target (default embedded)"
    )
    parser.add_argument("--dtype", default="float32", help="local target dtype")
    parser.add_argument("--source", default="sharegpt", help="chat source of the prompts")
    parser.add_argument("--prompts", type=int, default=16, help="first turns answered per run")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="answer length cap")
    parser.add_argument("--batch-size", type=int, default=16, help="batch engine rows")
    parser.add_argument("--concurrency", default="1,4", help="server runs, one per value")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    parser.add_argument("--seed", type=int, default=0, help="which prompts")
    parser.add_argument("--server-pid", type=int, help="the server's process id, for its CPU time")
    return parser.parse_args()


def cpu_seconds(server_pid: int | None) -> float:
    """CPU seconds used so far by this process and, if given, the server process."""
    used = time.process_time()
    if server_pid is not None:
        fields = Path(f"/proc/{server_pid}/stat").read_text().rsplit(")", 1)[1].split()
        used += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return used


def timed(
    run: Callable[[], Answered], server_pid: int | None
) -> tuple[dict[str, Answer], float, float]:
    """The answers by item id, the wall seconds and the CPU seconds of one run."""
    started, cpu = time.perf_counter(), cpu_seconds(server_pid)
    answers = {item.id: answered[-1] for item, answered in run()}
    return answers, time.perf_counter() - started, cpu_seconds(server_pid) - cpu


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype=args.dtype, device="cpu")
    items = chat_prompts(args.source, args.prompts, rng=random.Random(args.seed), max_turns=1)
    print(
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads here, "
        f"torch {torch.__version__}, {args.dtype}, {len(items)} {args.source} first turns, "
        f"max_new_tokens {args.max_new_tokens}, greedy; server {args.server}"
    )
    options = RegenerateOptions(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size)
    one_at_a_time = RegenerateOptions(
        max_new_tokens=args.max_new_tokens, batch_size=1, engine="generate"
    )
    runs: dict[str, Callable[[], Answered]] = {
        f"in-process batch engine, batch {args.batch_size}": lambda: answer_items(
            target, items, options
        ),
        "in-process HF generate, batch 1": lambda: answer_items(target, items, one_at_a_time),
    }
    for concurrency in (int(value) for value in args.concurrency.split(",") if value):
        server = ChatServer(ServerOptions(args.server, args.server_model, concurrency=concurrency))
        check_server(server, target)
        runs[f"server, concurrency {concurrency}"] = partial(
            answer_items_through_server, server, items, options
        )
    first: dict[str, Answer] | None = None
    for name, run in runs.items():
        answers, seconds, cpu = timed(run, args.server_pid)
        first = first or answers
        tokens = sum(answer.tokens for answer in answers.values())
        same = sum(first[key].text == answers[key].text for key in answers)
        print(
            f"{name:>34}: {len(answers)} answers, {tokens:,} answer tokens in {seconds:.1f} s = "
            f"{len(answers) / seconds:.2f} answers/s, {tokens / seconds:.1f} tok/s; "
            f"{cpu:.1f} CPU s = {tokens / cpu:.1f} tok per CPU s; identical to the first run "
            f"{same}/{len(answers)}",
            flush=True,
        )


if __name__ == "__main__":
    main()
