"""Why verifying several tokens costs more than one on a CPU: the target's linear layers timed at
M = 1, 2, 4, 8 rows (SmolLM2-135M shapes by default), in the dtype given.

At M = 1 a linear layer is a matrix-vector product, bound by reading the weights; from M = 2 on it
is a small matrix-matrix product, which CPUs run far below their peak. Prints the median
milliseconds of ``F.linear``, of ``x @ W^T`` with a pre-transposed contiguous weight, and of the
two routes headway's decoding forwards can take (:mod:`headway.decode.gemm`): the transposed
product ``(W · xᵀ)ᵀ`` (1 row padded to 2, as drafters do) and oneDNN's linear on the weight
reordered once (packed; "n/a" where this torch build lacks it). One weight is timed over and
over, so it may sit in cache: whole forwards (``scripts/bench_decode.py``) are the figures to quote.

    .venv/bin/python scripts/bench_matmul.py --dtype float32
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from headway.decode.gemm import packed_linear, packing_available, small_block_linear

SHAPES = [(576, 1536), (1536, 576), (576, 576), (576, 49152)]  # (in, out): MLP, attention, head


def median_ms(function: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``function`` in milliseconds, after three warm-up calls."""
    for _ in range(3):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="float32", help="float32 or bfloat16")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per cell")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, {args.dtype}")
    print("| in x out | M | F.linear ms | x @ W^T ms | (W x^T)^T ms | packed ms |")
    print("|---|---|---|---|---|---|")
    for fan_in, fan_out in SHAPES:
        weight = torch.randn(fan_out, fan_in, dtype=dtype)
        transposed = weight.t().contiguous()
        layer = nn.Linear(fan_in, fan_out, bias=False, dtype=dtype)
        layer.weight.data = weight
        routed = small_block_linear(layer, pad_single=True)
        packed = packed_linear(layer) if packing_available(dtype) else None
        for rows in (1, 2, 4, 8):
            x = torch.randn(1, rows, fan_in, dtype=dtype)
            linear = median_ms(lambda: F.linear(x, weight), args.repeats)  # noqa: B023
            matmul = median_ms(lambda: x @ transposed, args.repeats)  # noqa: B023
            swapped = median_ms(lambda: routed(x), args.repeats)  # noqa: B023
            reordered = (
                "n/a" if packed is None else f"{median_ms(lambda: packed(x), args.repeats):.3f}"  # noqa: B023
            )
            print(
                f"| {fan_in} x {fan_out} | {rows} | {linear:.3f} | {matmul:.3f} | {swapped:.3f} "
                f"| {reordered} |"
            )


if __name__ == "__main__":
    main()
