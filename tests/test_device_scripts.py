"""The GPU-machine scripts (scripts/device/, run there by hand through the device tool) at least
parse, and none can stop its own shell with a self-matching ``pkill -f``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts" / "device").glob("*.sh"))


def test_there_are_device_scripts() -> None:
    assert {path.name for path in SCRIPTS} >= {"env.sh", "stage.sh", "join.sh", "train.sh"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_each_script_parses(script: Path) -> None:
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_pkill_patterns_cannot_match_the_shell_that_runs_them(script: Path) -> None:
    """``pkill -f "data regenerate"`` also matches a ``bash -c`` whose command line holds those
    words, and SIGSTOP then freezes the caller: patterns start with a bracket class."""
    for pattern in re.findall(r'pkill\s+-\w+\s+-f\s+"([^"]+)"', script.read_text()):
        assert pattern.startswith("["), f"{script.name}: pkill -f {pattern!r}"


def test_python_dash_m_headway_is_the_headway_command() -> None:
    """The scripts run ``python3 -m headway`` from a checkout on PYTHONPATH (nothing installed)."""
    import sys

    from headway import __version__

    result = subprocess.run(
        [sys.executable, "-m", "headway", "--version"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert __version__ in result.stdout
