"""``accelerate launch`` for the multi-process tests: one launcher, each launch on its own port.

The tests run in parallel (``pytest -n``, pytest-xdist): two launches on accelerate's default
rendezvous port (29500) at once would join each other's process group, so every launch gets a
port the operating system just handed out.

A launch that outlives its timeout fails in bounded time, saying where it hung: torch's elastic
agent starts each worker in a session of its own (out of reach of ``killpg``), and a worker
left behind keeps the launcher's pipes open, so waiting for the output would wait for it. On a
timeout every process below the launcher (found through ``/proc`` before any is killed) gets
SIGABRT first, which makes each Python process print every thread's stack
(``PYTHONFAULTHANDLER``), then SIGKILL. (2026-11-27: a worker stuck after its run had saved
its heads held a test for 16 minutes.)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# One thread per process: the machine is shared, and thread count must not change results.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
ENV["PYTHONFAULTHANDLER"] = "1"  # a hung process prints its stacks on SIGABRT (module docstring)


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago (the OS picks it)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def accelerate_launch(
    program: list[str],
    *,
    processes: int = 2,
    config_file: Path | None = None,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    timeout_s: float = 300.0,
) -> None:
    """Run ``program`` (what follows the launcher's own flags: ``["-m", module, ...]`` or an
    executable and its arguments) in ``processes`` CPU processes over gloo, or as the
    ``config_file`` says; assert it exits 0, showing the end of its stderr otherwise."""
    command = [sys.executable, "-m", "accelerate.commands.launch"]
    if config_file is not None:
        command += ["--config_file", str(config_file)]
    else:  # on a CPU-only machine --multi_gpu runs the processes over gloo (--cpu would run one)
        command += ["--multi_gpu", "--num_processes", str(processes), "--num_machines", "1"]
        command += ["--mixed_precision", "no"]
    command += ["--dynamo_backend", "no", "--main_process_port", str(free_port()), *program]
    launcher = subprocess.Popen(
        command,
        cwd=cwd,
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        _, stderr = launcher.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        stacks = stop_tree(launcher)
        raise AssertionError(
            f"{' '.join(program)} still ran after {timeout_s:.0f} s; the end of its stderr, "
            f"with each process's stacks:\n{stacks[-8000:]}"
        ) from None
    assert launcher.returncode == 0, stderr[-4000:]


def process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state, parent, ...), or None
    for a process that is gone (or ended while being read)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, children first (Linux ``/proc``; none found elsewhere)."""
    children: dict[int, list[int]] = {}
    for folder in Path("/proc").glob("[0-9]*"):
        fields = process_stat(int(folder.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(folder.name))
    found: list[int] = []
    frontier = [pid]
    while frontier:
        below = [child for parent in frontier for child in children.get(parent, [])]
        found += below
        frontier = below
    return found


def stop_tree(launcher: subprocess.Popen[str], grace_s: float = 5.0) -> str:
    """SIGABRT the launcher and every process below it (each Python process prints its
    threads' stacks), SIGKILL whatever is left after ``grace_s``; return the rest of its
    stderr."""
    tree = [launcher.pid, *descendants(launcher.pid)]
    for signal_number in (signal.SIGABRT, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):  # ended already
                os.kill(pid, signal_number)
        if signal_number == signal.SIGABRT:
            time.sleep(grace_s)
    try:
        _, stderr = launcher.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # a process this could not see still holds the pipes
        launcher.kill()
        return "(no stderr: a process outside the launcher's tree still holds its pipes)"
    return stderr or ""
