"""Issue #32's decoding figures with the real target, in ONE device call.

The rows the issue asks for, and no others (each eager row costs tens of seconds of scarce
device time): HF greedy with a static cache (transformers compiles its decoding forward on
CUDA), headway's plain captured decoding, and the shipped EAGLE-3 drafter through the device
step (static drafting and the captured verify, each one CUDA graph, one host read a step; what
``headway generate`` runs on a GPU) for each tree of ``--trees``; the cost-sized host step for
comparison. Rows are interleaved prompt by prompt (``headway.eval.paired.measure``) and tau is
pooled over the prompts (accepted tokens over verify steps). Every speedup is against both best
plain decoders of the same run; each row also says how many CUDA graphs it captured (a row that
captures again and again is slow for it). Sections, each printed and written to
``OUT/decode_figures.md`` (and ``.json``) as soon as it is measured, the later ones skipped once
``--budget-s`` is spent:

1. bfloat16, greedy: plain captured decoding a host read a token (the default) and 8 tokens a
   run (``DecodeOptions.chain``: one step's graph replayed 8 times, one read), the trees of
   ``--trees`` (a read a step, the default), the first tree 8 steps a run, the cost-sized
   host step;
2. float32, greedy: HF's eager greedy (``generate(do_sample=False)``: the reference every row
   must equal) and its static-cache greedy (which transformers compiles on CUDA), plain
   captured decoding (one and 8 tokens a run), the default and the largest tree, the default
   tree 8 steps a run (on 2026-11-27 the chained rows gave 3/8 and 7/8 of HF's answers: a run
   and a single step shared their outputs; ``tests/test_device_chain.py``);
3. bfloat16, temperature 1.0: plain captured sampling against the sampled device step (the
   first tree uncoupled, then coupled to the target's noise as decoding runs it; the last tree,
   and :data:`SAMPLED_WIDE`'s wider root);
4. bfloat16, ``--verify compiled`` (``torch.compile`` first: a minute or more per block size;
   the drafter's step forwards compiled too, as ``headway generate`` runs them), the default
   tree a read a step and 8 steps a run;
5. profile: one answer of plain captured decoding and of the device step (bf16) under
   ``torch.profiler``: wall and GPU-busy time a step, the operator tables as files.

On the machine (``scripts/device/README.md``; the prompts as a JSONL written here, since the
MT-bench package does not travel):

    PYTHONPATH=. python3 scripts/device/decode_figures.py --prompts P.jsonl --out "$OUT"

Here (CPU, uncaptured: a smoke test, ``tests/test_device_scripts.py``): ``--device cpu
--num-prompts 1 --max-new-tokens 8 --trees 16``.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch

from headway.api import prompt_ids
from headway.decode import captured
from headway.decode.captured import record_graph
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters import static_eagle
from headway.drafters.build import build_drafter
from headway.drafters.resolve import STATIC_TREE
from headway.drafters.specs import EagleSpec
from headway.eval.baselines import Runner, hf_runner
from headway.eval.cost_tables import CostTables
from headway.eval.paired import Row, measure, table, warm_up
from headway.eval.speed import EvalSettings, drafter_runner
from headway.evalsets import load_prompts
from headway.target import Target, load_target

ROOT = Path(__file__).resolve().parents[2]
DRAFTER = ROOT / "drafters" / "smollm2-135m-eagle3"
TREE_TAUS = Path(__file__).with_name("tree_taus.json")
HF_STATIC, PLAIN = "hf greedy, static cache", "headway, no drafter, captured"
HF_EAGER = "hf greedy (generate, dynamic cache)"
SAMPLED_WIDE = (16, 4, 64)
"""A sampled row's extra tree (top_k, depth, tokens): at temperature 1.0 the first position's
acceptance is the target's probability mass over the root's children, so a wider root pays
there. On the AVX2 EPYC (fp32, MT-bench x8, 128 tokens, 2026-11-28, docs/benchmarks.md): tau
2.12 with this tree against 1.95 with top_k 8 at 64 tokens and 1.89-1.94 at 32 tokens."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="smollm2-135m", help="target model (default embedded)")
    parser.add_argument("--drafter", default=str(DRAFTER), help="the EAGLE drafter folder")
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (smoke test)")
    parser.add_argument("--prompts", default="mt-bench", help="mt-bench, humaneval or a .jsonl")
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts, spread over the set")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt")
    parser.add_argument(
        "--trees",
        default=f"{STATIC_TREE['total_tokens']},16,64",
        help="tree budgets (total_tokens) of the bfloat16 rows, each with its top_k and depth "
        f"from {TREE_TAUS.name}; the first (default: the GPU's default tree, STATIC_TREE) is "
        "also the tree of the float32, sampled, profile and compiled rows, beside the last",
    )
    parser.add_argument(
        "--sections",
        default="bfloat16,float32,sampled,compiled,profile",
        help="what to measure, in order: bfloat16, float32, sampled, compiled, profile (one "
        "answer of plain captured decoding and of the device step under torch.profiler)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=420.0,
        help="seconds after which no further section starts (a call killed at its limit brings "
        "nothing back)",
    )
    parser.add_argument("--out", default=".", help="folder for decode_figures.md and .json")
    return parser.parse_args(argv)


