"""Training throughput per method on the embedded target: trained tokens/s, before and after, in
one run, and achieved FLOP/s against this machine's measured bf16 matmul peak.

"before" is how the recipes trained until 2026-11-23: padded batches (``data.pack`` was parsed and
never used) and the frozen target's forward in fp32 beside a bf16-autocast drafter. "after" packs
samples into ``max_length`` blocks and runs the target's forward under the same autocast (its LM
head for one row only). "offline" trains the same packed blocks from a feature cache
(``data.features=offline data.pack=true``): no target forward in the step; the one-time caching
is timed and printed apart (cached answer tokens/s), since a cache serves every later epoch and
run. Each variant runs ``--warmup`` optimizer steps, then times ``--steps``; trained tokens are
the tokens with a loss (assistant tokens), the figure a user cares about. The code is today's in
every variant (EAGLE-3's TTT steps >= 1 run only the rows a loss reads, in all three).

FLOP/s counts the work actually done: 2·P·T for the target's forward over every token slot of the
batch (padding included; none offline) and 6·P_trained·R for the drafter (forward and backward;
R = rows run: every slot for Medusa and EAGLE-1, for EAGLE-3 every slot at step 0 and the rows
kept at each later TTT step), with P the parameters that multiply each token. The draft LM head
is counted at every row run, though the loss runs it only on trained rows: an upper bound.

    .venv/bin/python scripts/bench_train.py --methods eagle3,medusa1,eagle1 --steps 4
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from headway.cli.data import cache_method_features
from headway.config import load_config
from headway.hardware import mixed_precision
from headway.run_config import RunConfig
from headway.target import load_target
from headway.train.data import build_datasets
from headway.train.features import OnlineFeatures, cached_hidden
from headway.train.loop_data import training_data
from headway.train.method_eagle3 import Eagle3, ttt_row_count
from headway.train.methods import build_method, feature_layers

RECIPES = {name: f"configs/{name}-smollm2.yaml" for name in ("medusa1", "eagle1", "eagle3")}
# (pack, target autocast, offline features)
VARIANTS = {
    "before": (False, False, False),
    "after": (True, True, False),
    "offline": (True, True, True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default="eagle3,medusa1,eagle1", help="comma-separated")
    parser.add_argument("--data", default="data/regenerated/smollm2-v2/data", help="chat data")
    parser.add_argument("--limit", type=int, default=96, help="conversations read")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps timed")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps not timed")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch")
    parser.add_argument("--device", default="cpu", help="'cpu' or 'cuda' (peak measured there)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def matmul_peak(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> float:
    """FLOP/s of a square matmul in ``dtype`` on ``device`` (best of 20 after a warm-up; 1024 on
    a CPU, 8192 on a GPU; a shared CPU's single timings vary by 2x, so the best of many)."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, dtype=dtype, device=device)
    b = torch.randn(size, size, dtype=dtype, device=device)
    a @ b
    best = float("inf")
    for _ in range(20):
        synchronize(device)
        start = time.perf_counter()
        a @ b
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def multiplying_parameters(module: torch.nn.Module) -> int:
    """Parameters that multiply each token: every weight except embedding tables."""
    embeddings = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    return sum(p.numel() for p in module.parameters() if id(p) not in embeddings)


def drafter_rows(method: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Rows the drafter runs over a batch: every slot, and for EAGLE-3 every slot at TTT step 0
    plus the rows :func:`~headway.train.method_eagle3.ttt_unroll` keeps at each later step."""
    slots = batch["input_ids"].numel()
    if not isinstance(method, Eagle3):
        return slots
    return slots + (method.steps - 1) * ttt_row_count(method.ttt_rows(batch))


def batches(loader: DataLoader[Any]) -> Iterator[dict[str, torch.Tensor]]:
    while True:
        yield from loader


def cache(method_name: str, args: argparse.Namespace, out: Path) -> dict[str, float]:
    """Cache the features the recipe trains on (bf16, as ``headway data cache-features``)."""
    config: RunConfig = load_config(RunConfig, RECIPES[method_name], [f"data.sources={args.data}"])
    target = load_target(config.target.name, dtype=config.target.dtype, device=args.device)
    dataset, _ = build_datasets(
        target.tokenizer, config.data.sources, max_length=config.data.max_length, limit=args.limit
    )
    started = time.perf_counter()
    columns = dataset.select_columns(["input_ids", "loss_mask"])
    manifest = cache_method_features(target, columns, out, method_name)
    seconds = time.perf_counter() - started
    trained = sum(sum(mask) for mask in dataset["loss_mask"])
    return {"seconds": seconds, "trained": trained, "bytes_per_token": manifest["bytes_per_token"]}


def run(
    method_name: str, variant: str, args: argparse.Namespace, features_dir: Path
) -> dict[str, float]:
    pack, target_autocast, offline = VARIANTS[variant]
    overrides = [
        f"data.sources={args.data}",
        f"data.limit={args.limit}",
        f"data.pack={str(pack).lower()}",
        "data.eval_fraction=0",
        "train.log_with=[]",
    ]
    if offline:
        overrides += ["data.features=offline", f"data.features_dir={features_dir}"]
    config: RunConfig = load_config(RunConfig, RECIPES[method_name], overrides)
    target = load_target(config.target.name, dtype=config.target.dtype, device=args.device)
    device = target.model.device
    train_set, _, collate = training_data(config, target)
    torch.manual_seed(0)
    method = build_method(config, target).to(device)
    optimizer = torch.optim.AdamW(method.parameter_groups(config.train.lr, 0.0))  # type: ignore[operator]
    layers = feature_layers(method)
    mixed = mixed_precision(config.train.mixed_precision, device) == "bf16"
    if offline:
        features: Any = partial(cached_hidden, layers=layers)
    else:
        autocast = torch.bfloat16 if mixed and target_autocast else None
        features = OnlineFeatures(target.model, layers, autocast=autocast)
    generator = torch.Generator().manual_seed(0)
    loader = DataLoader(
        train_set,
        batch_size=config.train.batch_size,
        shuffle=True,
        collate_fn=collate,
        generator=generator,
    )
    stream = batches(loader)
    trained = slots = drafted = 0
    started = 0.0
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            synchronize(device)
            started, trained, slots, drafted = time.perf_counter(), 0, 0, 0
        for _ in range(config.train.grad_accum):
            batch = {key: value.to(device) for key, value in next(stream).items()}
            hidden = features(batch) if layers else {}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=mixed):
                output = method(batch, hidden)
            output.loss.backward()
            trained += int(batch["loss_mask"].sum())
            slots += batch["input_ids"].numel()
            drafted += drafter_rows(method, batch)
        optimizer.step()
        optimizer.zero_grad()
    synchronize(device)
    seconds = time.perf_counter() - started
    flops = 0 if offline else 2 * multiplying_parameters(target.model) * slots
    flops += 6 * multiplying_parameters(method) * drafted
    return {"tokens_per_s": trained / seconds, "flops": flops / seconds, "slots": slots,
            "trained": trained, "seconds": seconds}  # fmt: skip


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    peak = matmul_peak(device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine()
    print(
        f"{where}, {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"bf16 matmul peak {peak / 1e9:.0f} GFLOP/s; {args.steps} steps timed per variant"
    )
    for method_name in args.methods.split(","):
        with tempfile.TemporaryDirectory() as features_dir:
            cached = cache(method_name, args, Path(features_dir))
            results = {
                variant: run(method_name, variant, args, Path(features_dir)) for variant in VARIANTS
            }
        print(
            f"{method_name:>8} caching: {cached['trained'] / cached['seconds']:7.0f} trained tok/s "
            f"({cached['trained']:,} trained tokens of {args.limit} conversations, "
            f"{cached['seconds']:.1f} s, {cached['bytes_per_token']} bytes/token; once per data)"
        )
        for variant, result in results.items():
            print(
                f"{method_name:>8} {variant:>7}: {result['tokens_per_s']:7.0f} trained tok/s "
                f"({result['trained']:,} of {result['slots']:,} slots trained, "
                f"{result['seconds']:.1f} s), {result['flops'] / 1e9:6.1f} GFLOP/s = "
                f"{result['flops'] / peak:.0%} of peak"
            )
        before = results["before"]["tokens_per_s"]
        ratios = ", ".join(
            f"{variant} / before {results[variant]['tokens_per_s'] / before:.2f}x"
            for variant in ("after", "offline")
        )
        print(f"{method_name:>8}  trained tokens/s: {ratios}")


if __name__ == "__main__":
    main()
