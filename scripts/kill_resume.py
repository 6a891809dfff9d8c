"""Kill headway's resumable pipelines at many random moments and count exact resumes.

    python scripts/kill_resume.py --points 10
    python scripts/kill_resume.py --points 20 --pipelines training --seed 3 --keep /tmp/kills

For each pipeline (training, feature caching, regeneration) one uninterrupted run gives the
reference; then each kill point starts a fresh run, sends SIGKILL at a random moment of its
writing time (one moment in each of N equal slices), resumes it with the same command and
compares final weights / shard bytes / rows, manifests and leftover temporaries with the
reference. Prints one line per kill point and, per pipeline, "kill points tried / resumed
exactly". The helpers are shared with tests/test_kill_resume.py (tests/killing.py).
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # for tests.killing

from tests.killing import (
    Pipeline,
    Workspace,
    kill_and_resume,
    kill_delays,
    make_workspace,
    pipelines,
    run_uninterrupted,
)

NAMES = ("training", "features", "regeneration")


def try_pipeline(pipeline: Pipeline, workspace: Workspace, points: int, seed: int) -> str:
    """Run the reference and `points` kill points of `pipeline`; return its summary line."""
    started = time.perf_counter()
    reference = run_uninterrupted(pipeline, workspace.root / f"{pipeline.name}-reference")
    print(f"{pipeline.name}: reference run writes for {reference.window_s:.2f} s", flush=True)
    killed = exact = 0
    for index, delay in enumerate(kill_delays(reference.window_s, points, random.Random(seed))):
        out = workspace.root / f"{pipeline.name}-killed-{index:03d}"
        point = kill_and_resume(pipeline, out, delay, reference)
        killed += point.killed
        exact += point.exact
        verdict = "exact" if point.exact else f"DIFFERS in {', '.join(point.differences)}"
        state = "killed" if point.killed else "killed after its last output"
        print(
            f"  {pipeline.name} #{index}: {state} at +{delay:.3f} s ({point.at_kill}); "
            f"resumed: {verdict}",
            flush=True,
        )
    minutes = (time.perf_counter() - started) / 60
    return (
        f"{pipeline.name}: {points} kill points tried ({killed} before the last output), "
        f"{exact} resumed exactly  [{minutes:.1f} min]"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--points", type=int, default=10, help="kill points per pipeline")
    parser.add_argument(
        "--pipelines", default=",".join(NAMES), help=f"comma-separated subset of {NAMES}"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it (default: temp)")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.pipelines.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(NAMES))
    if unknown or args.points < 1:
        parser.error(f"unknown pipelines {unknown}" if unknown else "--points must be >= 1")
    with tempfile.TemporaryDirectory(prefix="kill-resume-") as scratch:
        root = args.keep if args.keep is not None else Path(scratch)
        workspace = make_workspace(root)
        built = pipelines(workspace)
        summary = [try_pipeline(built[name], workspace, args.points, args.seed) for name in chosen]
    print("\n".join(["", "kill points tried / resumed exactly:", *summary]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