def tree_shapes(budgets: str) -> list[tuple[int, int, int]]:
    """``(top_k, depth, total_tokens)`` of each budget in ``budgets``, from ``tree_taus.json``."""
    known = {
        tree["total_tokens"]: (tree["top_k"], tree["depth"], tree["total_tokens"])
        for tree in json.loads(TREE_TAUS.read_text(encoding="utf-8"))["trees"]
    }
    shapes = []
    for budget in (int(text) for text in budgets.split(",") if text):
        if budget not in known:
            raise SystemExit(f"--trees: {budget} is none of {sorted(known)} ({TREE_TAUS.name})")
        shapes.append(known[budget])
    return shapes


CAPTURES: Counter[str] = Counter()
"""CUDA graphs captured per row (a row that captures again and again is slow for it)."""
_RUNNING = [""]


def count_captures() -> None:
    """Count every CUDA graph capture (verify forwards, drafting steps, device steps) against
    the row running it."""

    def counted(body: Callable[[], None], device: torch.device, pool: Any) -> Any:
        CAPTURES[_RUNNING[0]] += 1
        return record_graph(body, device, pool)

    for module in (captured, static_eagle):  # run_graph calls captured's record_graph
        module.record_graph = counted  # type: ignore[attr-defined]


def runner(decoder: Decoder, name: str, temperature: float = 0.0) -> Runner:
    """Generations of one prompt through ``decoder`` (seeded per call alike in every row)."""
    settings = EvalSettings(temperature=temperature)

    def make(target: Target, ids: torch.Tensor, new: int) -> tuple[Callable[[], list[int]], Any]:
        run, results = drafter_runner(target, ids, decoder, settings, 0, new)

        def named() -> list[int]:
            _RUNNING[0] = name
            return run()

        return named, results

    return make


def working(rows: list[Row], target: Target, ids: torch.Tensor, figures: Figures) -> list[Row]:
    """The rows whose warm-up (:func:`~headway.eval.paired.warm_up`, captures included) runs;
    a row that fails is noted with its error and dropped, so one broken row costs the section
    nothing else (the first row, the baseline, must run)."""
    kept = []
    for index, row in enumerate(rows):
        try:
            warm_up(row, target, ids)
        except Exception as error:
            if index == 0:
                raise
            figures.note(f"row {row.name!r} dropped: {type(error).__name__}: {error}")
            traceback.print_exc()
            continue
        kept.append(row)
    return kept


class Figures:
    """The tables measured so far, written out after each one."""

    def __init__(self, out: Path, header: str) -> None:
        self.out, self.lines, self.data = out, [header], {}  # type: ignore[var-annotated]
        out.mkdir(parents=True, exist_ok=True)
        print(header, flush=True)

    def add(self, title: str, rows: list[Row]) -> None:
        results = table(rows)
        rates = {row["drafter"]: row["tokens_per_s"] for row in results}
        lines = [
            f"\n### {title}\n",
            "| row | tau | tokens/s | x HF static | x plain captured | identical to first row "
            "| graphs captured |",
            "|---|---|---|---|---|---|---|",
        ]
        for row in results:
            tau = "n/a" if row["tau"] is None else f"{row['tau']:.2f}"
            rate = row["tokens_per_s"]
            ratio = [f"{rate / rates[b]:.2f}x" if b in rates else "n/a" for b in (HF_STATIC, PLAIN)]
            lines.append(
                f"| {row['drafter']} | {tau} | {rate:.1f} | {ratio[0]} | {ratio[1]} | "
                f"{row['identical']} | {CAPTURES[row['drafter']]} |"
            )
        print("\n".join(lines), flush=True)
        self.lines += lines
        self.data[title] = results
        (self.out / "decode_figures.md").write_text("\n".join(self.lines) + "\n", "utf-8")
        (self.out / "decode_figures.json").write_text(json.dumps(self.data, indent=2), "utf-8")

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.lines.append(text)
        (self.out / "decode_figures.md").write_text("\n".join(self.lines) + "\n", "utf-8")


