"""The costs of one EAGLE-3 decoding step on a GPU, in ONE device call (issue #32).

Needs nothing the GPU machine lacks: no prompt sets, no GGUF. The target is a SmolLM2-135M-shaped
Llama with random weights (``scripts/device/smollm2-135m.json``: what a forward costs does not
depend on the weights) and the drafter is the shipped EAGLE-3 (``force``: the random target's
fingerprint differs). Acceptance on such a target is meaningless, so the script measures costs
and predicts the speedup at a given tau (``--tau``, default the shipped drafter's 2.75 on an
H200 in bf16) instead:

- HF greedy with a static cache (``generate(cache_implementation="static")``) and headway's plain
  captured decoding, tokens/s;
- the captured verify forward over 1, 4, 8, 16 tokens (ms);
- one drafting step (propose + observe, averaged over a generation), eager and static-captured
  (``drafting=static``), for the default tree and a chain; whether their trees are the same;
- predicted tokens/s with drafting = tau / (verify(n) + drafting step), against both baselines;
- last, for each ``--verify`` path (captured, then compiled: ``torch.compile`` first), plain
  decoding's tokens/s and the whole device step (``headway/decode/device_step.py``: static
  drafting and verification each one graph, one host read a step) timed end to end, with its
  predicted tokens/s; then, captured at temperature 1.0, plain sampling's tokens/s and the
  sampled device step (lossless rejection on the device), predicted at ``--sampled-tau``;
- the tree sweep, captured, greedy: the device step of each tree in ``--tree-taus`` (a JSON of
  trees and the shipped drafter's tau with each, measured on a CPU with the real target, where
  acceptance does not depend on the device) and its predicted tokens/s, the best tree last: on
  a GPU a deeper, wider tree costs little more a step, so the CPU's default need not be the
  GPU's.

Each table prints, and is written to ``$OUT/step_costs.md`` / ``.json``, as soon as it is
measured. Usage on the machine (one call; ~2 min on an H100):

    PYTHONPATH=. python3 scripts/device/step_costs.py --out "$OUT"

Here (CPU, for a smoke test): ``--device cpu --new-tokens 8 --repeats 1``.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from headway.decode.bench import median_timed, random_model, timed
from headway.decode.captured import StaticForward
from headway.decode.costs import time_in_turn, verify_timer
from headway.decode.generate import Decoder, GenerationResult
from headway.decode.options import DecodeOptions
from headway.decode.sampling import GREEDY, SamplingParams
from headway.drafters.build import build_drafter
from headway.drafters.specs import EagleSpec
from headway.eval.timed_drafter import TimedDrafter
from headway.target import Target

CONFIG = Path(__file__).with_name("smollm2-135m.json")
TREE_TAUS = Path(__file__).with_name("tree_taus.json")
DRAFTER = Path(__file__).resolve().parents[2] / "drafters" / "smollm2-135m-eagle3"
SHAPES = {"tree (top_k 8, depth 4, 16 tokens)": (8, 4, 16), "chain (depth 4)": (1, 4, 5)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--dtype", default="bfloat16", help="target and drafter dtype")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="random prompt length")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per generation")
    parser.add_argument("--repeats", type=int, default=3, help="generations per row (median)")
    parser.add_argument("--tau", type=float, default=2.75, help="tau the prediction assumes")
    parser.add_argument(
        "--sampled-tau",
        type=float,
        default=1.74,
        help="tau at temperature 1.0 the sampled prediction assumes (default: the shipped "
        "drafter's on MT-bench x8, fp32, on a CPU)",
    )
    parser.add_argument(
        "--tree-taus",
        default=str(TREE_TAUS),
        help="JSON of the trees to sweep with the shipped drafter's tau for each, measured on a "
        "CPU ({'trees': [{'top_k', 'depth', 'total_tokens', 'tau'}, ...]}); '' skips the sweep",
    )
    parser.add_argument("--out", default=".", help="folder for step_costs.md and .json")
    parser.add_argument(
        "--verify",
        default="captured,compiled",
        help="verify paths whose device step is timed last (compiled: torch.compile first, "
        "which takes a minute or more per block size on first use)",
    )
    return parser.parse_args(argv)


def warm_up(run: Callable[[], object], device: torch.device) -> None:
    """Call ``run`` once untimed on CUDA (lazy initialisation, graph capture, compiles); on a
    CPU (uncaptured) nothing."""
    if device.type == "cuda":
        run()


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds of ``run``, warmed up once on CUDA (captures, compiles); on a CPU, where
    this script is a smoke test of itself (uncaptured), not: the figures there mean nothing
    and the test suite runs it."""
    return median_timed(run, device, repeats, warm_up=device.type == "cuda")[0]


def recording(drafter: Any) -> list[tuple[list[int], list[int]]]:
    """Make ``drafter`` keep every tree it proposes (tokens, parents); returns that list."""
    recorded: list[tuple[list[int], list[int]]] = []
    inner_propose = drafter.propose

    def propose(sequence: torch.Tensor, floor: float | None = None) -> Any:
        tree = inner_propose(sequence, floor)
        recorded.append((tree.tokens.tolist(), tree.parents.tolist()))
        return tree

    drafter.propose = propose
    return recorded


