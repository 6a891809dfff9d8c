"""The multi-process tests' launcher stops a hung tree in bounded time and says where it hung
(``tests/launching.py``): a worker in a session of its own, as torch's elastic agent starts
them, is found and stopped too."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from tests.launching import ENV, descendants, process_stat, stop_tree

# A parent that starts a worker in a session of its own (out of reach of killpg), both waiting
# forever on an event, as a worker stuck in a collective would.
HUNG = """
import subprocess, sys, threading
worker = "import threading; threading.Event().wait()"
subprocess.Popen([sys.executable, "-c", worker], start_new_session=True)
threading.Event().wait()
"""


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (an orphan waits for init to reap it)."""
    fields = process_stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_hung_tree_is_stopped_with_every_processs_stacks() -> None:
    launcher = subprocess.Popen(
        [sys.executable, "-c", HUNG],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 30
    while not descendants(launcher.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    (worker,) = descendants(launcher.pid)
    assert os.getsid(worker) == worker != os.getsid(launcher.pid)  # a session of its own
    time.sleep(1)  # both waiting
    started = time.monotonic()
    stacks = stop_tree(launcher, grace_s=1.0)
    assert time.monotonic() - started < 20
    assert launcher.returncode is not None
    assert not running(worker)
    # faulthandler's dump of both processes (PYTHONFAULTHANDLER in the launch environment)
    assert stacks.count("most recent call first") >= 2, stacks
