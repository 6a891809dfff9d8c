"""Teacher-forced acceptance of trained heads on a prompt set: the training loss's own metrics
(top-1 per head or TTT step, the draft vocabulary's coverage, tau_sim) over the target's greedy
answers to the prompts, per category.

Held-out tau_sim in a run's ``eval.jsonl`` is measured on answers like its training data; this
measures it on the prompts a speedup is reported for (MT-bench by default), without decoding, so
a drafter's weak domains show before a ``compare.py`` run. The answers are the target's own greedy
continuations (fp32), the same text a greedy ``compare.py`` run verifies.

    .venv/bin/python scripts/teacher_forced.py drafters/smollm2-135m-eagle3 --threads 2
    .venv/bin/python scripts/teacher_forced.py runs/medusa1-smollm2 --prompts humaneval
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from tqdm.auto import tqdm

from headway.api import prompt_ids
from headway.config import load_config
from headway.eval.turns import asked_turns
from headway.evalsets import load_prompts
from headway.heads.loading import find_heads
from headway.run_config import RunConfig
from headway.target import DEFAULT_TARGET, load_target
from headway.train.curves import simulated_tau
from headway.train.features import OnlineFeatures
from headway.train.methods import build_method, feature_layers


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("heads", help="a run folder or an export (Medusa-1, EAGLE-1 or EAGLE-3)")
    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model (default embedded)")
    parser.add_argument(
        "--prompts", default="mt-bench", help="mt-bench, mt-bench-turns, humaneval or a .jsonl"
    )
    parser.add_argument("--num-prompts", type=int, help="an even spread of this many (default all)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="greedy answer length")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch")
    parser.add_argument("--json", help="also write the per-category metrics here")
    return parser.parse_args()


def mean(rows: Sequence[Mapping[str, float]]) -> dict[str, float]:
    return {key: sum(row[key] for row in rows) / len(rows) for key in rows[0]}


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    target = load_target(args.target, dtype="float32", device="cpu")
    found = find_heads(args.heads, target.model)
    overrides = [f"train.method={found.method}", f"train.init_from={args.heads}"]
    vocab = getattr(found.config, "draft_vocab_size", None)
    if found.method == "eagle3" and vocab:  # the run's vocabulary is the drafter's
        overrides.append(f"eagle3.draft_vocab_size={vocab}")
    method = build_method(load_config(RunConfig, None, overrides), target).eval()
    layers = feature_layers(method)
    features = OnlineFeatures(target.model, layers)
    by_category: dict[str, list[dict[str, float]]] = defaultdict(list)
    prompts = asked_turns(
        target, load_prompts(args.prompts, limit=args.num_prompts), args.max_new_tokens
    )
    for prompt in tqdm(prompts, desc="teacher-forced", unit="prompt"):
        ids = prompt_ids(target, prompt.chat_input(), chat=prompt.chat)
        with torch.no_grad():
            answer = target.model.generate(  # type: ignore[operator]
                ids[None], max_new_tokens=args.max_new_tokens, do_sample=False
            )[0]
            trained = torch.zeros_like(answer)
            trained[len(ids) :] = 1
            batch = {
                "input_ids": answer[None],
                "attention_mask": torch.ones_like(answer)[None],
                "loss_mask": trained[None],
            }
            output = method(batch, features(batch))
        by_category[prompt.category].append({k: float(v) for k, v in output.metrics.items()})
    every = [row for rows in by_category.values() for row in rows]
    table = {**{name: mean(rows) for name, rows in by_category.items()}, "all": mean(every)}
    print(f"{args.heads} on {len(prompts)} {args.prompts} prompts, {args.max_new_tokens} tokens")
    print(f"{'category':>12} {'n':>3} {'top-1 (step 1)':>15} {'in vocab':>9} {'tau_sim':>8}")
    for name, metrics in table.items():
        count = len(every) if name == "all" else len(by_category[name])
        first = metrics.get("depth1/top1", metrics.get("head1/top1", float("nan")))
        coverage = metrics.get("in_vocab", 1.0)
        tau = simulated_tau(metrics) or float("nan")
        print(f"{name:>12} {count:>3} {first:>15.3f} {coverage:>9.3f} {tau:>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
