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
from headway.locks import LOCK_NAME, exclusive_folder, rank_lock_name
from headway.target import Target
from headway.train.loop import train
from headway.train.prompts import PromptItem
from headway.train.regenerate import RegenerateOptions, regenerate
from tests.test_packing import config, workspace  # noqa: F401  (module-scoped fixture)
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


def test_taking_a_folder_sweeps_temporaries_of_killed_writers(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(dead.stdout)
    (tmp_path / "data").mkdir()
    shard = tmp_path / "data" / f".part-00003.jsonl.gz.tmp-{dead_pid}-0123456789ab"
    shard.write_bytes(b"half a shard")
    checkpoint = tmp_path / f".step-40.staging-{dead_pid}-0123456789ab"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors").write_bytes(b"x")
    mine = tmp_path / f".manifest.json.tmp-{os.getpid()}-0123456789ab"  # a live writer's
    mine.write_bytes(b"{}")
    retired = tmp_path / f".run.old-{dead_pid}-0123456789ab"  # atomic_dir recovers these
    retired.mkdir()
    keep = tmp_path / ".gitignore"
    keep.write_text("*\n")
    with exclusive_folder(tmp_path):
        pass
    assert not shard.exists() and not checkpoint.exists()
    assert mine.exists() and retired.exists() and keep.exists()


def test_training_into_a_busy_run_folder_is_refused(
    holder: subprocess.Popen[str],
    tmp_path: Path,
    workspace: Path,  # noqa: F811
) -> None:
    settings = config(workspace, "medusa1", f"train.output_dir={tmp_path / 'out'}")
    with pytest.raises(FolderBusyError, match=f"pid {holder.pid}.*train.output_dir"):
        train(settings)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_NAME]  # untouched


def test_each_rank_of_a_launch_has_its_own_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert rank_lock_name() == f"{LOCK_NAME}.rank-1"
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert rank_lock_name() == LOCK_NAME


def test_feature_caching_and_quickstart_into_a_busy_folder_are_refused(
    holder: subprocess.Popen[str], tmp_path: Path
) -> None:
    import datasets

    from headway.quickstart.pipeline import run_quickstart
    from headway.train.features import cache_features

    rows = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]], "loss_mask": [[0, 1, 1]]})
    with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
        cache_features(tiny_model("llama"), rows, tmp_path / "out", layers=(2,))
    with pytest.raises(FolderBusyError, match=f"pid {holder.pid}"):
        run_quickstart(tmp_path / "out", tiny=True)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [LOCK_NAME]  # untouched


HOLD_OUTPUT = (
    "import sys, time; from pathlib import Path; from headway.locks import exclusive_output\n"
    "with exclusive_output(Path(sys.argv[1])):\n"
    "    print('locked', flush=True); time.sleep(60)\n"
)


def test_an_export_into_a_folder_being_exported_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headway.cli import main
    from tests.test_eagle3 import tiny4
    from tests.test_formats import random_run

    run = random_run(tmp_path / "run", "medusa1", tiny4("llama"))
    out = tmp_path / "export"
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD_OUTPUT, str(out)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None and process.stdout.readline().strip() == "locked"
        assert main(["export", str(run), "--format", "medusa", "--out", str(out)]) == 2
        error = capsys.readouterr().err
        assert f"{out} is being written by another headway process (pid {process.pid})" in error
        assert not out.exists()  # the export was refused before writing anything
    finally:
        process.kill()
        process.wait()
    assert main(["export", str(run), "--format", "medusa", "--out", str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


KILLED_CONVERSION = (
    "import sys, time; from pathlib import Path; from headway.atomic import temporary_name\n"
    "staging = temporary_name(Path(sys.argv[1]), 'staging'); staging.mkdir()\n"
    "(staging / 'model.safetensors').write_bytes(b'half a model')\n"
    "print(staging, flush=True); time.sleep(60)\n"
)


def test_a_killed_conversion_is_removed_by_the_next_conversion_of_any_gguf(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from headway.errors import TargetError
    from headway.gguf_target import convert_gguf

    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    targets = tmp_path / "cache" / "targets"
    targets.mkdir(parents=True)
    process = subprocess.Popen(
        [sys.executable, "-c", KILLED_CONVERSION, str(targets / "other-model-0123")],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    leftover = Path(process.stdout.readline().strip())
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    assert leftover.is_dir()
    broken = tmp_path / "broken.gguf"  # another GGUF: its conversion fails, after the sweep
    broken.write_bytes(b"GGUF but not really")
    with pytest.raises(TargetError, match="cannot be read as a GGUF causal LM") as caught:
        convert_gguf(broken)
    assert "\n" not in str(caught.value)
    assert not leftover.exists()
    assert sorted(p.name for p in targets.iterdir()) == []  # nor the failed conversion's


def test_training_removes_partial_checkpoints_of_killed_runs(
    workspace: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    partial = run / "checkpoints" / ".step-0000003.partial"  # what a SIGKILL mid-save leaves
    partial.mkdir(parents=True)
    (partial / "optimizer.bin").write_bytes(b"half")
    settings = config(
        workspace,
        "medusa1",
        f"train.output_dir={run}",
        "train.max_steps=2",
        "train.save_every=2",
        "train.eval_every=2",
        "train.warmup_steps=1",
        "train.batch_size=2",
    )
    train(settings)
    assert not partial.exists()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-0000002"]


SIGTERMED = (
    "import sys, time; from pathlib import Path; from headway.locks import exclusive_folder\n"
    "from headway.cli import sigterm_exits\n"
    "with sigterm_exits(), exclusive_folder(Path(sys.argv[1])):\n"
    "    print('locked', flush=True); time.sleep(60)\n"
)


def test_a_sigterm_ends_a_writer_without_leftovers(tmp_path: Path) -> None:
    """``headway`` turns SIGTERM into an exit that runs cleanup: the lock file goes with it."""
    process = subprocess.Popen(
        [sys.executable, "-c", SIGTERMED, str(tmp_path / "out")], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None and process.stdout.readline().strip() == "locked"
    assert (tmp_path / "out" / LOCK_NAME).exists()
    process.terminate()
    assert process.wait(timeout=30) == 128 + signal.SIGTERM
    assert list((tmp_path / "out").iterdir()) == []
