"""``headway data regenerate --server URL``: the flags that let an OpenAI-compatible server answer
instead of the in-process engine, and what they build."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from headway.cli.values import NON_NEGATIVE, POSITIVE, number, text
from headway.errors import TargetError

if TYPE_CHECKING:
    from headway.generation.server_client import ServerOptions
    from headway.target import Target


def server_from_flags(args: argparse.Namespace) -> ServerOptions | None:
    """What --server and its companions ask for; None without --server."""
    from headway.generation.server_client import ServerOptions  # the CLI loads lazily

    if args.server is None:
        return None
    return ServerOptions(
        url=args.server,
        model=args.server_model or args.target,
        concurrency=args.concurrency,
        retries=args.retries,
        request_timeout=args.request_timeout,
    )


def local_target(
    args: argparse.Namespace, load: Callable[[argparse.Namespace], Target]
) -> Target | None:
    """The target --target names, loaded by `load`, for the greedy probe; None (and a warning)
    where it cannot be loaded here: the server is then checked by the name it lists alone."""
    try:
        return load(args)
    except TargetError as error:
        print(
            f"headway data regenerate: the local target cannot be loaded ({error}); the greedy "
            "probe is skipped and the server is checked only by the name it lists",
            file=sys.stderr,
        )
        return None


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """``--server`` and its companions, as one group of `parser`'s help."""
    group = parser.add_argument_group(
        "answering through a server",
        "--server URL lets an OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp's "
        "server, transformers serve) answer instead of the in-process engine: the same shards, "
        "manifest and resuming; --batch-size, --engine and --lookahead are then unused, and "
        "--stop-loops is refused",
    )
    group.add_argument(
        "--server",
        metavar="URL",
        type=text("--server"),
        help="base URL of the server, e.g. http://localhost:8000 (POST /v1/chat/completions; a "
        "trailing /v1 is accepted); the URL and model name are recorded in the manifest",
    )
    group.add_argument(
        "--server-model",
        metavar="NAME",
        type=text("--server-model"),
        help="the name the server lists the target under in GET /v1/models and is asked for in "
        "each request (default: the --target value; vLLM lists the path or id it was started "
        "with, or its --served-model-name)",
    )
    group.add_argument(
        "--server-check",
        choices=["greedy", "models"],
        default="greedy",
        help="before the first request: greedy (default) checks that GET /v1/models lists "
        "--server-model and that an 8-token greedy answer to a fixed question, re-tokenized, "
        "equals the --target loaded here (skipped with a warning where it cannot be loaded "
        "offline; use --device cpu to keep it off the server's GPU); models checks the name "
        "alone and loads nothing here (the manifest then records the served name instead of "
        "the target's fingerprint)",
    )
    group.add_argument(
        "--concurrency",
        type=POSITIVE,
        default=16,
        metavar="N",
        help="conversations in flight at once (each sends its user turns one after another, "
        "every later turn after the server's own earlier answers); default 16",
    )
    group.add_argument(
        "--retries",
        type=NON_NEGATIVE,
        default=5,
        metavar="N",
        help="further attempts of a request after a timeout, a refused or dropped connection, "
        "HTTP 429 or 5xx, or a truncated or invalid JSON answer, waiting 1, 2, 4, ... s "
        "(up to 60 s, or the server's Retry-After); other 4xx fail at once with the server's "
        "message. When a request fails for good the run stops in one line and keeps every "
        "finished shard (no shard is half-written): rerun the same command to resume",
    )
    group.add_argument(
        "--request-timeout",
        type=number(0, above=True),
        default=600.0,
        metavar="SECONDS",
        help="how long one request may wait on the server (default 600; a long answer on a busy "
        "server takes a while)",
    )
