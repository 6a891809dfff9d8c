"""Kill a headway pipeline with SIGKILL at a random moment, resume it, and compare the result
with an uninterrupted run (issue #7, point 1).

Each pipeline runs as its own process (``python -m headway.train``, ``headway data
cache-features``, ``headway data regenerate``) on a tiny random Llama and a few hundred rows.
One run goes to the end untouched: its *outcome* (final weights, shard bytes, regenerated rows,
manifests, and the temporary files left behind) is the reference, and the time from its first
write to its last output (not to the exit: interpreter teardown takes a second or more) is the
window the kill moments are drawn from. Each kill point starts a fresh run, waits until
it has begun writing, sleeps a random part of that window, sends SIGKILL, reruns the same
command (training adds ``--resume`` once a checkpoint exists) and compares outcomes.

Used by ``tests/test_kill_resume.py`` (two points per pipeline) and ``scripts/kill_resume.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import yaml
from safetensors import safe_open
from transformers import PreTrainedModel

from headway.corpus.jsonl import read_jsonl
from headway.train.regenerate import prompts_path
from tests.launching import ENV
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

TIMEOUT_S = 300.0
# The installed `headway` command, beside this interpreter.
HEADWAY = str(Path(sys.executable).with_name("headway"))
# 3 shards: `data cache-features` writes 256 samples per shard.
FEATURE_ROWS = 600
CONVERSATIONS = 96
ANSWERS = ("It is four.", "Hello! How can I help you today?", "The quick brown fox.", "I am fine.")


@dataclass(frozen=True)
class Workspace:
    """A tiny target folder (Llama, vocab 400, ChatML) and the data the pipelines read."""

    root: Path
    target: Path
    chat: Path
    text: Path
    recipe: Path


def make_workspace(root: Path) -> Workspace:
    """Write the target, ``chat.jsonl`` (:data:`CONVERSATIONS`, a third with two user turns),
    ``text.jsonl`` (:data:`FEATURE_ROWS` plain-text rows) and a Medusa training recipe."""
    root.mkdir(parents=True, exist_ok=True)
    target = root / "target"
    cast(PreTrainedModel, tiny_model("llama", vocab_size=400)).save_pretrained(target)
    smollm2_tokenizer().save_pretrained(target)
    rows = []
    for i in range(CONVERSATIONS):
        messages = [
            {"role": "user", "content": f"question {i}: what is two plus two?"},
            {"role": "assistant", "content": ANSWERS[i % len(ANSWERS)] * (1 + i % 3)},
        ]
        if i % 3 == 0:
            messages += [
                {"role": "user", "content": "Tell me a joke about cats."},
                {"role": "assistant", "content": ANSWERS[(i + 1) % len(ANSWERS)]},
            ]
        rows.append({"messages": messages})
    chat = root / "chat.jsonl"
    chat.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    text = root / "text.jsonl"
    lines = [{"text": f"The quick brown fox {i} jumps over the lazy dog {i % 7} times."}]
    lines += [
        {"text": f"Hello {i}! " + ANSWERS[i % len(ANSWERS)] * (1 + i % 4)}
        for i in range(1, FEATURE_ROWS)
    ]
    text.write_text("".join(json.dumps(row) + "\n" for row in lines), encoding="utf-8")
    recipe = root / "medusa.yaml"
    settings = {
        "target": {"name": str(target), "device": "cpu"},
        "data": {"sources": [str(chat)], "max_length": 64, "eval_fraction": 0.2},
        "train": {
            "lr": 1e-2,
            "warmup_steps": 2,
            "max_steps": 48,
            "batch_size": 4,
            "eval_every": 12,
            "save_every": 4,
        },
        "medusa": {"num_heads": 2},
    }
    recipe.write_text(yaml.safe_dump(settings), encoding="utf-8")
    return Workspace(root, target, chat, text, recipe)


@dataclass(frozen=True)
class Pipeline:
    """One resumable command and how to judge its output folder.

    Attributes:
        name: ``"training"``, ``"features"`` or ``"regeneration"``.
        command: output folder -> argv that starts the run or, given a partial folder, resumes it.
        started: whether the run has begun writing into the folder (the kill window opens).
        finished: whether its last output is in place (the window closes; the process may still
            be exiting).
        outcome: what must be equal between an uninterrupted and a killed-then-resumed run.
        progress: a few words on what the folder holds (to describe where a kill landed).
    """

    name: str
    command: Callable[[Path], list[str]]
    started: Callable[[Path], bool]
    finished: Callable[[Path], bool]
    outcome: Callable[[Path], dict[str, Any]]
    progress: Callable[[Path], str]


def shard_digest(path: Path) -> dict[str, Any]:
    """Size, metadata and a hash of every tensor's name, dtype, shape and bytes of a
    safetensors file. Not the file's own bytes: safetensors writes the metadata map in hash
    order, which differs between processes, so equal shards are not always equal files."""
    digest = hashlib.sha256()
    with safe_open(str(path), framework="pt") as shard:
        metadata = dict(shard.metadata() or {})
        for name in sorted(shard.keys()):
            tensor = shard.get_tensor(name)
            digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)}".encode())
            digest.update(tensor.contiguous().numpy().tobytes())
    return {"bytes": path.stat().st_size, "metadata": metadata, "tensors": digest.hexdigest()}


def leftovers(out: Path) -> list[str]:
    """Temporary files and folders a run left: hidden entries inside `out` (at any depth) and
    ``.NAME.*`` siblings of `out` (staging folders of a whole-folder save)."""
    inside = [str(p.relative_to(out)) for p in out.rglob(".*")]
    beside = [p.name for p in out.parent.glob(f".{out.name}.*")]
    return sorted(inside + beside)


def _complete(out: Path) -> bool:
    """Whether ``out/manifest.json`` says the run is complete (it is replaced atomically)."""
    manifest = out / "manifest.json"
    return manifest.is_file() and bool(json.loads(manifest.read_text("utf-8")).get("complete"))


def _without_timing(manifest_path: Path) -> dict[str, Any]:
    manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    manifest.pop("seconds_this_run", None)
    return dict(manifest)


def _count(paths: list[Path], what: str) -> str:
    return f"{len(paths)} {what}"


def training(workspace: Workspace) -> Pipeline:
    """``python -m headway.train --config RECIPE train.output_dir=OUT [--resume]``."""

    def command(out: Path) -> list[str]:
        resume = ["--resume"] if list((out / "checkpoints").glob("step-*")) else []
        argv = [sys.executable, "-m", "headway.train", "--config", str(workspace.recipe)]
        return [*argv, f"train.output_dir={out}", *resume]

    def outcome(out: Path) -> dict[str, Any]:
        # Tensors only: the metadata holds a fresh weights_id per save.
        weights = shard_digest(out / "model.safetensors")["tensors"]
        return {"weights": weights, "leftovers": leftovers(out)}

    def progress(out: Path) -> str:
        checkpoints = sorted((out / "checkpoints").glob("step-*"))
        last = checkpoints[-1].name if checkpoints else "none"
        return f"{len(checkpoints)} checkpoints (last {last})"

    return Pipeline(
        "training",
        command,
        started=lambda out: (out / "train_config.json").is_file(),
        finished=lambda out: (out / "config.json").is_file(),  # save_heads moves it in last
        outcome=outcome,
        progress=progress,
    )


def features(workspace: Workspace) -> Pipeline:
    """``headway data cache-features`` of :data:`FEATURE_ROWS` text rows, three layers, fp32."""

    def command(out: Path) -> list[str]:
        argv = [HEADWAY, "data", "cache-features"]
        argv += [
            "--target",
            str(workspace.target),
            "--device",
            "cpu",
            "--data",
            str(workspace.text),
        ]
        argv += ["--layers", "0,1,2", "--feature-dtype", "float32", "--max-length", "64"]
        return [*argv, "--out", str(out)]

    def outcome(out: Path) -> dict[str, Any]:
        shards = {path.name: shard_digest(path) for path in sorted(out.glob("shard-*.safetensors"))}
        manifest = _without_timing(out / "manifest.json")
        return {"shards": shards, "manifest": manifest, "leftovers": leftovers(out)}

    return Pipeline(
        "features",
        command,
        started=lambda out: (out / "manifest.json").is_file(),
        finished=_complete,
        outcome=outcome,
        progress=lambda out: _count(sorted(out.glob("shard-*.safetensors")), "shards"),
    )


def regeneration(workspace: Workspace) -> Pipeline:
    """``headway data regenerate`` of 80 chat prompts (up to two user turns), 4 per shard."""

    def command(out: Path) -> list[str]:
        argv = [HEADWAY, "data", "regenerate"]
        argv += ["--target", str(workspace.target), "--dtype", "float32", "--device", "cpu"]
        argv += ["--mix", f"{workspace.chat}:80", "--max-turns", "2", "--max-new-tokens", "8"]
        return [*argv, "--batch-size", "4", "--shard-size", "4", "--out", str(out)]

    def outcome(out: Path) -> dict[str, Any]:
        shards = sorted((out / "data").glob("part-*.jsonl*"))
        rows = [row for path in shards for row in read_jsonl(path)]
        listed = [row["id"] for row in read_jsonl(prompts_path(out))]
        if not rows or not listed:
            raise AssertionError(f"{out}: the run left no shards or no prompt list")
        ids = [row["id"] for row in rows]
        return {
            "rows": rows,
            "missing": sorted(set(listed) - set(ids)),
            "duplicated": sorted({i for i in ids if ids.count(i) > 1}),
            "manifest": _without_timing(out / "manifest.json"),
            "leftovers": leftovers(out),
        }

    return Pipeline(
        "regeneration",
        command,
        started=lambda out: (out / "manifest.json").is_file(),
        finished=_complete,
        outcome=outcome,
        progress=lambda out: _count(sorted((out / "data").glob("part-*.jsonl*")), "shards"),
    )


def pipelines(workspace: Workspace) -> dict[str, Pipeline]:
    """Every pipeline issue #7 asks to kill, by name."""
    built = (training(workspace), features(workspace), regeneration(workspace))
    return {pipeline.name: pipeline for pipeline in built}


