"""Offline feature caching against the target's plain forward throughput, on the same batches.

Runs the target over the first ``--samples`` samples of the data twice: a plain forward (logits
only, the cost any training step pays for its target pass) and ``cache_features`` (forward with
hidden states, the copy to the feature dtype, safetensors shards written atomically). Prints
tokens/s of both, their ratio, and the bytes per token written.

    .venv/bin/python scripts/bench_features.py --method eagle3 --samples 128
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path

import torch

from headway.cli.data import method_layers
from headway.target import load_target, resolve_dtype
from headway.train.batching import pad_collate
from headway.train.data import build_datasets, pad_id_of
from headway.train.features import cache_features


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument("--dtype", default="float32", help="target weights dtype")
    parser.add_argument(
        "--data", default="data/regenerated/smollm2-v2/data", help="data source (chat rows)"
    )
    parser.add_argument("--method", default="eagle3", help="which layers: medusa1, eagle1, eagle3")
    parser.add_argument("--feature-dtype", default="bfloat16", help="stored feature dtype")
    parser.add_argument("--samples", type=int, default=128, help="samples timed")
    parser.add_argument("--max-length", type=int, default=512, help="tokens per sample")
    parser.add_argument("--batch-size", type=int, default=8, help="samples per forward")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    target = load_target(args.target, dtype=args.dtype, device="auto")
    dataset, _ = build_datasets(target.tokenizer, [args.data], max_length=args.max_length)
    dataset = dataset.select(range(min(args.samples, len(dataset))))
    pad = pad_id_of(target.tokenizer)
    tokens = sum(len(ids) for ids in dataset["input_ids"])
    layers = method_layers(args.method, int(target.model.config.num_hidden_layers))
    batches = [
        pad_collate(
            [dataset[i] for i in range(k, min(k + args.batch_size, len(dataset)))],
            pad_token_id=pad,
        )
        for k in range(0, len(dataset), args.batch_size)
    ]
    with torch.inference_mode():  # warm-up
        target.model(input_ids=batches[0]["input_ids"][:1].to(target.model.device))
    started = time.perf_counter()
    with torch.inference_mode():
        for batch in batches:
            ids = batch["input_ids"].to(target.model.device)
            target.model(input_ids=ids, attention_mask=batch["attention_mask"].to(ids.device))
    plain = tokens / (time.perf_counter() - started)
    with tempfile.TemporaryDirectory() as out:
        started = time.perf_counter()
        manifest = cache_features(
            target.model,
            dataset,
            Path(out),
            layers=layers,
            dtype=resolve_dtype(args.feature_dtype),
            batch_size=args.batch_size,
            pad_token_id=pad,
        )
        cached = tokens / (time.perf_counter() - started)
    print(
        f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; target {args.target} ({args.dtype}); {len(dataset)} samples, "
        f"{tokens:,} tokens, batch {args.batch_size}; layers {layers} as {args.feature_dtype}"
    )
    print(f"plain forward:  {plain:,.0f} tokens/s")
    print(f"cache features: {cached:,.0f} tokens/s ({cached / plain:.0%} of plain)")
    print(f"bytes per token written: {manifest['bytes_per_token']}")


if __name__ == "__main__":
    main()
