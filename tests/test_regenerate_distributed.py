"""``accelerate launch`` with 2 CPU processes splits regeneration by shard: the rows, prompt
list and manifest equal a one-process run's, and a resume may change the process count."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from headway.corpus.jsonl import read_jsonl
from headway.train.regenerate import prompts_path
from tests.killing import ENV, HEADWAY, make_workspace
from tests.launching import accelerate_launch


def regenerate_argv(target: Path, chat: Path, out: Path) -> list[str]:
    return [
        *("data", "regenerate", "--target", str(target), "--dtype", "float32", "--device", "cpu"),
        *("--mix", f"{chat}:20", "--max-turns", "2", "--max-new-tokens", "6"),
        *("--batch-size", "4", "--shard-size", "3", "--out", str(out)),
    ]


def launch(argv: list[str], processes: int) -> None:
    if processes == 1:
        result = subprocess.run(
            [HEADWAY, *argv], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert result.returncode == 0, result.stderr[-3000:]
    else:
        accelerate_launch([HEADWAY, *argv], processes=processes, timeout_s=300)


def outcome(out: Path) -> dict[str, Any]:
    rows = [row for path in sorted((out / "data").glob("part-*")) for row in read_jsonl(path)]
    manifest = json.loads((out / "manifest.json").read_text())
    for key in ("seconds_this_run", "processes"):
        manifest.pop(key)
    return {"rows": rows, "prompts": read_jsonl(prompts_path(out)), "manifest": manifest}


def test_two_processes_write_what_one_writes(tmp_path: Path) -> None:
    workspace = make_workspace(tmp_path / "ws")
    one, two = tmp_path / "one", tmp_path / "two"
    launch(regenerate_argv(workspace.target, workspace.chat, one), 1)
    launch(regenerate_argv(workspace.target, workspace.chat, two), 2)
    assert outcome(two) == outcome(one)
    assert json.loads((two / "manifest.json").read_text())["processes"] == 2
    assert len(list((two / "data").glob("part-*"))) == 7  # ceil(20 / 3)
    assert not list(two.rglob(".*"))  # no lock or temporary file left
    # Half the shards gone: a one-process resume redoes exactly those.
    for path in sorted((two / "data").glob("part-*"))[::2]:
        path.unlink()
    launch(regenerate_argv(workspace.target, workspace.chat, two), 1)
    assert outcome(two) == outcome(one)