def _start(argv: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as sink:  # the child keeps its own descriptor
        return subprocess.Popen(argv, env=ENV, stdout=sink, stderr=subprocess.STDOUT)


def _wait(process: subprocess.Popen[bytes], log: Path) -> None:
    """Wait for `process` to exit; raise with the tail of its log unless it succeeded."""
    status = process.wait(timeout=TIMEOUT_S)
    if status != 0:
        tail = log.read_text(encoding="utf-8", errors="replace")[-3000:]
        raise RuntimeError(f"{process.args!r} exited with {status}:\n{tail}")


def _wait_for(
    done: Callable[[Path], bool], out: Path, process: subprocess.Popen[bytes]
) -> float | None:
    """Poll every 5 ms until ``done(out)`` (returns that moment) or the process has exited."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if done(out):
            return time.monotonic()
        if process.poll() is not None:
            return None
        time.sleep(0.005)
    raise TimeoutError(f"{process.args!r}: no progress in {out} after {TIMEOUT_S} s")


@dataclass(frozen=True)
class Reference:
    """The uninterrupted run: its outcome and the seconds from its first write to its last
    output."""

    outcome: dict[str, Any]
    window_s: float


def run_uninterrupted(pipeline: Pipeline, out: Path) -> Reference:
    """Run `pipeline` into the new folder `out` to the end."""
    log = out.with_name(f"{out.name}.log")
    process = _start(pipeline.command(out), log)
    began = _wait_for(pipeline.started, out, process)
    ended = _wait_for(pipeline.finished, out, process)
    _wait(process, log)
    window = ended - began if began is not None and ended is not None else 0.0
    return Reference(pipeline.outcome(out), window)


@dataclass(frozen=True)
class KillPoint:
    """One kill and resume: when the kill landed and whether the resumed outcome was exact."""

    delay_s: float
    killed: bool  # died before its last output was in place (else the kill came too late)
    at_kill: str  # what the folder held when the process died
    exact: bool
    differences: tuple[str, ...]


def kill_and_resume(
    pipeline: Pipeline, out: Path, delay_s: float, reference: Reference
) -> KillPoint:
    """Start `pipeline` into the new folder `out`, SIGKILL it `delay_s` seconds after it began
    writing, rerun it to the end, and compare with `reference`."""
    log = out.with_name(f"{out.name}.log")
    process = _start(pipeline.command(out), log)
    began = _wait_for(pipeline.started, out, process)
    if began is not None:
        time.sleep(max(0.0, began + delay_s - time.monotonic()))
    if process.poll() is None:
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=TIMEOUT_S)
    else:
        _wait(process, log)
    killed = process.returncode == -signal.SIGKILL and not pipeline.finished(out)
    at_kill = pipeline.progress(out)
    _wait(_start(pipeline.command(out), log), log)
    outcome = pipeline.outcome(out)
    differences = tuple(
        key if key != "leftovers" else f"leftovers {outcome.get(key)}"  # name what was left
        for key in sorted(reference.outcome.keys() | outcome.keys())
        if reference.outcome.get(key) != outcome.get(key)
    )
    return KillPoint(delay_s, killed, at_kill, not differences, differences)


def kill_delays(window_s: float, points: int, rng: random.Random) -> list[float]:
    """`points` random moments in ``[0, window_s)``, one in each of `points` equal slices, so a
    handful of points still covers the start, middle and end of the run."""
    return [window_s * (i + rng.random()) / points for i in range(points)]
