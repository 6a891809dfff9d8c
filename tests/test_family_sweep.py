"""``scripts/family_sweep.py``: a tiny model of any transformers family, shrunk from its config
class's defaults, classified by what headway does with it: exact, refused in one line, or a bug
(other tokens, or a traceback inside headway), which fails the script."""

from __future__ import annotations

from typing import Any

import pytest

from tests.scripts_loader import load_script


def _script() -> Any:
    return load_script("family_sweep.py")


def test_families_are_classified_and_a_bug_fails_the_sweep(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script()
    assert script.main(["llama", "qwen3_next", "bloom"]) == 0
    out = capsys.readouterr().out
    assert "| llama | exact | yes | distinct=" in out
    assert "| qwen3_next | refused | - | TargetError: this qwen3_next target: its layer 0" in out
    assert "| bloom | refused | - | TargetError: this bloom target's forward fails" in out
    assert out.rstrip().endswith("1 exact, 2 refused")

    from headway.decode import generate

    def wrong(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(self, *args, **kwargs)
        result.tokens[3] += 1
        return result

    real = generate.Decoder.generate
    monkeypatch.setattr(generate.Decoder, "generate", wrong)
    assert script.main(["llama"]) == 1
    assert "| llama | MISMATCH | - | eager: first differs at token 3 |" in capsys.readouterr().out


def test_a_traceback_inside_headway_is_reported_where_it_happened(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    script = _script()
    from headway.decode import forwards

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise IndexError("out of range")

    monkeypatch.setattr(forwards, "compact_cache", broken)  # the eager path's compaction
    assert script.main(["llama"]) == 1
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith("| llama | ERROR in headway | - | eager: IndexError: out of range at ")
    assert " at forwards.py:" in row  # the innermost frame of headway's own code