def eagle_row(
    target: Target,
    heads: str,
    shape: tuple[int, int, int],
    verify: str = "captured",
    temperature: float = 0.0,
    chain: int = 1,
    coupled: bool = True,
) -> Row:
    """The drafter with tree ``shape`` as ``headway generate`` runs it on a GPU: static drafting,
    sized by the drafter, so each step runs on the device (``DecodeOptions.device_trees``),
    ``chain`` steps to a run (``headway/decode/device_chain.py``); sampled, drafting with the
    target's noise unless not ``coupled`` (``headway/drafters/coupled.py``)."""
    top_k, depth, total = shape
    drafting: Literal["compiled", "static"] = "compiled" if verify == "compiled" else "static"
    spec = EagleSpec(heads=heads, top_k=top_k, depth=depth, total_tokens=total, drafting=drafting)
    options = DecodeOptions(verify=verify, chain=chain)  # type: ignore[arg-type]
    drafter: Any = build_drafter(spec, target)
    drafter.couples = coupled
    decoder = Decoder(target.model, drafter, options)
    name = f"EAGLE-3, top_k {top_k}, depth {depth}, {total} tokens, device step"
    name += "" if verify == "captured" else f", {verify}"
    name += "" if chain == 1 else f", {chain} steps a run"
    name += "" if coupled or not temperature else ", uncoupled"
    return Row(name, runner(decoder, name, temperature))


def plain_row(
    target: Target, verify: str = "captured", temperature: float = 0.0, chain: int = 1
) -> Row:
    """headway without a drafter, ``chain`` tokens a run (``DecodeOptions.chain``)."""
    options = DecodeOptions(verify=verify, chain=chain)  # type: ignore[arg-type]
    decoder = Decoder(target.model, None, options)
    name = PLAIN if verify == "captured" else f"headway, no drafter, {verify}"
    name += "" if chain == 1 else f", {chain} tokens a run"
    return Row(name, runner(decoder, name, temperature))


def section_rows(args: argparse.Namespace, section: str, target: Target) -> list[Row]:
    """The rows of one section, baseline first."""
    shapes = tree_shapes(args.trees)
    heads = args.drafter
    if section == "bfloat16":
        rows = [Row(HF_STATIC, hf_runner(None, static=True)), plain_row(target)]
        rows.append(plain_row(target, chain=8))  # a host read per 8 tokens
        rows += [eagle_row(target, heads, shape) for shape in shapes]
        rows.append(eagle_row(target, heads, shapes[0], chain=8))  # a host read per 8 steps
        top_k, depth, total = shapes[0]
        spec = EagleSpec(heads=heads, top_k=top_k, depth=depth, total_tokens=total)
        options = DecodeOptions(sizing="cost", verify="captured")
        decoder = CostTables().decoder(target.model, build_drafter(spec, target), options)
        name = f"EAGLE-3, {total} tokens, cost-sized, host step, captured"
        rows.append(Row(name, runner(decoder, name)))
        return rows
    if section == "float32":  # identity against generate(do_sample=False), the quality bar's
        rows = [Row(HF_EAGER, hf_runner(None)), Row(HF_STATIC, hf_runner(None, static=True))]
        rows += [plain_row(target), plain_row(target, chain=8)]
        ends = dict.fromkeys((shapes[0], shapes[-1]))  # the first (default) and the last tree
        rows += [eagle_row(target, heads, shape) for shape in ends]
        return [*rows, eagle_row(target, heads, shapes[0], chain=8)]
    if section == "sampled":
        rows = [plain_row(target, temperature=1.0)]  # the same texts row by row (one seed each)
        rows.append(eagle_row(target, heads, shapes[0], temperature=1.0, coupled=False))
        return rows + [
            eagle_row(target, heads, shape, temperature=1.0)
            for shape in dict.fromkeys((shapes[0], shapes[-1], SAMPLED_WIDE))
        ]
    if section == "compiled":
        rows = [Row(HF_STATIC, hf_runner(None, static=True)), plain_row(target)]
        rows.append(plain_row(target, "compiled"))
        rows.append(eagle_row(target, heads, shapes[0], "compiled"))
        return [*rows, eagle_row(target, heads, shapes[0], "compiled", chain=8)]
    raise SystemExit(f"--sections: {section!r} is none of bfloat16, float32, sampled, compiled")


