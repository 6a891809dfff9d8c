"""scripts/proxy_chain.py: the CPU proxy's counts per drafter, one device step a run against
chained runs, on the real target."""

from __future__ import annotations

import pytest

from tests.scripts_loader import load_script


@pytest.mark.slow
def test_chained_runs_read_the_host_less_and_fault_nowhere(
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = load_script("proxy_chain.py")
    module.main(["--num-prompts", "1", "--max-new-tokens", "6", "--chains", "1,3"])
    out = capsys.readouterr().out
    rows = [line.split(" | ") for line in out.splitlines() if "step(s) a run" in line]
    faults = [row[-1] for row in rows if len(row) == 7]
    assert len(faults) == 4 and all(fault == "none |" for fault in faults)  # 2 rows, 2 chains
    reads = {row[0][2:]: int(row[3]) for row in rows if len(row) == 5}
    assert reads["no drafter, 3 step(s) a run"] < reads["no drafter, 1 step(s) a run"]
    eagle = sorted(name for name in reads if name.startswith("EAGLE"))
    assert reads[eagle[1]] < reads[eagle[0]]  # "..., 3 step(s)" sorts after "..., 1 step(s)"
