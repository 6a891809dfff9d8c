"""``headway check``: what headway can do with a target, before anything is trained for it."""

from __future__ import annotations

import argparse
import json

from headway.cli.common import add_target_flags, target_from_flags

__all__ = ["add_check"]


def run_check(args: argparse.Namespace) -> int:
    from headway.drafters.target_support import target_support

    target = target_from_flags(args)
    rows = target_support(target.model)
    if args.json:
        print(json.dumps({"target": args.target, "support": [row.to_dict() for row in rows]}))
    else:
        model = target.model
        config = model.config.get_text_config()
        dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
        print(
            f"{args.target}: {getattr(model.config, 'model_type', '?')}, "
            f"{config.num_hidden_layers} layers, {dtype} on {model.device}"
        )
        width = max(len(row.capability) for row in rows)
        for row in rows:
            print(f"- {'yes' if row.ok else 'no '}  {row.capability.ljust(width)}  {row.detail}")
    return 0 if rows[0].ok else 1


def add_check(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "check",
        help="what headway can do with a target: tree decoding, drafters, regeneration",
        description="Load a target and run every check headway makes of one, each where it "
        "would otherwise first refuse: whether a tree verified in one forward equals each path "
        "decoded alone (the mask probe: a few tiny forwards in the target's dtype; a cache with "
        "recurrent layers, ALiBi biases or a forward that fails on a 4-D mask are refused), "
        "what its sliding or chunked layers need, the static verify path (--verify captured on "
        "a GPU), batched decoding (generate --batch), whether Medusa and EAGLE-1/2 drafters can "
        "read its LM head's input from "
        "output_hidden_states, EAGLE-3's three feature layers, and the engine `headway data "
        "regenerate` answers with. Prints one row per capability (yes/no and how, or the "
        "one-line reason); exit status 0 when headway can decode the target (tree decoding), "
        "1 when it cannot, 2 when the target does not load.",
    )
    add_target_flags(parser, use="decode")
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: the target and its rows (capability, ok, detail)",
    )
    parser.set_defaults(handler=run_check)
