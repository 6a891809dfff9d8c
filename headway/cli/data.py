"""``headway data``: inspect, regenerate and cache training data."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from headway.cli.common import add_target_flags, target_from_flags
from headway.cli.data_server import add_server_flags, local_target, server_from_flags
from headway.cli.data_stats import add_stats
from headway.cli.data_vocab import add_vocab
from headway.cli.values import NON_NEGATIVE, POSITIVE, SEED, TEMPERATURE, TOP_P, layer_list, text
from headway.errors import HeadwayError

if TYPE_CHECKING:
    from datasets import Dataset

    from headway.target import Target


def run_inspect(args: argparse.Namespace) -> int:
    from headway.train.data import inspect_samples

    target = target_from_flags(args)
    color = sys.stdout.isatty() and not args.no_color
    text = inspect_samples(
        target.tokenizer,
        args.data,
        n=args.n,
        max_length=args.max_length,
        color=color,
        loop_repeats=args.loop_repeats,
    )
    print(text)
    return 0


DEFAULT_MIX = "chitchat:2500,code:1200,instruct:1500,self-instruct:1500"
# Mirrors headway.train.prompts.DEFAULT_MAX_PROMPT_CHARS (not imported: the CLI loads lazily).
DEFAULT_MAX_PROMPT_CHARS = 4000


def run_regenerate(args: argparse.Namespace) -> int:
    from headway.train.prior_folders import earlier_turns, frozen_prompt_ids
    from headway.train.prompts import build_mix, parse_mix
    from headway.train.regenerate import RegenerateOptions, prompts_path, regenerate

    mix = parse_mix(args.mix)
    options = RegenerateOptions(
        max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        shard_size=args.shard_size,
        engine=args.engine,
        lookahead=args.lookahead,
        stop_loops=args.stop_loops,
    )
    server = server_from_flags(args)
    if server is None:
        target: Target | None = target_from_flags(args)
    else:
        target = local_target(args, target_from_flags) if args.server_check == "greedy" else None
    # A folder being resumed has its prompt list frozen (and its manifest checks that --mix and
    # the other settings are unchanged): the source packages are not needed to go on.
    resuming = prompts_path(Path(args.out)).is_file()
    items = []
    if not resuming:
        exclude = frozenset().union(*(frozen_prompt_ids(Path(f)) for f in args.exclude))
        items = build_mix(
            mix,
            seed=args.seed,
            max_turns=args.max_turns,
            min_turns=args.min_turns,
            max_prompt_chars=args.max_prompt_chars,
            exclude=exclude,
            earlier=earlier_turns([Path(f) for f in args.continue_from])
            if args.continue_from
            else None,
        )
    manifest = regenerate(
        target,
        items,
        Path(args.out),
        options,
        mix=mix,
        server=server,
        continued_from=args.continue_from,
    )
    print(
        f"{manifest['rows']} conversations, {manifest['answer_tokens']:,} answer tokens "
        f"({manifest['truncated_answers']} hit max-new-tokens) in {args.out}/data; "
        f"sources: {manifest['sources']}"
    )
    return 0


def _add_regenerate(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "regenerate",
        help="answer a prompt mix with the target itself (self-distillation data)",
        description="Build a prompt mix and let the target answer every prompt, writing "
        "resumable JSONL shards to --out/data (loadable with data.sources). Rerun the same "
        "command to resume after an interruption: finished shards are kept, none is redone.",
    )
    add_target_flags(parser, use="data")
    parser.add_argument(
        "--out", required=True, type=text("--out"), help="output folder (created; resumable)"
    )
    parser.add_argument(
        "--mix",
        default=DEFAULT_MIX,
        help="SOURCE:COUNT list; sources: sharegpt (ShareGPT V3 user turns, MT-bench and "
        "HumanEval prompts removed), chitchat, code (stdlib functions), instruct (templated "
        "tasks), self-instruct (prompts the target writes), or a chat data file",
    )
    parser.add_argument("--max-new-tokens", type=POSITIVE, default=512, help="answer length cap")
    parser.add_argument(
        "--batch-size",
        type=POSITIVE,
        default=64,
        help="rows generated together (batch: rows kept busy, finished ones replaced by "
        "waiting prompts; generate: a padded batch). The key/value cache holds every row at "
        "the longest row's width: on a CPU a growth the free memory cannot hold stops the run "
        "in one line (rerun with a smaller batch; it resumes from the last shard)",
    )
    parser.add_argument(
        "--engine",
        choices=["auto", "generate", "batch"],  # answering.ENGINES (lazy CLI)
        default="auto",
        help="batch: headway generate --batch's engine (one static cache, prompt-lookup trees "
        "sized by their measured cost, finished rows replaced by waiting prompts, CUDA graphs "
        "on a GPU; a conversation's next turn continues from the keys/values its turn before "
        "left; on a 2-core EPYC, bf16, three ShareGPT turns: 219 answer tok/s, 1.08x the "
        "continuous engine it replaced, scripts/bench_regenerate.py, docs/benchmarks.md); "
        "generate: HF generate on padded batches; auto (the default): batch, or generate for "
        "a target it refuses (recurrent layers such as Qwen3.5's or Mamba's; headway check "
        "says which). Either may be used to resume a folder",
    )
    parser.add_argument(
        "--lookahead",
        type=NON_NEGATIVE,
        default=None,
        help="batch engine: the most nodes of the tree each row drafts per step by looking up "
        "its own prompt and answer, verified in the same forward so the answers are unchanged "
        "(0 = one token per step); each step's trees are cut to the size the step's measured "
        "cost pays for. Default: prompt lookup's own tree (8 nodes)",
    )
    parser.add_argument(
        "--stop-loops",
        type=NON_NEGATIVE,
        default=0,
        metavar="N",
        help="end an answer at its first token past N periods of a repetition loop (finish "
        "reason 'loop'): greedy answers of small targets often repeat a line until "
        "--max-new-tokens, and those tails teach a drafter nothing prompt lookup does not "
        "draft; 0 (the default) lets answers run",
    )
    parser.add_argument("--temperature", type=TEMPERATURE, default=0.0, help="0 = greedy answers")
    parser.add_argument("--top-p", type=TOP_P, default=1.0, help="nucleus threshold if sampling")
    parser.add_argument("--seed", type=SEED, default=0, help="seed of the mix and the sampling")
    parser.add_argument("--shard-size", type=POSITIVE, default=256, help="conversations per shard")
    parser.add_argument(
        "--max-turns",
        type=POSITIVE,
        default=1,
        help="user turns regenerated per chat conversation, each answered after the target's "
        "own earlier answers",
    )
    parser.add_argument(
        "--min-turns",
        type=POSITIVE,
        default=1,
        help="leave out chat conversations with fewer usable user turns (e.g. 2 with "
        "--max-turns 4: only conversations that go on, when another folder answered the "
        "first turns)",
    )
    parser.add_argument(
        "--max-prompt-chars",
        type=POSITIVE,
        default=DEFAULT_MAX_PROMPT_CHARS,
        help="leave out chat conversations whose first user turn is longer (later turns stop "
        "at the first longer one)",
    )
    parser.add_argument(
        "--exclude",
        nargs="+",
        default=[],
        metavar="FOLDER",
        help="leave out the chat conversations these regeneration folders answer (their frozen "
        "prompt lists), e.g. to answer the rest of ShareGPT in a second folder; read only when "
        "the folder is started, not on a resume",
    )
    parser.add_argument(
        "--continue-from",
        nargs="+",
        default=[],
        metavar="FOLDER",
        help="answer the later user turns of the chat conversations these regeneration folders "
        "answered, after the answers they wrote (e.g. turns 4-6 with --max-turns 6 after a "
        "--max-turns 3 folder): only conversations that go on are asked; the earlier answers "
        "are written as context ('weight': 0) and not trained again; read only when the "
        "folder is started, not on a resume",
    )
    add_server_flags(parser)
    parser.set_defaults(handler=run_regenerate)


def run_cache_features(args: argparse.Namespace) -> int:
    from headway.target import resolve_dtype
    from headway.train.data import build_datasets

    target = target_from_flags(args)
    dataset, reports = build_datasets(
        target.tokenizer,
        args.data,
        max_length=args.max_length,
        limit=args.limit,
        skip_bad_rows=args.skip_bad_rows,
        loop_repeats=args.loop_repeats,
    )
    for report in reports:
        print(report.summary())
    manifest = cache_method_features(
        target,
        dataset,
        Path(args.out),
        args.method,
        layers=args.layers,
        dtype=resolve_dtype(args.feature_dtype),
        batch_size=args.batch_size,
        shard_samples=args.shard_samples,
    )
    print(
        f"{manifest['tokens']:,} tokens, {manifest['bytes'] / 2**20:.1f} MiB "
        f"({manifest['bytes_per_token']} bytes/token), layers {manifest['settings']['layers']}, "
        f"in {args.out}"
    )
    return 0


def cache_method_features(
    target: Target,
    dataset: Dataset,
    out: Path,
    method: str,
    *,
    layers: list[int] | None = None,
    **options: Any,
) -> dict[str, Any]:
    """`headway data cache-features`' cache of the tokenized `dataset` for `method`: its layers
    (:func:`method_layers`, unless `layers` are given) and, for EAGLE-3, the target's argmax per
    token; `options` go to :func:`~headway.train.features.cache_features`. Returns the manifest."""
    from headway.train.data import pad_id_of
    from headway.train.features import cache_features

    num_layers = int(target.model.config.get_text_config().num_hidden_layers)
    layers = layers or method_layers(method, num_layers)
    if max(layers) > num_layers:
        raise HeadwayError(
            f"--layers {','.join(map(str, layers))}: the target has {num_layers} layers, so "
            f"indices into output_hidden_states go from 0 to {num_layers}"
        )
    return cache_features(
        target.model,
        dataset,
        out,
        layers=layers,
        pad_token_id=pad_id_of(target.tokenizer),
        target_argmax=method == "eagle3",
        **options,
    )


def method_layers(method: str, num_layers: int) -> list[int]:
    """The ``output_hidden_states`` indices a method trains on: the last (the LM head's input)
    for Medusa and EAGLE-1; the three taps plus the last for EAGLE-3."""
    if method == "eagle3":
        from headway.heads.eagle3 import default_feature_layers

        return [*default_feature_layers(num_layers), num_layers]
    return [num_layers]


def _add_cache_features(actions: argparse._SubParsersAction) -> None:
    parser = actions.add_parser(
        "cache-features",
        help="write the target's hidden states to safetensors shards (offline training)",
        description="Run the frozen target once over the data and store the hidden states a "
        "drafter trains on; train with data.features=offline data.features_dir=OUT. Rerun the "
        "same command to resume after an interruption.",
    )
    add_target_flags(parser)
    parser.add_argument(
        "--data",
        nargs="+",
        default=["chitchat"],
        help="data sources: chitchat, sharegpt, or .jsonl/.jsonl.gz/.json/.parquet files",
    )
    parser.add_argument(
        "--out", required=True, type=text("--out"), help="output folder (resumable)"
    )
    parser.add_argument(
        "--method",
        default="medusa1",
        choices=["medusa1", "medusa2", "eagle1", "eagle3"],
        help="cache the layers this method trains on (eagle3: the three taps and the last, and "
        "the target's argmax at each token, so its loss runs the target's head over the draft "
        "vocabulary only)",
    )
    parser.add_argument(
        "--layers",
        type=layer_list,
        help="comma-separated indices into output_hidden_states (0 = embeddings, L = after the "
        "last layer), overriding --method",
    )
    parser.add_argument(
        "--feature-dtype",
        default="bfloat16",
        choices=["bfloat16", "float16", "float32"],
        help="dtype the features are stored in",
    )
    parser.add_argument("--max-length", type=POSITIVE, default=1024, help="tokens per sample")
    parser.add_argument(
        "--limit", type=POSITIVE, help="use at most this many conversations per source"
    )
    parser.add_argument("--batch-size", type=POSITIVE, default=8, help="samples per target forward")
    parser.add_argument(
        "--shard-samples",
        type=POSITIVE,
        default=256,
        help="samples per shard (the unit of resuming, and of splitting across the processes of "
        "an accelerate launch)",
    )
    parser.add_argument("--skip-bad-rows", action="store_true", help="skip malformed rows")
    _add_loop_repeats(parser)
    parser.set_defaults(handler=run_cache_features)


def _add_loop_repeats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--loop-repeats",
        type=NON_NEGATIVE,
        default=0,
        metavar="N",
        help="take an answer's repetition loops out of the samples after their first N periods "
        "(what followed the loop follows them), as data.loop_repeats does in training; 0 (the "
        "default) keeps every token",
    )


def add_data(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "data", help="inspect, regenerate and cache training data; rank its tokens"
    )
    actions = parser.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    inspect = actions.add_parser(
        "inspect",
        help="show rendered samples with the trained (loss-masked) tokens marked",
        description="Render samples through the target's chat template and mark the tokens "
        "the drafter is trained on (green, or [[...]] without colour).",
    )
    add_target_flags(inspect)
    inspect.add_argument(
        "--data",
        default="chitchat",
        help="an embedded corpus (chitchat, sharegpt) or a .jsonl/.jsonl.gz/.json/.parquet file",
    )
    inspect.add_argument("--n", type=POSITIVE, default=1, help="number of samples to show")
    inspect.add_argument("--max-length", type=POSITIVE, default=1024, help="truncate samples here")
    inspect.add_argument("--no-color", action="store_true", help="mark with [[ ]] instead")
    _add_loop_repeats(inspect)
    inspect.set_defaults(handler=run_inspect)
    _add_regenerate(actions)
    _add_cache_features(actions)
    add_vocab(actions)
    add_stats(actions)
