"""Crash-safe writes: complete files only, with normal permissions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from headway.atomic import atomic_dir, atomic_file, write_text_atomic


def test_written_file_has_plain_open_permissions(tmp_path: Path) -> None:
    write_text_atomic(tmp_path / "a.json", "{}")
    reference = tmp_path / "b.json"
    reference.write_text("{}")
    assert (tmp_path / "a.json").stat().st_mode == reference.stat().st_mode


def test_atomic_file_keeps_plain_permissions_when_the_writer_does_not(tmp_path: Path) -> None:
    """safetensors' save_file re-creates its file owner-only; the final file must not be."""
    tensors = {"w": torch.zeros(2)}
    with atomic_file(tmp_path / "model.safetensors") as temporary:
        save_file(tensors, str(temporary))
    reference = tmp_path / "plain.bin"
    reference.write_bytes(b"")
    assert (tmp_path / "model.safetensors").stat().st_mode == reference.stat().st_mode


def test_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "weights.bin"
    target.write_text("old")
    with pytest.raises(RuntimeError), atomic_file(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["weights.bin"]


def test_atomic_dir_replaces_only_when_complete(tmp_path: Path) -> None:
    out = tmp_path / "export"
    with atomic_dir(out) as staging:
        (staging / "config.json").write_text("1")
    with pytest.raises(FileExistsError):
        atomic_dir(out).__enter__()
    with pytest.raises(RuntimeError), atomic_dir(out, overwrite=True) as staging:
        (staging / "config.json").write_text("2")
        raise RuntimeError("killed")
    assert (out / "config.json").read_text() == "1"
    with atomic_dir(out, overwrite=True) as staging:
        (staging / "config.json").write_text("3")
    assert (out / "config.json").read_text() == "3"
    plain = tmp_path / "plain"
    plain.mkdir()
    assert out.stat().st_mode == plain.stat().st_mode
    plain.rmdir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export"]
