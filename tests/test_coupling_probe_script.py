"""``scripts/coupling_probe.py`` (coupled against top-k drafting at temperature 1, the shipped
EAGLE-3 drafter on the embedded SmolLM2) runs here briefly: both tables print, and both ways
decode the same texts (the target's draws do not depend on the drafts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_coupling_probe_runs_and_both_ways_decode_the_same_texts() -> None:
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/coupling_probe.py", "--num-prompts", "2"]
    command += ["--max-new-tokens", "12", "--draws", "20", "--flatten", "0.8"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    table = [line for line in lines if line[:2] in ("1 ", "2 ", "4 ", "8 ")]
    assert len(table) == 4 and all(len(line.split("|")) == 4 for line in table)
    decoded = [line for line in lines if line.startswith(("top-k |", "coupled |"))]
    assert len(decoded) == 4 and all(line.endswith("| True") for line in decoded)
