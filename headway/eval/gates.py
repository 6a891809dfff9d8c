"""Per-position acceptance gates kept beside a drafter (``gates.json``), and their check.

After vLLM speculators' nightly regression tests, which serve a drafter and assert that each
position's acceptance rate (``acceptance_at_token_{i}``) stays above a fixed threshold: a drafter
folder keeps the per-position acceptance it reached when it was shipped
(:func:`headway.eval.acceptance.per_position_acceptance`, vLLM's definition), measured on fixed
held-out prompts in the exact setting (greedy, float32, trees the drafter sizes itself), and a
gate ratio. ``tests/test_gates.py`` decodes the same prompts the same way and fails when a
position falls below ``gate_ratio`` x its recorded rate. Whoever ships a new drafter rewrites
the file by measuring (``headway eval --heads DRAFTER --write-gates DRAFTER/gates.json``, the
command the file records); the drafter itself is the folder the file sits in.

``gates.json`` (``"schema": "headway.gates/1"``)::

    {
      "schema": str, "about": str,
      "command": str,                      # the headway eval command that wrote it
      "target": str, "dtype": "float32",
      "prompt_set": str, "prompt_ids": [str, ...], "max_new_tokens": int,
      "drafter": {"name": str, option: value, ...},   # the options given (--draft-option)
      "decode": {"sizing": "drafter", "acceptance": "lossless", "verify": str},
      "gemm": str,                         # the --gemm choice applied to the target
      "per_position_acceptance": [float, ...],        # positions 1..k, as measured
      "gate_ratio": float,                            # each position must keep >= ratio x that
      "tau": float, "draft_steps": int,
      "measured": {"created": str, "headway_version": str, "machine": {...}}
    }
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from headway.api import prompt_ids
from headway.atomic import write_text_atomic
from headway.decode.gemm import GemmChoice, apply_gemm
from headway.decode.generate import Decoder, Drafter
from headway.decode.options import DecodeOptions
from headway.drafters.build import build_drafter, spec_for
from headway.drafters.specs import DrafterSpec
from headway.errors import ConfigError, HeadwayError
from headway.eval.acceptance import per_position_acceptance
from headway.eval.speed import RecordingDrafter
from headway.evalsets import EvalPrompt, load_prompts
from headway.target import Target, eos_token_ids, load_target

__all__ = [
    "GATES_NAME",
    "GATE_RATIO",
    "AcceptanceGates",
    "GateCheck",
    "GateRun",
    "check_gates",
    "gate_prompts",
    "gate_spec",
    "gates_from_report",
    "load_gated",
    "measure_gates",
    "read_gates",
    "refuse_ungateable",
    "write_gates",
]

SCHEMA = "headway.gates/1"
GATES_NAME = "gates.json"
GATE_RATIO = 0.9
ABOUT = (
    "Per-position acceptance gates of the drafter in this folder (vLLM's per-position acceptance "
    "rate: of the draft steps that proposed tokens, the fraction that accepted at least i). "
    "tests/test_gates.py decodes these prompts the same way and fails if a position falls "
    "below gate_ratio x per_position_acceptance. Regenerate by running `command`."
)


@dataclass(frozen=True)
class AcceptanceGates:
    """One ``gates.json`` (fields as in the module docstring)."""

    command: str
    target: str
    dtype: str
    prompt_set: str
    prompt_ids: tuple[str, ...]
    max_new_tokens: int
    drafter: dict[str, Any]
    decode: dict[str, Any]
    gemm: str
    per_position_acceptance: tuple[float, ...]
    gate_ratio: float
    tau: float
    draft_steps: int
    measured: dict[str, Any]

    def __post_init__(self) -> None:
        if not 0 < self.gate_ratio <= 1:
            raise ConfigError(f"gate_ratio must be in (0, 1], got {self.gate_ratio}")
        if not self.prompt_ids or not self.per_position_acceptance:
            raise ConfigError("gates need prompt_ids and per_position_acceptance (non-empty)")

    @property
    def thresholds(self) -> list[float]:
        """``gate_ratio`` x the recorded rate of each position 1..k."""
        return [self.gate_ratio * rate for rate in self.per_position_acceptance]

    def to_dict(self) -> dict[str, Any]:
        fields = dataclasses.asdict(self)
        fields["prompt_ids"] = list(self.prompt_ids)
        fields["per_position_acceptance"] = list(self.per_position_acceptance)
        return {"schema": SCHEMA, "about": ABOUT, **fields}

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "gates") -> AcceptanceGates:
        """Parse a ``gates.json`` object; a wrong schema or missing/unknown key is a one-line
        :class:`~headway.errors.ConfigError`."""
        if data.get("schema") != SCHEMA:
            raise ConfigError(f"{where}: schema {data.get('schema')!r}, expected {SCHEMA!r}")
        names = {field.name for field in dataclasses.fields(cls)}
        given = set(data) - {"schema", "about"}
        if given != names:
            missing, unknown = sorted(names - given), sorted(given - names)
            raise ConfigError(f"{where}: missing keys {missing}, unknown keys {unknown}")
        values = {name: data[name] for name in names}
        values["prompt_ids"] = tuple(str(i) for i in data["prompt_ids"])
        values["per_position_acceptance"] = tuple(float(r) for r in data["per_position_acceptance"])
        return cls(**values)


def refuse_ungateable(
    *, temperature: float, decode: dict[str, Any], dtype: str, spec: DrafterSpec
) -> None:
    """Refuse settings whose acceptance decoding again would not reproduce: checked before an
    eval run that is to write gates, and again on its report.

    Raises:
        HeadwayError: sampling, cost sizing or a drafter option set to ``auto`` (both time the
            machine), typical acceptance, or a dtype other than float32 (the exact setting),
            with the flag that fixes it.
    """
    timed = [name for name, value in dataclasses.asdict(spec).items() if value == "auto"]
    problems = [
        (bool(timed), f"drafter options {timed} are chosen by timing; give them a value"),
        (temperature != 0, "gates are measured greedy (--temperature 0)"),
        (decode["sizing"] != "drafter", "cost sizing times the machine; use --sizing drafter"),
        (decode["acceptance"] != "lossless", "gates are measured with --acceptance lossless"),
        (dtype != "float32", "gates are measured in --dtype float32"),
    ]
    for failed, why in problems:
        if failed:
            raise HeadwayError(f"--write-gates: {why}")


def gates_from_report(
    report: dict[str, Any],
    spec: DrafterSpec,
    *,
    options: Mapping[str, Any],
    command: str,
    ratio: float = GATE_RATIO,
) -> AcceptanceGates:
    """The gates of an eval ``report`` (:mod:`headway.eval.report`) of the drafter ``spec``, built
    from the drafter ``options`` given (``--draft-option``: recorded as given, so that options
    left at their defaults, which a later version may rename, are not pinned); the GEMM choice
    applied to the target is the report's.

    Raises:
        HeadwayError: settings :func:`refuse_ungateable` refuses, outputs that differed from
            plain decoding, or a run in which the drafter proposed nothing.
    """
    settings, decode = report["settings"], report["decode"]
    refuse_ungateable(
        temperature=settings["temperature"],
        decode=decode,
        dtype=report["target"]["dtype"],
        spec=spec,
    )
    if report["identical_fraction"] != 1.0:
        raise HeadwayError("--write-gates: outputs differed from plain decoding; no gates written")
    if not report["per_position_acceptance"]:
        raise HeadwayError("--write-gates: the drafter proposed nothing; no gates written")
    return AcceptanceGates(
        command=command,
        target=report["target"]["name"],
        dtype=report["target"]["dtype"],
        prompt_set=report["prompt_set"],
        prompt_ids=tuple(row["id"] for row in report["per_prompt"]),
        max_new_tokens=settings["max_new_tokens"],
        drafter={"name": spec.name, **options},
        decode=_decode_options(decode),
        gemm=decode["gemm"],
        per_position_acceptance=tuple(report["per_position_acceptance"]),
        gate_ratio=ratio,
        tau=report["tau"],
        draft_steps=report["draft_steps"],
        measured={
            "created": report["created"],
            "headway_version": report["headway_version"],
            "machine": report["machine"],
        },
    )


def write_gates(gates: AcceptanceGates, path: Path) -> Path:
    """Write ``gates`` to ``path`` (atomically); returns it."""
    write_text_atomic(path, json.dumps(gates.to_dict(), indent=2) + "\n")
    return path


def read_gates(path: Path) -> AcceptanceGates:
    """Read a ``gates.json``.

    Raises:
        ConfigError: an unreadable file, or one that is not a ``headway.gates/1`` object.
    """
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as error:
        raise ConfigError(f"{path}: cannot read the gates ({error})") from error
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return AcceptanceGates.from_dict(data, str(path))


def gate_prompts(gates: AcceptanceGates) -> list[EvalPrompt]:
    """The gates' prompts, in their recorded order, picked by id from their prompt set.

    Raises:
        ConfigError: an id the prompt set does not hold.
    """
    by_id = {prompt.id: prompt for prompt in load_prompts(gates.prompt_set)}
    missing = [i for i in gates.prompt_ids if i not in by_id]
    if missing:
        raise ConfigError(f"gates name prompts {missing} that {gates.prompt_set} does not hold")
    return [by_id[i] for i in gates.prompt_ids]


def _decode_options(decode: dict[str, Any]) -> dict[str, Any]:
    """The :class:`DecodeOptions` fields of a recorded ``decode`` block."""
    names = {field.name for field in dataclasses.fields(DecodeOptions)}
    return {key: value for key, value in decode.items() if key in names}


def gate_spec(gates: AcceptanceGates, heads: Path | None = None) -> DrafterSpec:
    """The drafter spec the gates were measured with; ``heads`` is the drafter folder (the one
    holding the gates file) for drafters that load heads."""
    options = {k: v for k, v in gates.drafter.items() if k != "name"}
    if gates.drafter["name"] == "eagle":  # gates that name no dtype predate dtype=auto (int8
        options.setdefault("dtype", "target")  # drafting where timed faster): the target's
    return spec_for(gates.drafter["name"], heads=heads, options=options)


@dataclass
class GateRun:
    """The gates' prompts decoded again.

    Attributes:
        tokens: generated ids per prompt.
        accept_lengths: committed tokens per target forward per prompt, prefill first.
        proposed_depths: depth of the draft proposed at each draft step, per prompt.
        per_position_acceptance: the rates over all prompts, positions 1..k of the gates.
    """

    tokens: list[list[int]]
    accept_lengths: list[list[int]]
    proposed_depths: list[list[int]]
    per_position_acceptance: list[float]


def load_gated(
    gates: AcceptanceGates, heads: Path | None = None, *, device: str = "cpu"
) -> tuple[Target, Drafter]:
    """The gates' target (their dtype, their GEMM route choice applied) on ``device``, and their
    drafter on it (``heads``: the folder holding the gates, for drafters that load heads)."""
    target = load_target(gates.target, dtype=gates.dtype, device=device)
    apply_gemm(target.model, cast(GemmChoice, gates.gemm))
    return target, build_drafter(gate_spec(gates, heads), target)


def measure_gates(gates: AcceptanceGates, target: Target, drafter: Drafter) -> GateRun:
    """Decode the gates' prompts with ``drafter`` as ``headway eval`` did when it wrote them
    (greedy, the recorded decode options, the target's EOS, batch 1) and measure each
    position's acceptance over the gates' k positions (:func:`load_gated` loads both)."""
    recording = RecordingDrafter(drafter)
    decoder = Decoder(target.model, recording, DecodeOptions(**_decode_options(gates.decode)))
    run = GateRun([], [], [], [])
    for prompt in gate_prompts(gates):
        ids = prompt_ids(target, prompt.chat_input(), chat=prompt.chat)
        result = decoder.generate(
            ids, max_new_tokens=gates.max_new_tokens, eos_token_ids=eos_token_ids(target)
        )
        run.tokens.append(list(result.tokens))
        run.accept_lengths.append(list(result.accept_lengths))
        run.proposed_depths.append(recording.proposed_depths())
    run.per_position_acceptance = per_position_acceptance(
        run.accept_lengths, run.proposed_depths, positions=len(gates.per_position_acceptance)
    )
    return run


def _below(rate: float, gate: float) -> bool:
    """``rate < gate`` beyond float rounding (0.9 x 0.1 is 0.09000000000000001)."""
    return rate < gate - 1e-9


@dataclass(frozen=True)
class GateCheck:
    """Measured against gated rates, position by position (1-based)."""

    measured: tuple[float, ...]
    recorded: tuple[float, ...]
    thresholds: tuple[float, ...]

    @property
    def failed_positions(self) -> list[int]:
        pairs = zip(self.measured, self.thresholds, strict=True)
        return [index for index, (rate, gate) in enumerate(pairs, start=1) if _below(rate, gate)]

    @property
    def passed(self) -> bool:
        return not self.failed_positions

    def table(self) -> str:
        """One line per position: measured, recorded when shipped, gate, verdict."""
        lines = ["position  measured  recorded    gate"]
        for index, (rate, shipped, gate) in enumerate(
            zip(self.measured, self.recorded, self.thresholds, strict=True), start=1
        ):
            verdict = "BELOW GATE" if _below(rate, gate) else "ok"
            lines.append(f"{index:>8}  {rate:8.3f}  {shipped:8.3f}  {gate:6.3f}  {verdict}")
        return "\n".join(lines)


def check_gates(gates: AcceptanceGates, measured: Sequence[float]) -> GateCheck:
    """Compare ``measured`` rates with the gates; a position missing from ``measured`` (no draft
    reached it) reads 0.0."""
    count = len(gates.per_position_acceptance)
    padded = [*measured[:count], *[0.0] * (count - len(measured))]
    return GateCheck(
        measured=tuple(padded),
        recorded=gates.per_position_acceptance,
        thresholds=tuple(gates.thresholds),
    )
