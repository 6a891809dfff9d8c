"""The ``headway`` command. Each subcommand parses its flags in this package and calls the library.

Errors a user can cause (:class:`headway.errors.HeadwayError`) print as one line on stderr and
exit with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from headway import __version__
from headway.cli.check import add_check
from headway.cli.common import add_target_flags
from headway.cli.data import add_data
from headway.cli.env import add_env
from headway.cli.eval import add_eval
from headway.cli.export import add_export
from headway.cli.footprint import add_plan
from headway.cli.quickstart import add_quickstart
from headway.cli.values import OneLineParser
from headway.config import describe
from headway.errors import HeadwayError
from headway.run_config import RunConfig


def _run_train(args: argparse.Namespace) -> int:
    from headway.config import load_config, to_dict

    config = load_config(RunConfig, args.config, args.overrides)
    if args.print_config:
        import yaml

        print(yaml.safe_dump(to_dict(config), sort_keys=False), end="")
        return 0
    from headway.train.loop import train

    run_dir = train(config, resume=args.resume)
    print(f"heads saved in {run_dir}")
    return 0


def _add_train(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "train",
        help="train a drafter (also: accelerate launch -m headway.train)",
        description="Train a drafter on a frozen target. Settings come from a YAML recipe "
        "(see configs/) and section.key=value overrides; every key:\n\n" + describe(RunConfig),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", help="YAML recipe, e.g. configs/medusa1-smollm2.yaml")
    parser.add_argument(
        "overrides", nargs="*", metavar="SECTION.KEY=VALUE", help="override a recipe value"
    )
    parser.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    parser.add_argument(
        "--print-config", action="store_true", help="print the validated config and exit"
    )
    parser.set_defaults(handler=_run_train)


def _add_generate(commands: argparse._SubParsersAction) -> None:
    from headway.cli.generate import add_generate_flags, run_generate

    parser = commands.add_parser(
        "generate",
        help="generate text with speculative decoding (lossless)",
        description="Generate from one or more prompts. Output is identical to plain greedy "
        "decoding at temperature 0 (fp32) and follows the target's distribution when sampling.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_target_flags(parser, use="generate")
    add_generate_flags(parser)
    parser.set_defaults(handler=run_generate)


def build_parser() -> argparse.ArgumentParser:
    """The full ``headway`` argument parser (exposed for tests and docs)."""
    parser = OneLineParser(
        prog="headway",
        description="Train, export, evaluate and decode with speculative-decoding drafters "
        "(Medusa, EAGLE-1/2, EAGLE-3) on a frozen Hugging Face causal LM, losslessly.",
    )
    parser.add_argument("--version", action="version", version=f"headway {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (
        _add_train,
        add_export,
        add_eval,
        _add_generate,
        add_quickstart,
        add_data,
        add_env,
        add_check,
        add_plan,
    ):
        add(commands)
    return parser


def _configure_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM (``kill``, a job scheduler's stop) raises ``SystemExit(143)``
    so ``finally`` blocks run: writer locks are released and removed, temporaries cleaned. The
    previous handler is restored afterwards (only the main thread can install one)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``headway`` console script."""
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        with sigterm_exits():
            return int(args.handler(args))
    except HeadwayError as error:
        command = " ".join(filter(None, (args.command, getattr(args, "data_command", None))))
        print(f"headway {command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
