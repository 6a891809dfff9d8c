"""SIGKILL at random moments, then resume: training, feature caching and regeneration end
exactly where an uninterrupted run ends (issue #7, point 1).

Two kill points per pipeline (one in each half of its writing time) keep this file to a couple
of minutes; ``scripts/kill_resume.py --points N`` tries many more with the same helpers.
"""

from __future__ import annotations

import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from headway.atomic import atomic_dir, remove_dead_writers_leftovers, write_text_atomic
from headway.heads.io import staged_directory
from tests.killing import (
    Workspace,
    kill_and_resume,
    kill_delays,
    make_workspace,
    pipelines,
    run_uninterrupted,
)

POINTS = 2


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Workspace:
    return make_workspace(tmp_path_factory.mktemp("kill"))


@pytest.mark.parametrize("name", ["training", "features", "regeneration"])
def test_killed_run_resumes_to_the_uninterrupted_result(workspace: Workspace, name: str) -> None:
    pipeline = pipelines(workspace)[name]
    reference = run_uninterrupted(pipeline, workspace.root / f"{name}-reference")
    assert reference.window_s > 0
    assert reference.outcome["leftovers"] == []
    delays = kill_delays(reference.window_s, POINTS, random.Random(7))
    points = []
    for index, delay in enumerate(delays):
        out = workspace.root / f"{name}-killed-{index}"
        point = kill_and_resume(pipeline, out, delay, reference)
        where = f"killed {delay:.2f} s in ({point.at_kill})"
        assert point.exact, f"{name} {where}: resumed run differs in {point.differences}"
        points.append(point)
    assert any(point.killed for point in points), f"{name}: every kill came after the last output"


def die_during(code: str, out: Path) -> None:
    """Run `code` in a child Python with ``out`` bound; the code SIGKILLs its own process."""
    prelude = "import os, signal, sys\nfrom pathlib import Path\nout = Path(sys.argv[1])\n"
    result = subprocess.run([sys.executable, "-c", prelude + code, str(out)], check=False)
    assert result.returncode == -signal.SIGKILL


def test_the_next_heads_save_removes_a_killed_saves_staging_folder(tmp_path: Path) -> None:
    run = tmp_path / "run"
    die_during(
        "from headway.heads.io import staged_directory\n"
        "with staged_directory(out) as staging:\n"
        "    (staging / 'model.safetensors').write_bytes(b'half')\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n",
        run,
    )
    (left,) = tmp_path.iterdir()
    assert left.name.startswith(".run.saving-")
    with staged_directory(run) as staging:
        (staging / "config.json").write_text("{}")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["run"]
    assert [path.name for path in run.iterdir()] == ["config.json"]


def test_a_live_saves_staging_folder_is_kept(tmp_path: Path) -> None:
    run = tmp_path / "run"
    with staged_directory(run) as outer:  # e.g. another thread of this process saving
        with staged_directory(run) as inner:
            (inner / "config.json").write_text("{}")
        assert outer.is_dir()


# A writer killed inside atomic_file, with a temporary of its own beside the name it was given
# (safetensors' save_file writes ``.tmpXXXXXX`` and renames it: the feature cache's kill test
# once found one left in the run's folder).
KILLED_INSIDE_ATOMIC_FILE = (
    "from headway.atomic import atomic_file\n"
    "with atomic_file(out) as temporary:\n"
    "    (temporary.parent / '.tmpAb3dEf').write_bytes(b'half a shard')\n"
    "    os.kill(os.getpid(), signal.SIGKILL)\n"
)


def test_the_next_atomic_write_removes_a_killed_writes_temporary(tmp_path: Path) -> None:
    shard = tmp_path / "shard-00000.safetensors"
    die_during(KILLED_INSIDE_ATOMIC_FILE, shard)
    assert len(list(tmp_path.glob(".shard-00000.safetensors.staging-*"))) == 1
    write_text_atomic(shard, "whole")
    assert [path.name for path in tmp_path.iterdir()] == [shard.name]


def test_a_run_taking_the_folder_removes_a_killed_writers_own_temporary(tmp_path: Path) -> None:
    die_during(KILLED_INSIDE_ATOMIC_FILE, tmp_path / "shard-00003.safetensors")
    assert list(tmp_path.rglob(".tmp*")), "the simulated writer's temporary is there"
    remove_dead_writers_leftovers(tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_a_folder_swap_killed_halfway_gets_the_old_folder_back(tmp_path: Path) -> None:
    out = tmp_path / "export"
    with atomic_dir(out) as staging:
        (staging / "version").write_text("1")
    # Killed after moving the old folder aside and before renaming the new one into place.
    die_during(
        "from headway.atomic import atomic_dir\n"
        "rename = Path.rename\n"
        "def rename_then_die(self, target):\n"
        "    rename(self, target)\n"
        "    if Path(target).name == 'old':\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "Path.rename = rename_then_die\n"
        "with atomic_dir(out, overwrite=True) as staging:\n"
        "    (staging / 'version').write_text('2')\n",
        out,
    )
    assert not out.exists() and len(list(tmp_path.iterdir())) == 2  # staging + retired
    with pytest.raises(FileExistsError):
        atomic_dir(out).__enter__()  # the old folder is back, so this is refused
    assert (out / "version").read_text() == "1"
    assert [path.name for path in tmp_path.iterdir()] == ["export"]