class Report:
    """Rows printed and written as they come."""

    def __init__(self, out: Path) -> None:
        self.out, self.lines, self.data = out, [], {}  # type: ignore[var-annotated]
        out.mkdir(parents=True, exist_ok=True)

    def add(self, key: str, value: Any, line: str) -> None:
        self.data[key] = value
        self.lines.append(line)
        print(line, flush=True)
        (self.out / "step_costs.md").write_text("\n".join(self.lines) + "\n", encoding="utf-8")
        (self.out / "step_costs.json").write_text(json.dumps(self.data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    model: Any = random_model(CONFIG, device, dtype)  # a CPU: the stock route, none timed
    config = model.config
    target = Target(model=model, tokenizer=None, source="random smollm2-135m")  # type: ignore[arg-type]
    prompt = torch.randint(3, config.vocab_size, (args.prompt_tokens,), device=device)
    new, repeats = args.new_tokens, args.repeats
    report = Report(Path(args.out))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    report.add("machine", name, f"# step costs: {name}, {args.dtype}, torch {torch.__version__}")

    def hf_static() -> object:
        return model.generate(
            prompt[None],
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            cache_implementation="static",
            attention_mask=torch.ones_like(prompt[None]),
        )

    hf = new / median_seconds(hf_static, device, repeats)
    report.add("hf_static_tok_s", hf, f"HF greedy, static cache: {hf:.1f} tok/s")
    captured = Decoder(model, None, DecodeOptions(verify="captured"))

    def plain() -> object:
        return captured.generate(prompt, max_new_tokens=new, eos_token_ids=())

    base = new / median_seconds(plain, device, repeats)
    report.add("plain_captured_tok_s", base, f"headway, no drafter, captured: {base:.1f} tok/s")
    timer = verify_timer(model, args.prompt_tokens, forward=StaticForward(model))
    verify = time_in_turn(timer, [1, 4, 8, 16], max(repeats, 1))  # as cost tables are timed
    shown = ", ".join(f"{n}: {s * 1000:.2f}" for n, s in verify.items())
    report.add("verify_ms", {n: s * 1000 for n, s in verify.items()}, f"verify ms: {shown}")
    for label, (top_k, depth, total) in SHAPES.items():
        costs, trees = {}, {}
        for drafting in ("eager", "static"):
            spec = EagleSpec(
                heads=str(DRAFTER),
                top_k=top_k,
                depth=depth,
                total_tokens=total,
                drafting=drafting,
                dtype="target",  # as on a GPU: a CPU's int8 draft layers would change the trees
                force=True,
            )
            timed = TimedDrafter(build_drafter(spec, target), device)
            recorded = recording(timed.inner)
            host_steps = DecodeOptions(verify="captured", device_trees=False)  # timed per part
            decoder = Decoder(model, timed, host_steps)
            warm_up(generation(decoder, prompt, new), device)  # capture
            timed.reset()
            recorded.clear()
            decoder.generate(prompt, max_new_tokens=new, eos_token_ids=())
            costs[drafting] = timed.seconds / max(timed.steps, 1)
            trees[drafting] = list(recorded)
        same = sum(a == b for a, b in zip(trees["eager"], trees["static"], strict=False))
        step = verify[16] if total > 8 else verify[8 if total > 4 else 4]
        line = (
            f"{label}: drafting a step eager {costs['eager'] * 1000:.2f} ms, static captured "
            f"{costs['static'] * 1000:.2f} ms; trees equal {same}/{len(trees['eager'])}; "
            + "; ".join(
                f"predicted at tau {args.tau} with {mode} drafting: "
                f"{args.tau / (step + cost):.1f} tok/s = "
                f"{args.tau / (step + cost) / base:.2f}x plain captured, "
                f"{args.tau / (step + cost) / hf:.2f}x HF static"
                for mode, cost in costs.items()
            )
        )
        report.add(f"drafting_ms[{label}]", {k: v * 1000 for k, v in costs.items()}, line)
    for verify_path in args.verify.split(","):
        plain_path = Decoder(model, None, DecodeOptions(verify=verify_path))
        run = generation(plain_path, prompt, new)
        warm_up(run, device)  # compile, capture
        rate = new / median_seconds(run, device, repeats)
        report.add(
            f"plain_tok_s[{verify_path}]",
            rate,
            f"headway, no drafter, {verify_path}: {rate:.1f} tok/s = {rate / hf:.2f}x HF static",
        )
        for label, shape in SHAPES.items():
            step = device_step_seconds(model, target, prompt, shape, new, verify_path) * 1000
            line = (
                f"{label}, {verify_path}: a device step (static drafting and verification, each "
                f"one graph, one host read) {step:.2f} ms; predicted at tau {args.tau}: "
                f"{args.tau / step * 1000:.1f} tok/s = {args.tau / step * 1000 / base:.2f}x "
                f"plain captured, {args.tau / step * 1000 / hf:.2f}x HF static"
            )
            report.add(f"device_step_ms[{label}, {verify_path}]", step, line)
        if verify_path == "captured":
            sampled_rows(report, args, model, target, prompt)
            tree_rows(report, args, model, target, prompt, {"plain captured": base, "HF": hf})


def sampled_rows(
    report: Report, args: argparse.Namespace, model: Any, target: Target, prompt: torch.Tensor
) -> None:
    """At temperature 1.0, captured: plain sampling's tokens/s and the sampled device step of the
    default tree (lossless rejection on the device), predicted at ``--sampled-tau``."""
    new, device = args.new_tokens, prompt.device
    params = SamplingParams(temperature=1.0)
    plain = Decoder(model, None, DecodeOptions(verify="captured"))
    run = generation(plain, prompt, new, params)
    warm_up(run, device)  # capture
    rate = new / median_seconds(run, device, args.repeats)
    line = f"headway, no drafter, captured, temperature 1.0: {rate:.1f} tok/s"
    report.add("plain_sampled_tok_s", rate, line)
    shape = next(iter(SHAPES.values()))
    step = device_step_seconds(model, target, prompt, shape, new, "captured", params) * 1000
    tau = args.sampled_tau
    line = (
        f"default tree, captured, temperature 1.0: a sampled device step {step:.2f} ms; "
        f"predicted at tau {tau}: {tau / step * 1000:.1f} tok/s = "
        f"{tau / step * 1000 / rate:.2f}x plain captured sampling"
    )
    report.add("sampled_device_step_ms", step, line)


def tree_rows(
    report: Report,
    args: argparse.Namespace,
    model: Any,
    target: Target,
    prompt: torch.Tensor,
    baselines: dict[str, float],
) -> None:
    """Captured, greedy: each tree of ``--tree-taus`` through the device step, its step timed
    here and its tokens/s predicted at the tau measured for it on a CPU (against each of
    ``baselines``, name -> tokens/s); the best tree last."""
    if not args.tree_taus or not Path(args.tree_taus).is_file():
        report.add("best_tree", None, f"tree sweep skipped: no tree file {args.tree_taus!r}")
        return
    trees = json.loads(Path(args.tree_taus).read_text(encoding="utf-8"))["trees"]
    rates: dict[tuple[int, int, int], float] = {}
    for tree in trees:
        shape = (int(tree["top_k"]), int(tree["depth"]), int(tree["total_tokens"]))
        step = device_step_seconds(model, target, prompt, shape, args.new_tokens)
        rates[shape] = tree["tau"] / step
        against = ", ".join(
            f"{rates[shape] / rate:.2f}x {name}" for name, rate in baselines.items()
        )
        line = (
            f"tree top_k {shape[0]}, depth {shape[1]}, {shape[2]} tokens (tau {tree['tau']:.2f} "
            f"on a CPU): a device step {step * 1000:.2f} ms, predicted "
            f"{rates[shape]:.1f} tok/s = {against}"
        )
        report.add(f"tree_tok_s[{shape[0]},{shape[1]},{shape[2]}]", rates[shape], line)
    best = max(rates, key=rates.__getitem__)
    line = f"best tree here: top_k {best[0]}, depth {best[1]}, {best[2]} tokens"
    report.add("best_tree", list(best), line)


def generation(
    decoder: Decoder, prompt: torch.Tensor, new: int, sampling: SamplingParams = GREEDY
) -> Callable[[], GenerationResult]:
    """One generation of ``new`` tokens after ``prompt`` through ``decoder``, as a call to
    time; sampled draws come from a generator on the prompt's device, seeded 0 once."""
    generator = torch.Generator(prompt.device).manual_seed(0)
    return functools.partial(
        decoder.generate,
        prompt,
        max_new_tokens=new,
        eos_token_ids=(),
        sampling=sampling,
        generator=generator,
    )


def device_step_seconds(
    model: Any,
    target: Target,
    prompt: torch.Tensor,
    shape: tuple[int, int, int],
    new: int,
    verify: str = "captured",
    sampling: SamplingParams = GREEDY,
) -> float:
    """Seconds per step of decoding (``sampling``, greedy by default) through the device step
    (headway/decode/device_step.py) with the static drafter of ``shape`` (top_k, depth,
    total_tokens): the whole step, drafting, verification, acceptance and the host's
    bookkeeping included."""
    top_k, depth, total = shape
    spec = EagleSpec(
        heads=str(DRAFTER),
        top_k=top_k,
        depth=depth,
        total_tokens=total,
        drafting="static",
        force=True,
    )
    options = DecodeOptions(verify=verify)  # type: ignore[arg-type]
    decoder = Decoder(model, build_drafter(spec, target), options)
    run = generation(decoder, prompt, new, sampling)
    warm_up(run, prompt.device)  # capture
    result, seconds = timed(run, prompt.device)
    return seconds / max(len(result.accept_lengths) - 1, 1)


if __name__ == "__main__":
    main()
