"""One writer per output folder: a second process is refused naming the holder, a SIGKILLed
holder leaves no stale lock, and a finished writer leaves no file behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from headway.errors import FolderBusyError
from headway.locks import LOCK_NAME, exclusive_folder
from headway.target import Target
from headway.train.prompts import PromptItem
from headway.train.regenerate import RegenerateOptions, regenerate
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer

HOLD = (
    "import sys, time; from pathlib import Path; from headway.locks import exclusive_folder\n"
    "with exclusive_folder(Path(sys.argv[1])):\n"
    "    print('locked', flush=True); time.sleep(60)\n"
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """A second process holding the lock of ``tmp_path / 'out'``."""
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    yield process
    process.kill()
    process.wait()


def test_second_writer_is_refused_naming_the_holder(
    holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    with pytest.raises(FolderBusyError) as caught, exclusive_folder(tmp_path / "out"):
        pass
    message = str(caught.value)
    assert f"(pid {holder.pid})" in message and "\n" not in message


def test_sigkilled_holder_leaves_no_stale_lock(
    holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with exclusive_folder(tmp_path / "out"):  # the kernel dropped the dead holder's lock
        assert (tmp_path / "out" / LOCK_NAME).read_text().strip() == str(os.getpid())
    assert not (tmp_path / "out" / LOCK_NAME).exists()  # no leftover once done


def test_lock_is_released_on_error(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError), exclusive_folder(tmp_path):
        raise RuntimeError
    with exclusive_folder(tmp_path):
        pass
    assert list(tmp_path.iterdir()) == []


def test_regeneration_into_a_busy_folder_is_refused(
    holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    target = Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")
    items = [PromptItem("t/0", "test", ["hi"])]
    with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
        regenerate(target, items, tmp_path / "out", RegenerateOptions(), mix={"t": 1})
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_NAME]  # untouched
