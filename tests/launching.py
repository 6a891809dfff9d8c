"""``accelerate launch`` for the multi-process tests: one launcher, each launch on its own port.

The tests run in parallel (``pytest -n``, pytest-xdist): two launches on accelerate's default
rendezvous port (29500) at once would join each other's process group, so every launch gets a
port the operating system just handed out. The launcher runs in its own session, so a timeout
kills it and its workers together and leaves no orphan holding the port or a core.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

# One thread per process: the machine is shared, and thread count must not change results.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


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
    timeout_s: float = 600.0,
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
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.communicate()
        raise
    assert launcher.returncode == 0, stderr[-4000:]
