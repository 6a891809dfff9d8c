"""``scripts/compare.py --draft-vocab FILE:N,...`` adds, for each EAGLE or Medusa run, a
cost-sized row drafting over the N most frequent tokens of the file (FR-Spec); a bad value is a
usage error."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest

from headway.target import load_target
from tests.scripts_loader import load_script
from tests.test_eagle3 import tiny4
from tests.test_formats import random_run
from tests.tokenizers_fixture import smollm2_tokenizer


def _compare() -> ModuleType:
    return load_script("compare.py")


@pytest.mark.parametrize("method", ["eagle1", "eagle3", "medusa1"])
def test_draft_vocab_rows_narrow_each_eagle_run(
    method: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    compare = _compare()
    folder = tmp_path / "target"  # four layers, as EAGLE-3 needs; the tokenizer's 400 ids
    tiny4("llama", vocab_size=400).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    target = load_target(folder, device="cpu")
    run = random_run(tmp_path / method, method, target.model)
    ranked = tmp_path / "draft_vocab.json"
    ranked.write_text(json.dumps({"token_ids": list(range(399, -1, -1))}))
    args = compare.parse_args([str(run), "--draft-vocab", f"{ranked}:8,32"])
    rows = {row.name: row for row in compare.configurations(args, target)}
    narrowed = [name for name in rows if "most frequent" in name]
    assert [name.split(", ")[-1].split()[0] for name in narrowed] == ["8", "32"]
    drafters = [rows[name].drafter.inner for name in narrowed]
    if method == "medusa1":
        sizes = [drafter.heads.config.vocab_size for drafter in drafters]
    else:
        sizes = [drafter._vocabulary_size() for drafter in drafters]
    assert sizes[0] <= 8 < sizes[1] <= 32  # EAGLE-3: those of its own draft vocabulary
    for bad in ("x.json", "x.json:0", "x.json:a,4"):
        with pytest.raises(SystemExit):
            compare.parse_args(["--draft-vocab", bad])


def test_draft_dtype_rows_apply_to_an_eagle_default_only(tmp_path: Path) -> None:
    """``--draft-dtype target,auto`` gives the default drafter a row per dtype where it is an
    EAGLE drafter; a tiny target's default (no shipped drafter fits: prompt lookup or retrieval)
    has no draft model, so it keeps its one row."""
    compare = _compare()
    folder = tmp_path / "target"
    tiny4("llama", vocab_size=400).save_pretrained(folder)
    smollm2_tokenizer().save_pretrained(folder)
    target = load_target(folder, device="cpu")
    args = compare.parse_args(["--draft-dtype", "target,auto"])
    names = [row.name for row in compare.configurations(args, target)]
    assert len([name for name in names if name.startswith("default drafter")]) == 1
    assert not [name for name in names if "draft dtype" in name]
