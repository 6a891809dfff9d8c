"""The CPU proxy for a batch's drafting cost on a GPU (``headway/eval/dispatch.py``): device ops
dispatched eagerly (each at least one kernel launch on CUDA) and host reads a step, for one EAGLE
drafter per row against one draft model drafting every row at once
(:class:`~headway.drafters.batch_eagle.BatchEagle`, uncaptured here: on CUDA its tree step is
one graph), over ``--num-prompts`` MT-bench prompts decoded as one batch (greedy, every step
sending the whole trees, so both ways draft the same steps).

    .venv/bin/python scripts/batch_proxy.py --num-prompts 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from headway.api import prompt_ids
from headway.decode import batch_sizer
from headway.decode.batch_decode import decode_batch
from headway.decode.batch_drafting import BatchDrafter, RowDrafters, Tree
from headway.drafters.batch_eagle import BatchEagle
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.eagle_drafter import EagleDrafter
from headway.drafters.shipped import default_heads
from headway.eval.dispatch import DispatchCounter
from headway.eval.dispatch_decoding import seeds_of
from headway.evalsets import load_prompts
from headway.target import load_target


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument("--heads", default="", help="EAGLE drafter folder (default: the shipped)")
    parser.add_argument("--num-prompts", type=int, default=8, help="MT-bench prompts, one batch")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens per prompt")
    parser.add_argument("--out", type=Path, help="folder for batch_proxy.md")
    return parser.parse_args(argv)


class Counted:
    """A :class:`BatchDrafter` whose drafting is counted: eager device ops and host reads of
    every :meth:`propose` and of every :meth:`observe` after the prompts'."""

    def __init__(self, inner: BatchDrafter, model: Any) -> None:
        self.inner, self.model = inner, model
        self.hidden_layers, self.max_nodes = inner.hidden_layers, inner.max_nodes
        self.totals = {"propose": [0, 0, 0], "observe": [0, 0, 0]}  # calls, launches, reads
        self.observed = 0

    @property
    def drafts(self) -> bool:
        return self.inner.drafts

    def begin(self, prompts: Sequence[Tensor]) -> None:
        self.inner.begin(prompts)

    def keep_rows(self, rows: Sequence[int]) -> None:
        self.inner.keep_rows(rows)

    def add_rows(self, prompts: Sequence[Tensor]) -> None:
        self.inner.add_rows(prompts)

    def _count(self, name: str, call: Callable[[], Any], extra: Sequence[Tensor]) -> Any:
        tensors, devices = seeds_of(self.inner, 4, every_tensor=True)
        counter = DispatchCounter([*tensors, *extra, *self.model.parameters()], devices)
        with counter:
            result = call()
        total = self.totals[name]
        total[0] += 1
        total[1] += counter.counts.launches
        total[2] += counter.counts.syncs
        return result

    def observe(self, kept: Sequence[list[int]], states: tuple[Tensor, ...]) -> None:
        self.observed += 1
        if self.observed == 1:  # the prompts' pairs: once a batch, not a step
            self.inner.observe(kept, states)
            return
        self._count("observe", lambda: self.inner.observe(kept, states), states)

    def propose(self, sequences: Sequence[list[int]], live: Sequence[bool]) -> list[Tree]:
        trees: list[Tree] = self._count("propose", lambda: self.inner.propose(sequences, live), ())
        return trees


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target = load_target(args.target, dtype="float32", device="cpu")
    folder = args.heads or default_heads(target.model)
    if not folder:
        raise SystemExit("no EAGLE drafter for this target: pass --heads DIR")
    spec = spec_for(heads=folder)
    texts = load_prompts("mt-bench", limit=args.num_prompts)
    prompts = [prompt_ids(target, text.text, chat=text.chat) for text in texts]
    batch = len(prompts)
    eagles = [build_drafter(spec, target) for _ in range(batch + 1)]
    if not all(isinstance(drafter, EagleDrafter) for drafter in eagles):
        raise SystemExit(f"{folder} is not an EAGLE drafter")
    ways: dict[str, BatchDrafter] = {
        "one EAGLE drafter per row": RowDrafters(eagles[:batch]),
        "every row at once (BatchEagle)": BatchEagle(eagles[batch], batch),  # type: ignore[arg-type]
    }
    batch_sizer.BatchSizer.nodes = lambda self, parents, drafting=0.0: self.steps.max_depth  # type: ignore[method-assign]
    batch_sizer.PLAIN_EVERY = 10**9  # every step drafts whole trees: both ways the same steps
    lines = [
        f"{batch} MT-bench prompts as one batch, {args.max_new_tokens} new tokens, fp32 on CPU, "
        f"{folder}",
        "",
        "| drafting | steps | eager ops a step (trees) | eager ops a step (learning) | "
        "host reads a step |",
        "|---|---|---|---|---|",
    ]
    outputs = []
    for name, drafting in ways.items():
        counted = Counted(drafting, target.model)
        with torch.inference_mode():
            rows = decode_batch(
                target.model, prompts, counted, max_new_tokens=args.max_new_tokens, capture=False
            )
        outputs.append([row.tokens for row in rows])
        (calls, ops, reads), (learned, learn_ops, learn_reads) = counted.totals.values()
        lines.append(
            f"| {name} | {calls} | {ops / max(calls, 1):.0f} | {learn_ops / max(learned, 1):.0f} "
            f"| {(reads + learn_reads) / max(calls, 1):.1f} |"
        )
        print(lines[-1], flush=True)
    lines += ["", f"outputs equal both ways: {outputs[0] == outputs[1]}"]
    print("\n".join(lines))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "batch_proxy.md").write_text("\n".join(lines) + "\n")
    return 0 if outputs[0] == outputs[1] else 1


if __name__ == "__main__":
    raise SystemExit(main())
