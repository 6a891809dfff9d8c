"""``scripts/cost_table_spread.py`` runs on a tiny target: both ways of timing a table, each
table printed, and the spread table with one row per way and block size."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.scripts_loader import load_script
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def test_both_ways_are_timed_and_tabled(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("cost_table_spread.py")
    folder = tmp_path / "target"
    tiny_model("llama").save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    script.main(["--target", str(folder), "--tables", "2"])
    out = capsys.readouterr().out
    assert out.count("one size after another (") == 2 and out.count("in turn (") == 2
    rows = [line for line in out.splitlines() if line.startswith("| in turn |")]
    assert [row.split("|")[2].strip() for row in rows] == [str(m) for m in script.SIZES[1:]]
