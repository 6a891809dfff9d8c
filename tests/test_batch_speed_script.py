"""``scripts/batch_speed.py`` (several prompts at once against one at a time, and HF) runs here
on a CPU with a tiny saved target, and every way's outputs equal HF greedy one at a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def test_batch_speed_script_runs_here_on_a_cpu(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    tokenizer = smollm2_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.max_position_embeddings = 1024  # MT-bench prompts reach 618 tokens
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/batch_speed.py", "--target", str(folder)]
    command += ["--device", "cpu", "--max-new-tokens", "8", "--num-prompts", "3"]
    command += ["--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in (tmp_path / "batch_speed.md").read_text().splitlines() if "| " in line]
    assert len(rows) == 1 + 6  # the header, six ways
    assert all(row.rstrip().endswith("| 3/3 |") for row in rows[1:]), rows
