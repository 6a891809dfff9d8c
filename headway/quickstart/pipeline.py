"""``headway quickstart``: the whole pipeline on the embedded SmolLM2-135M, on a CPU, in minutes.

Stages, each printed with what it did and how long it took, each resumed when rerun (a finished
stage is skipped; once a stage has run, every later one runs again on its fresh output):

1. **target** — load (and, the first time, convert) the embedded target;
2. **data** — the target answers a small prompt mix itself (``headway data regenerate``, bf16,
   batched); finished shards are kept, a complete folder is skipped;
3. **train** — a small drafter on that data (``headway train``); a finished run is skipped, an
   interrupted one resumes from its last checkpoint;
4. **export** — the heads in an engine layout (``headway export``);
5. **eval** — the exported drafter against plain decoding on a few MT-bench questions
   (``headway eval``), greedy, in float32, so outputs must be identical;
6. **shipped** — the drafter shipped for the target in ``drafters/`` (if any), on the same
   prompts and settings, tree sized by cost, so its speedup prints beside the one just trained.

``--tiny`` runs the same stages on a tiny random target built in-process (seconds): it proves
the pipeline, not a speedup. Everything lands in one folder (``--out``), with ``quickstart.json``
holding every stage's seconds and the final figures.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from headway.atomic import write_text_atomic
from headway.config import load_config
from headway.drafters.shipped import SHIPPED_DIR
from headway.errors import HeadwayError
from headway.eval.report import write_report
from headway.eval.run import evaluate
from headway.eval.speed import EvalSettings
from headway.evalsets import load_prompts
from headway.locks import exclusive_folder
from headway.quickstart.plan import SMOLLM2_PLAN, TINY_PLAN, QuickstartPlan
from headway.quickstart.summaries import (
    data_summary,
    eval_summary,
    figures,
    run_fingerprint,
    sources,
    train_summary,
)
from headway.run_config import RunConfig
from headway.target import Target, check_fingerprint, fingerprint, load_target

__all__ = ["QuickstartResult", "StageReport", "run_quickstart"]

Echo = Callable[[str], None]
STAGES = 6

T = TypeVar("T")


@dataclass
class StageReport:
    """What one stage did: its name, a one-line summary, its seconds, and whether it was
    skipped because a previous run had finished it."""

    name: str
    summary: str
    seconds: float
    skipped: bool = False


@dataclass
class QuickstartResult:
    """Every stage's report, the eval report's headline figures and where the files are."""

    out: str
    plan: dict[str, Any]
    stages: list[StageReport] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)
    # set once a stage after the target has run: every later stage then runs too (fresh inputs)
    downstream_stale: bool = False

    @property
    def seconds(self) -> float:
        return sum(stage.seconds for stage in self.stages)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out": self.out,
            "seconds": self.seconds,
            "stages": [asdict(stage) for stage in self.stages],
            "figures": self.figures,
            "files": self.files,
            "plan": self.plan,
        }


class _Pipeline:
    """The stages over one output folder (paths, plan, and the fp32 target once loaded)."""

    def __init__(self, plan: QuickstartPlan, out: Path, shipped_dir: Path = SHIPPED_DIR) -> None:
        self.plan, self.out, self.shipped_dir = plan, out, shipped_dir
        self.data_dir = out / "data"
        self.run_dir = out / "run"
        self.export_dir = out / f"export-{plan.export_format}"
        self.eval_dir = out / "eval"
        self.shipped_eval_dir = out / "eval-shipped"
        self.target_name = plan.target
        self._target: Target | None = None

    def target(self) -> Target:
        if self._target is None:
            self._target = load_target(self.target_name, dtype="float32", device=self.plan.device)
        return self._target

    # -- stage 1 ---------------------------------------------------------------------------
    def prepare_target(self) -> str:
        if self.plan.tiny:
            from headway.quickstart.tiny import build_tiny_target

            self.target_name = str(build_tiny_target(self.out / "tiny-target"))
        model = self.target().model
        size = sum(p.numel() for p in model.parameters()) / 1e6
        return f"{self.target_name} ({size:.1f}M parameters, float32 for decoding)"

    # -- stage 2 ---------------------------------------------------------------------------
    def data_done(self) -> dict[str, Any] | None:
        path = self.data_dir / "manifest.json"
        if not path.is_file():
            return None
        manifest: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
        return manifest if manifest.get("complete") else None

    def regenerate(self) -> str:
        from headway.train.prompts import build_mix, parse_mix
        from headway.train.regenerate import RegenerateOptions, regenerate

        mix_spec = self.plan.mix
        if self.plan.tiny:
            from headway.quickstart.tiny import write_tiny_chat

            chat = write_tiny_chat(self.out / "tiny-chat.jsonl")
            mix_spec = mix_spec.replace("TINY_CHAT", str(chat))
        mix = parse_mix(mix_spec)
        options = RegenerateOptions(
            max_new_tokens=self.plan.regen_max_new_tokens,
            batch_size=self.plan.regen_batch_size,
            shard_size=self.plan.regen_shard_size,
        )
        target = load_target(
            self.target_name, dtype=self.plan.data_dtype(), device=self.plan.device
        )
        items = build_mix(mix, seed=0)
        manifest = regenerate(target, items, self.data_dir, options, mix=mix)
        return data_summary(manifest, self.plan.data_dtype())

    # -- stage 3 ---------------------------------------------------------------------------
    def train_config(self) -> RunConfig:
        overrides = [
            f"target.name={self.target_name}",
            f"target.device={self.plan.device}",
            f"data.sources={self.data_dir / 'data'}",
            f"train.output_dir={self.run_dir}",
            f"target.dtype={self.plan.data_dtype()}",
            f"medusa.draft_vocab_size={self.plan.draft_vocab_size}",
            *self.plan.train_overrides,
        ]
        return load_config(RunConfig, None, overrides)

    def train_done(self) -> bool:
        return (self.run_dir / "training_summary.json").is_file() and (
            self.run_dir / "model.safetensors"
        ).is_file()

    def train(self) -> str:
        from headway.train.loop import latest_checkpoint, train

        config = self.train_config()
        resume = latest_checkpoint(self.run_dir) is not None
        train(config, resume=resume)
        return train_summary(self.run_dir, config, resumed=resume)

    # -- stage 4 ---------------------------------------------------------------------------
    def export(self) -> str:
        from headway.heads.format_medusa import export_medusa, export_medusa_vllm

        exporters = {"medusa": export_medusa, "medusa-vllm": export_medusa_vllm}
        if self.plan.export_format not in exporters:
            raise HeadwayError(f"quickstart cannot export {self.plan.export_format!r}")
        exporters[self.plan.export_format](self.run_dir, self.export_dir)
        size = sum(p.stat().st_size for p in self.export_dir.iterdir()) / 2**20
        return f"{self.plan.export_format} layout, {size:.1f} MiB, in {self.export_dir}"

    # -- stage 5 ---------------------------------------------------------------------------
    def evaluate(self) -> str:
        from headway.drafters.build import build_drafter
        from headway.quickstart.calibrate import quickstart_spec

        target = self.target()
        check_fingerprint(run_fingerprint(self.run_dir), fingerprint(target.model))
        spec, info = quickstart_spec(self.export_dir, target, self.plan, self._held_out(target))
        drafter = build_drafter(spec, target)
        report = evaluate(
            target,
            drafter,
            self._prompts(),
            self._settings(),
            self.eval_dir,
            drafter_info=info,
            prompt_set=self._prompt_set(),
        )
        by_source = sources(drafter)
        if by_source:  # known only after the run: added to the report it belongs to
            report["accepted_drafted_tokens_by_source"] = by_source
            write_report(report, self.eval_dir)
        return eval_summary(report)

    # -- stage 6 ---------------------------------------------------------------------------
    def evaluate_shipped(self) -> str:
        from headway.quickstart.shipped_stage import evaluate_shipped

        return evaluate_shipped(
            self.target(),
            self._prompts(),
            self._settings(),
            self.shipped_eval_dir,
            prompt_set=self._prompt_set(),
            shipped_dir=self.shipped_dir,
        )

    def _settings(self) -> EvalSettings:
        return EvalSettings(max_new_tokens=self.plan.eval_max_new_tokens)

    def _prompt_set(self) -> str:
        return self.plan.eval_prompts or "tiny prompts"

    def _held_out(self, target: Target, limit: int = 8) -> list[tuple[list[int], list[int]]]:
        """Up to ``limit`` samples the training run held out, as (input_ids, loss_mask)."""
        from headway.train.loop_data import training_data  # the split training evaluated on

        _, held_out, _ = training_data(self.train_config(), target)
        rows = [held_out[i] for i in range(min(limit, len(held_out)))]  # type: ignore[arg-type]
        return [(list(row["input_ids"]), list(row["loss_mask"])) for row in rows]

    def _prompts(self) -> list[Any]:
        if self.plan.eval_prompts is None:
            from headway.quickstart.tiny import write_tiny_prompts

            path = write_tiny_prompts(self.out / "tiny-prompts.jsonl")
            return load_prompts(str(path), limit=self.plan.eval_num_prompts)
        return load_prompts(self.plan.eval_prompts, limit=self.plan.eval_num_prompts)


def _stage(
    result: QuickstartResult,
    echo: Echo,
    name: str,
    work: Callable[[], str],
    done: Callable[[], str | None] | None = None,
) -> None:
    """Run one stage, or report it as already done when ``done()`` says so and no earlier stage
    ran in this call (a rerun earlier stage makes every later one run again); print and record
    what it did."""
    number = len(result.stages) + 1
    echo(f"[{number}/{STAGES}] {name} ...")
    started = time.perf_counter()
    previous = done() if done is not None and not result.downstream_stale else None
    if previous is not None:
        report = StageReport(name, previous, time.perf_counter() - started, skipped=True)
    else:
        report = StageReport(name, work(), time.perf_counter() - started)
        result.downstream_stale = done is not None
    result.stages.append(report)
    tag = "already done" if report.skipped else f"{report.seconds:.1f} s"
    echo(f"[{number}/{STAGES}] {name}: {report.summary} ({tag})")


def run_quickstart(
    out: Path, *, tiny: bool = False, echo: Echo = print, shipped_dir: Path = SHIPPED_DIR
) -> QuickstartResult:
    """Run (or resume) every stage into ``out``; returns what happened, also written to
    ``out/quickstart.json``. ``shipped_dir`` is where stage 6 looks for the target's shipped
    drafter. A second quickstart into the same ``out`` is refused
    (:class:`~headway.errors.FolderBusyError`)."""
    _check_own_folder(out)
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_folder(out, what="--out"):
        return _run_quickstart(out, tiny=tiny, echo=echo, shipped_dir=shipped_dir)


# draft_vocab.json: the drafting list quickstarts before 2026-11-28 wrote (the heads now carry it)
_OWN_ENTRIES = ("data", "run", "eval", "eval-shipped", "quickstart.json", "draft_vocab.json")
_OWN_TINY = ("tiny-target", "tiny-chat.jsonl", "tiny-prompts.jsonl")  # the --tiny pipeline's


def _check_own_folder(out: Path) -> None:
    """Refuse an ``out`` that holds anything a quickstart did not write (``--out .`` in a project,
    say): the quickstart resumes in, and sweeps, only folders of its own."""
    if not out.is_dir():
        return
    foreign = sorted(
        entry.name
        for entry in out.iterdir()
        if not entry.name.startswith((".", "export-"))
        and entry.name not in _OWN_ENTRIES + _OWN_TINY
    )
    if foreign:
        raise HeadwayError(
            f"--out {out} holds files a quickstart did not write ({', '.join(foreign[:3])}"
            f"{' ...' if len(foreign) > 3 else ''}); choose a new or empty folder"
        )


def _run_quickstart(out: Path, *, tiny: bool, echo: Echo, shipped_dir: Path) -> QuickstartResult:
    from headway.quickstart.shipped_stage import read_shipped_summary

    plan = TINY_PLAN if tiny else SMOLLM2_PLAN
    pipeline = _Pipeline(plan, out, shipped_dir)
    result = QuickstartResult(str(out), asdict(plan))
    report_path = pipeline.eval_dir / "report.json"
    _stage(result, echo, "target", pipeline.prepare_target)
    _stage(
        result,
        echo,
        "data",
        pipeline.regenerate,
        lambda: _maybe(pipeline.data_done(), lambda m: data_summary(m, plan.data_dtype())),
    )
    _stage(
        result,
        echo,
        "train",
        pipeline.train,
        lambda: f"finished run in {pipeline.run_dir}" if pipeline.train_done() else None,
    )
    _stage(
        result,
        echo,
        "export",
        pipeline.export,
        lambda: (
            f"in {pipeline.export_dir}" if (pipeline.export_dir / "config.json").is_file() else None
        ),
    )
    _stage(
        result,
        echo,
        "eval",
        pipeline.evaluate,
        lambda: (
            eval_summary(json.loads(report_path.read_text())) if report_path.is_file() else None
        ),
    )
    shipped_report = pipeline.shipped_eval_dir / "report.json"
    _stage(
        result,
        echo,
        "shipped",
        pipeline.evaluate_shipped,
        lambda: read_shipped_summary(shipped_report),
    )
    report = json.loads(report_path.read_text(encoding="utf-8"))
    result.figures = figures(report)
    if shipped_report.is_file():
        result.figures["shipped"] = figures(json.loads(shipped_report.read_text("utf-8")))
    result.files = {
        "data": str(pipeline.data_dir / "data"),
        "run": str(pipeline.run_dir),
        "export": str(pipeline.export_dir),
        "report": str(report_path),
        "summary": str(pipeline.eval_dir / "summary.md"),
        "shipped_report": str(shipped_report) if shipped_report.is_file() else "",
    }
    write_text_atomic(out / "quickstart.json", json.dumps(result.to_dict(), indent=2) + "\n")
    return result


def _maybe(value: T | None, render: Callable[[T], str]) -> str | None:
    return None if value is None else render(value)
