"""``scripts/batch_proxy.py`` (eager ops and host reads a step of a batch's drafting, one EAGLE
drafter per row against every row at once) runs here on a tiny saved target and drafter: the
outputs are equal both ways, and drafting every row at once reads the device once a step and
dispatches fewer ops."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from headway.heads.eagle import EagleConfig, EagleModel
from tests.test_batch_speed_script import saved_chat_target
from tests.test_eagle_drafter import save_run


def test_batch_proxy_script_runs_here_on_a_cpu(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    model = saved_chat_target(folder)
    run = save_run(tmp_path / "run", model, EagleModel(EagleConfig.from_target(model)))
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/batch_proxy.py", "--target", str(folder)]
    command += ["--heads", str(run), "--num-prompts", "3", "--max-new-tokens", "6"]
    command += ["--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    text = (tmp_path / "batch_proxy.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ")][1:]
    (_, steps, ops, _, reads), (_, steps_at_once, ops_at_once, _, reads_at_once) = rows
    assert steps == steps_at_once and float(reads) > float(reads_at_once) == 1.0
    assert int(ops) > int(ops_at_once)
    assert "outputs equal both ways: True" in text
