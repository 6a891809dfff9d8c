"""``scripts/batch_speed.py`` (several prompts at once against one at a time, and HF) runs here
on a CPU with a tiny saved target, and every way's outputs equal HF greedy one at a time."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def saved_chat_target(folder: Path) -> Any:
    """A tiny Llama with SmolLM2's tokenizer (its chat template) saved in ``folder``, room for
    MT-bench's prompts (up to 618 tokens); returns the model."""
    tokenizer = smollm2_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer))
    model.config.max_position_embeddings = 1024
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return model


def test_batch_speed_script_runs_here_on_a_cpu(tmp_path: Path) -> None:
    folder = tmp_path / "tiny-llama"
    saved_chat_target(folder)
    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "scripts/batch_speed.py", "--target", str(folder)]
    command += ["--device", "cpu", "--max-new-tokens", "8", "--num-prompts", "3"]
    command += ["--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = [line for line in (tmp_path / "batch_speed.md").read_text().splitlines() if "| " in line]
    assert len(rows) == 1 + 6  # the header, six ways
    assert all(row.rstrip().endswith("| 3/3 |") for row in rows[1:]), rows