def profile(args: argparse.Namespace, target: Target, ids: torch.Tensor, figures: Figures) -> None:
    """Profile one answer of plain captured decoding and of the default tree's device step
    (bf16): per step, the wall time, the time the GPU was busy and the kernels it ran; the
    operator table (by device time) goes to ``OUT/profile-<row>.txt``."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as profiler

    activities = [ProfilerActivity.CPU]
    if target.model.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    shape = tree_shapes(args.trees)[0]
    for row in (plain_row(target), eagle_row(target, args.drafter, shape)):
        run, results = row.make(target, ids, args.max_new_tokens)
        run()  # warm-up: captures
        results.clear()
        with profiler(activities=activities) as prof:
            begun = time.perf_counter()
            run()
            if target.model.device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - begun
        steps = len(results[0].accept_lengths)
        events = prof.key_averages()
        busy = sum(getattr(event, "self_device_time_total", 0.0) for event in events) / 1000
        kernels = sum(
            event.count
            for event in events
            if getattr(event, "device_type", None) and str(event.device_type).endswith("CUDA")
        )
        slug = "plain" if row.name == PLAIN else "device-step"
        table = events.table(sort_by="self_device_time_total", row_limit=40)
        (figures.out / f"profile-{slug}.txt").write_text(table, "utf-8")
        figures.note(
            f"\nprofile, {row.name}: {steps} steps, {wall / steps * 1000:.2f} ms a step wall, "
            f"the GPU busy {busy / steps:.2f} ms a step, {kernels / steps:.0f} device events a "
            f"step (profile-{slug}.txt)"
        )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.perf_counter()
    count_captures()
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    header = (
        f"# decoding figures: {name}, torch {torch.__version__}; {args.target} with "
        f"{Path(args.drafter).name}; {args.prompts} x{args.num_prompts}, "
        f"{args.max_new_tokens} new tokens, batch 1; tau pooled over prompts"
    )
    figures = Figures(Path(args.out), header)
    prompts = load_prompts(args.prompts, limit=args.num_prompts)
    targets: dict[str, Target] = {}
    for section in args.sections.split(","):
        spent = time.perf_counter() - started
        if spent > args.budget_s:
            figures.note(f"\n{section}: skipped, {spent:.0f} s of the {args.budget_s:.0f} s spent")
            continue
        dtype = "float32" if section == "float32" else "bfloat16"  # profile: bf16, as served
        if dtype not in targets:
            targets[dtype] = load_target(args.target, dtype=dtype, device=args.device)
        target = targets[dtype]
        encoded = [prompt_ids(target, p.text, chat=p.chat) for p in prompts]
        begun = time.perf_counter()
        CAPTURES.clear()  # each section's rows count their own captures
        if target.model.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(target.model.device)
        if section == "profile":
            profile(args, target, encoded[0], figures)
            continue
        try:
            rows = working(section_rows(args, section, target), target, encoded[0], figures)
            measure(rows, target, encoded, args.max_new_tokens, warmed=True)
        except Exception as error:  # report it, go on with the next section
            figures.note(f"\n{section}: failed: {type(error).__name__}: {error}")
            traceback.print_exc()
            continue
        greedy = "temperature 1.0" if section == "sampled" else "greedy"
        peak = ""
        if target.model.device.type == "cuda":
            peak = f", peak {torch.cuda.max_memory_allocated(target.model.device) / 2**30:.2f} GiB"
        figures.add(
            f"{section} ({dtype}, {greedy}; {time.perf_counter() - begun:.0f} s{peak})",
            rows,
        )
        if section == "compiled":  # one per block size and draft shape: more means recompiles
            from torch._dynamo.utils import counters

            figures.note(f"graphs torch.compile made: {counters['stats']['unique_graphs']}")


if __name__ == "__main__":
    main()
