"""``accelerate launch`` with 2 CPU processes splits feature caching by shard: the shards and
manifest equal a one-process run's, and a resume may change the process count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.killing import make_workspace, shard_digest
from tests.test_regenerate_distributed import launch


def cache_argv(target: Path, chat: Path, out: Path) -> list[str]:
    return [
        *("data", "cache-features", "--target", str(target), "--dtype", "float32"),
        *("--device", "cpu", "--data", str(chat), "--limit", "20", "--layers", "1,2"),
        *("--feature-dtype", "float32", "--batch-size", "2", "--shard-samples", "3"),
        *("--out", str(out)),
    ]


def outcome(out: Path) -> dict[str, Any]:
    shards = {path.name: shard_digest(path) for path in sorted(out.glob("shard-*"))}
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("seconds_this_run", "processes"):
        manifest.pop(key)
    return {"shards": shards, "manifest": manifest}


def test_two_processes_write_what_one_writes(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path / "ws")
    one, two = tmp_path / "one", tmp_path / "two"
    launch(cache_argv(workspace.target, workspace.chat, one), 1)
    launch(cache_argv(workspace.target, workspace.chat, two), 2)
    assert outcome(two) == outcome(one)
    assert json.loads((two / "manifest.json").read_text())["processes"] == 2
    assert len(outcome(two)["shards"]) >= 4
    assert not list(two.rglob(".*"))  # no lock or temporary file left
    for path in sorted(two.glob("shard-*"))[::2]:  # half the shards gone: a resume redoes them
        path.unlink()
    launch(cache_argv(workspace.target, workspace.chat, two), 1)
    assert outcome(two) == outcome(one)
