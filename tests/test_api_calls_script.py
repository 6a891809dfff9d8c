"""``scripts/api_calls.py`` (what a ``headway.generate`` call costs beyond its decoding) runs
here on a CPU, with a tiny saved target, and finds the two ways' outputs equal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def test_api_calls_script_runs_here_on_a_cpu(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    tokenizer = smollm2_tokenizer()
    tiny_model("llama", vocab_size=len(tokenizer)).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/api_calls.py", "--target", str(folder)]
    command += ["--device", "cpu", "--dtype", "float32", "--max-new-tokens", "6"]
    command += ["--questions", "2", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    table = (tmp_path / "api_calls.md").read_text()
    assert "| nothing kept (before) |" in table and "| kept between calls (now) |" in table
    assert "greedy outputs that differ between the two: 0" in table
