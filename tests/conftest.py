"""Shared fixtures: tiny random targets of several families, and the real embedded model (slow)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

# Before torch loads MKL: MKL's AVX2 kernels (Intel CPUs without AVX-512, or MKL limited to AVX2)
# sum in an order that depends on memory alignment, so a resumed training run differed from the
# uninterrupted one by 1e-8; strict conditional numerical reproducibility makes it bit-exact.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")
# Processes the tests start (command lines, scripts, two-process runs) take one thread each as the
# tests do: a child with a thread per core beside the other xdist worker ran 2x slower (the
# bench_gpu script's CPU run: 82 s under `make test`, 40 s alone on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Every test times what it times: no GEMM route or verify cost table kept from an earlier test or
# run (headway/timings.py; tests/test_timings.py turns it on in a folder of its own).
os.environ.setdefault("HEADWAY_TIMINGS", "off")

import pytest
import torch

from headway.target import Target, load_target
from tests.tiny import TINY_FAMILIES, tiny_model

# Workers of `pytest -n auto` (`make test`): each holds its own SmolLM2 and starts 2-process runs.
MAX_WORKERS = 4
WORKER_BYTES = 3 * 2**30  # a worker's peak resident memory stays well under this


@pytest.hookimpl(optionalhook=True)  # where pytest-xdist is not installed (a GPU machine)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker per core this process may run on, at most :data:`MAX_WORKERS`
    and one per :data:`WORKER_BYTES` of memory, at least one."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(1, min(cores or 1, MAX_WORKERS, memory // WORKER_BYTES))


@pytest.fixture(params=TINY_FAMILIES)
def tiny_family(request: pytest.FixtureRequest) -> str:
    """Each tiny architecture family in turn (Llama, Qwen2, GPT-2)."""
    return str(request.param)


@pytest.fixture
def tiny_target(tiny_family: str) -> Any:
    """A tiny random causal LM of each family, fp32, CPU."""
    return tiny_model(tiny_family)


@pytest.fixture(scope="session")
def smollm2() -> Target:
    """The real embedded SmolLM2-135M-Instruct, fp32, CPU (converted once into the cache)."""
    return load_target("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Tests run with one torch thread: on a loaded 2-core machine, OpenMP threads contending
    with each other made small-model tests 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
