"""The GPU-machine scripts (scripts/device/, run there by hand through the device tool) at least
parse, and none can stop its own shell with a self-matching ``pkill -f``."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.scripts_loader import load_script

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts" / "device").glob("*.sh"))


def device_script(name: str) -> ModuleType:
    """``scripts/device/NAME.py`` as a module."""
    return load_script(f"device/{name}.py")


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


def test_the_gpu_tests_collect_without_pytest_xdist() -> None:
    """The GPU machine runs ``python3 -m pytest -m gpu`` with its own Python, which has no
    pytest-xdist: the conftest's xdist hook must not stop pytest there."""
    import sys

    root = Path(__file__).resolve().parents[1]
    command = [sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider"]
    command += ["--collect-only", "-q", "-m", "gpu", "tests/test_gpu.py"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "test_gpu.py::" in result.stdout


@pytest.mark.slow
def test_bench_gpu_runs_end_to_end_on_the_cpu(tmp_path: Path) -> None:
    """``scripts/bench_gpu.py`` drives ``compare.py`` through its own parser: a run on the CPU
    with one prompt prints the decoding table and writes the JSON (the GPU run of 2026-11-25
    stopped on an option bench_gpu did not pass)."""
    import json
    import sys

    out = tmp_path / "bench.json"
    command = [sys.executable, "scripts/bench_gpu.py", "--device", "cpu", "--dtypes", "float32"]
    command += ["--num-prompts", "1", "--max-new-tokens", "4", "--verify", "eager"]
    command += ["--train-methods", "", "--gemm", "stock", "--json", str(out)]
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(command, capture_output=True, text=True, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "| float32 | hf greedy |" in result.stdout
    rows = json.loads(out.read_text())["decoding"]
    # the honest baselines of a GPU run: HF over a static cache, headway's own plain decoding
    wanted = {"hf greedy", "hf greedy, static cache", "headway, no drafter", "prompt lookup"}
    assert {row["drafter"] for row in rows} >= wanted
    assert all(row["identical"] == "1/1" for row in rows if row["drafter"] != "hf prompt lookup")


@pytest.mark.slow
def test_step_costs_runs_here_on_a_cpu(tmp_path: Path) -> None:
    """The one-call GPU script of issue #32 runs end to end on a CPU (uncaptured there): every
    table written, the static drafter's trees equal to the eager drafter's."""
    import json

    module = device_script("step_costs")
    argv = ["--device", "cpu", "--dtype", "float32", "--new-tokens", "6", "--repeats", "1"]
    argv += ["--verify", "captured"]  # compiling on a CPU is the slow test of test_captured.py
    trees = [{"top_k": 1, "depth": 2, "total_tokens": 3, "tau": 1.5}]
    trees += [{"top_k": 2, "depth": 2, "total_tokens": 4, "tau": 1.6}]
    (tmp_path / "trees.json").write_text(json.dumps({"trees": trees}))
    argv += ["--tree-taus", str(tmp_path / "trees.json")]
    module.main([*argv, "--prompt-tokens", "8", "--out", str(tmp_path)])
    data = json.loads((tmp_path / "step_costs.json").read_text())
    assert {"hf_static_tok_s", "plain_captured_tok_s", "verify_ms"} <= set(data)
    table = (tmp_path / "step_costs.md").read_text()
    for line in table.splitlines():
        if "trees equal" in line:
            equal, total = line.split("trees equal ")[1].split(";")[0].split("/")
            assert equal == total and int(total) > 0, line
    assert table.count("trees equal") == 2
    assert sum(key.startswith("device_step_ms") for key in data) == 2
    assert {"plain_sampled_tok_s", "sampled_device_step_ms"} <= set(data)
    assert {"tree_tok_s[1,2,3]", "tree_tok_s[2,2,4]"} <= set(data)
    assert data["best_tree"] in ([1, 2, 3], [2, 2, 4])


def test_chain_probe_runs_here_on_a_cpu(tmp_path: Path) -> None:
    """The chain probe runs on a CPU (uncaptured: runs are eager steps there): a row per
    chain length and drafter, chained tokens equal to single steps' and to HF's greedy."""
    module = device_script("chain_probe")
    argv = ["--device", "cpu", "--dtypes", "float32", "--chains", "1,2", "--repeats", "1"]
    module.main([*argv, "--new-tokens", "5", "--prompt-tokens", "6", "--out", str(tmp_path)])
    table = (tmp_path / "chain_probe.md").read_text()
    assert table.count("| plain |") == 2 and table.count("| eagle3 32 |") == 2
    assert "plain: chains with chain 1's tokens: [1, 2]" in table
    assert table.count("equal to HF eager greedy: True") == 4


@pytest.mark.slow
def test_decode_figures_runs_here_on_a_cpu(tmp_path: Path) -> None:
    """The real-target device script of issue #32 runs on a CPU (uncaptured there): in float32
    every row, the device step's trees among them, gives HF greedy's output (static cache),
    each table is written as measured, and a section past the budget is skipped, not
    started."""
    import json

    module = device_script("decode_figures")
    argv = ["--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "4", "--trees", "16,32"]
    module.main([*argv, "--sections", "float32,sampled", "--budget-s", "0", "--out", str(tmp_path)])
    skipped = (tmp_path / "decode_figures.md").read_text()
    assert "float32: skipped" in skipped and "sampled: skipped" in skipped  # budget spent
    assert not (tmp_path / "decode_figures.json").exists()
    module.main([*argv, "--sections", "float32", "--out", str(tmp_path)])
    (rows,) = json.loads((tmp_path / "decode_figures.json").read_text()).values()
    names = [row["drafter"] for row in rows]
    assert names[:3] == [module.HF_EAGER, module.HF_STATIC, module.PLAIN]
    assert f"{module.PLAIN}, 8 tokens a run" in names
    assert sum("device step" in name for name in names) == 3  # default, largest, default x8
    assert all(row["identical"] == "1/1" for row in rows)
    assert "x plain captured" in (tmp_path / "decode_figures.md").read_text()


@pytest.mark.slow
def test_decode_figures_drops_a_row_that_fails_and_measures_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A row that raises in its first generation (a capture that fails on a GPU, say) is noted
    with its error and dropped; the section's other rows are measured."""
    import json

    module = device_script("decode_figures")
    broken = module.Row("broken row", lambda *_: (lambda: 1 / 0, []))
    monkeypatch.setattr(module, "plain_row", lambda *args, **kwargs: broken)
    argv = ["--device", "cpu", "--num-prompts", "1", "--max-new-tokens", "2", "--trees", "16"]
    module.main([*argv, "--sections", "float32", "--out", str(tmp_path)])
    assert (
        "row 'broken row' dropped: ZeroDivisionError"
        in (tmp_path / "decode_figures.md").read_text()
    )
    (rows,) = json.loads((tmp_path / "decode_figures.json").read_text()).values()
    names = [row["drafter"] for row in rows]
    assert names[0] == module.HF_EAGER and "broken row" not in names
    assert sum("device step" in name for name in names) == 2  # a read a step, 8 steps a run
