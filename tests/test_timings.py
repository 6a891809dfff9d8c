"""Timings remembered between runs (``headway/timings.py``): measured once per key, kept in the
cache folder, measured again under ``HEADWAY_TIMINGS=retime`` or another machine key, never read
under ``off``; an unreadable or unwritable file costs a measurement, never an error. The GEMM
route and the verify cost table go through it."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from headway.decode import gemm, gemm_routes
from headway.decode import generate as generate_module
from headway.decode.generate import Decoder
from headway.decode.options import DecodeOptions
from headway.drafters.lookup import PromptLookupDrafter
from headway.timings import TIMINGS_NAME, remembered, shapes_digest
from tests.tiny import tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Timings on, kept in a cache folder of this test's own; the file's path."""
    monkeypatch.setenv("HEADWAY_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HEADWAY_TIMINGS", "on")
    return tmp_path / "cache" / TIMINGS_NAME


class Counted:
    """A measurement that returns ``value`` and counts its calls."""

    def __init__(self, value: Any) -> None:
        self.value, self.calls = value, 0

    def __call__(self) -> Any:
        self.calls += 1
        return self.value


def _remember(measure: Counted, **key: Any) -> Any:
    return remembered("a test timing", key, measure, device=CPU, valid=lambda v: v is not None)


def test_a_timing_is_measured_once_per_key_and_kept_in_the_file(kept: Path) -> None:
    measure = Counted([0.1, 0.2])
    assert _remember(measure, size=2) == [0.1, 0.2]
    assert _remember(measure, size=2) == [0.1, 0.2]
    assert measure.calls == 1
    assert _remember(Counted("other"), size=3) == "other"  # another key: measured
    data = json.loads(kept.read_text())
    assert data["schema"] == "headway.timings/1" and len(data["entries"]) == 2
    (entry, _) = data["entries"].values()
    assert entry["key"]["threads"] == torch.get_num_threads() and entry["key"]["size"] == 2


def test_a_timing_asked_again_in_this_process_reads_no_file(kept: Path) -> None:
    """A second decoder in the same process (``headway.generate`` makes one per call) takes the
    value this process already has: the file is not read again, let alone the layers timed."""
    measure = Counted([0.1, 0.2])
    assert _remember(measure, size=2) == [0.1, 0.2]
    kept.write_text('{"schema": "headway.timings/1", "entries": {}}')  # emptied by another run
    again = _remember(measure, size=2)
    assert again == [0.1, 0.2] and measure.calls == 1
    again.append(9.9)  # a caller changing its copy changes nobody else's
    assert _remember(measure, size=2) == [0.1, 0.2]


def test_retime_measures_again_and_off_never_reads_or_writes(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _remember(Counted("first"), size=1)
    monkeypatch.setenv("HEADWAY_TIMINGS", "retime")
    assert _remember(Counted("second"), size=1) == "second"
    monkeypatch.setenv("HEADWAY_TIMINGS", "on")
    assert _remember(Counted("third"), size=1) == "second"  # the retimed value was kept
    kept.unlink()
    monkeypatch.setenv("HEADWAY_TIMINGS", "off")
    measure = Counted("fresh")
    assert _remember(measure, size=1) == _remember(measure, size=1) == "fresh"
    assert measure.calls == 2 and not kept.exists()


def test_another_thread_count_is_another_machine(kept: Path) -> None:
    measure = Counted("x")
    threads = torch.get_num_threads()
    try:
        _remember(measure)
        torch.set_num_threads(threads + 1)
        _remember(measure)
    finally:
        torch.set_num_threads(threads)
    assert measure.calls == 2


DAMAGED = ["not json", '{"schema": "other"}', '{"schema": "headway.timings/1", "entries": 3}']


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_file_is_measured_over(kept: Path, damage: str) -> None:
    kept.parent.mkdir(parents=True)
    kept.write_text(damage)
    measure = Counted(1.5)
    assert _remember(measure) == 1.5 and _remember(measure) == 1.5
    assert measure.calls == 1  # the file was rewritten whole


def test_a_kept_value_the_caller_rejects_is_measured_again(kept: Path) -> None:
    _remember(Counted(None))  # kept, but rejected by _remember's validity check
    measure = Counted("good")
    assert _remember(measure) == "good" and measure.calls == 1


def test_an_unwritable_cache_folder_still_gives_the_value(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder would be")
    monkeypatch.setenv("HEADWAY_CACHE", str(blocker))
    monkeypatch.setenv("HEADWAY_TIMINGS", "on")
    assert _remember(Counted(7)) == 7


def test_the_shapes_digest_follows_shapes_and_dtypes_not_values() -> None:
    one, same = tiny_model("llama", seed=0), tiny_model("llama", seed=1)
    assert shapes_digest(one) == shapes_digest(same)
    assert shapes_digest(one) != shapes_digest(tiny_model("qwen2"))
    assert shapes_digest(one) != shapes_digest(tiny_model("llama").to(torch.bfloat16))


def test_the_gemm_route_of_a_model_of_the_same_shapes_is_not_timed_again(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def fastest(*args: Any, **kwargs: Any) -> str:
        calls.append("timed")
        return "transposed"

    monkeypatch.setattr(gemm, "fastest_route", fastest)
    assert gemm.apply_gemm(tiny_model("llama", seed=0), "auto") == "transposed"
    assert gemm.apply_gemm(tiny_model("llama", seed=1), "auto") == "transposed"
    assert calls == ["timed"]
    entry = next(iter(json.loads(kept.read_text())["entries"].values()))
    assert entry["key"]["kind"] == "the GEMM route" and entry["value"] == "transposed"


def test_cost_sizing_times_the_verify_forward_once_per_shapes(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []

    def table(model: Any, sizes: int, **kwargs: Any) -> list[float]:
        calls.append(sizes)
        return [0.01 * (1 + m / 8) for m in range(sizes)]

    monkeypatch.setattr(generate_module, "verify_cost_table", table)
    prompt = torch.tensor([[5, 6, 7, 5, 6, 7, 5, 6]])
    outputs = []
    for seed in (0, 1):  # two loads of one model: a second process, say
        model = tiny_model("llama", seed=seed)
        gemm.apply_gemm(model, "stock")
        decoder = Decoder(model, PromptLookupDrafter(), DecodeOptions(sizing="cost"))
        outputs.append(decoder.generate(prompt[0], max_new_tokens=6, eos_token_ids=()).tokens)
    assert len(calls) == 1 and len(outputs[1]) == 6


def test_a_kept_packed_route_the_probe_now_refuses_is_timed_again(
    kept: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    routes = iter(["packed", "stock"])
    monkeypatch.setattr(gemm, "fastest_route", lambda *args, **kwargs: next(routes))
    for module in (gemm, gemm_routes):  # the route's check and the timed candidates
        monkeypatch.setattr(module, "packing_available", lambda dtype=None: True)
    monkeypatch.setattr(gemm, "packed_weight", lambda module: None)  # no reorder in this test
    assert gemm.apply_gemm(tiny_model("llama", seed=0), "auto") == "packed"
    for module in (gemm, gemm_routes):  # the route's check and the timed candidates
        monkeypatch.setattr(module, "packing_available", lambda dtype=None: False)
    assert gemm.apply_gemm(tiny_model("llama", seed=1), "auto") == "stock"


def test_env_lists_and_forgets_the_kept_timings(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``headway env --timings`` prints one line per kept timing (a route as is, a cost table as
    milliseconds per block size), ``--forget-timings`` removes them and the next run times again."""
    from headway.cli import main

    assert _remember(Counted("transposed"), layers="abc") == "transposed"
    table = [0.1 + 0.01 * m for m in range(16)]
    assert remembered(
        "the verify cost table", {"sizes": 16}, Counted(table), device=CPU, valid=bool
    )
    assert main(["env", "--timings"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith(f"2 kept timings in {kept}:")
    assert "a test timing: transposed" in printed and "layers abc" in printed
    assert "ms per verify of N tokens, 1: 100.0, 2: 110.0, 4: 130.0, 8: 170.0, 16: 250.0" in printed
    assert main(["env", "--forget-timings"]) == 0
    assert f"removed 2 kept timings from {kept}" in capsys.readouterr().out
    assert not kept.exists()
    measure = Counted("stock")
    assert _remember(measure, layers="abc") == "stock" and measure.calls == 1  # timed again
    assert main(["env", "--timings"]) == 0
    assert capsys.readouterr().out.startswith("1 kept timings in")


@pytest.mark.parametrize(("others_s", "kept_file"), [(3.0, False), (0.0, True), (None, True)])
def test_a_timing_taken_while_other_processes_are_busy_is_used_not_kept(
    kept: Path, monkeypatch: pytest.MonkeyPatch, others_s: float | None, kept_file: bool
) -> None:
    """Other processes' CPU time during a measurement (``/proc/stat`` less this process's own)
    above ``BUSY_SHARE`` of the cores: the value is used for the rest of this process but the
    next process measures again; an idle machine, or one whose load cannot be read, keeps it."""
    from headway import timings

    monkeypatch.setattr(timings, "MIN_JUDGED_S", 0.0)
    readings = iter([100.0, 100.0 + others_s] if others_s is not None else [None, None])
    monkeypatch.setattr(timings, "_busy_seconds", lambda: next(readings, None))
    monkeypatch.setattr(timings.time, "process_time", lambda: 5.0)  # this process: no CPU time
    measure = Counted("transposed")
    assert _remember(measure, layers="abc") == "transposed"
    assert kept.exists() == kept_file
    monkeypatch.setattr(timings, "_busy_seconds", lambda: None)
    assert _remember(measure, layers="abc") == "transposed" and measure.calls == 1  # taken
    monkeypatch.setattr(timings, "_TAKEN", {})  # as in the next process
    assert _remember(measure, layers="abc") == "transposed"
    assert measure.calls == (1 if kept_file else 2)


def test_the_load_of_a_measurement_is_read_from_this_machine() -> None:
    """On Linux the busy time since boot is readable and grows; a measurement of this process
    alone is judged (it spins long enough), and its own CPU time is not counted as others'."""
    from headway import timings

    before = timings._busy_seconds()
    if before is None:
        pytest.skip("no /proc/stat here")

    def spin() -> int:
        start = time.perf_counter()
        while time.perf_counter() - start < timings.MIN_JUDGED_S + 0.1:
            pass
        return 7

    value, others = timings._with_load(spin)
    assert value == 7 and others is not None and 0.0 <= others <= (os.cpu_count() or 1)
    after = timings._busy_seconds()
    assert after is not None and after >= before + timings.MIN_JUDGED_S * 0.5


def test_forgetting_timings_that_cannot_be_removed_is_a_one_line_error(
    kept: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from headway.cli import main

    (kept / "in the way").mkdir(parents=True)  # a folder where the file would be
    assert main(["env", "--forget-timings"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.count("\n") == 0 and f"cannot remove {kept}" in error


def test_a_kept_cost_table_is_valid_only_as_positive_finite_float_seconds() -> None:
    from headway.timings import seconds_table

    valid = seconds_table(2)
    assert valid([0.1, 0.2])
    for table in ([0.1], [0.1, 0.0], [0.1, float("inf")], [0.1, "x"], [1, 2], (0.1, 0.2), None):
        assert not valid(table), table


def test_a_timing_kept_by_other_code_is_measured_again(
    kept: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key holds a hash of the decoding sources: an edit there (or an upgrade) times again;
    an edit elsewhere in headway does not change it."""
    from headway import timings

    source = Path(timings.__file__).parent
    copy = tmp_path / "headway"
    for folder in timings.TIMED_CODE:
        (copy / folder).mkdir(parents=True)
        for path in (source / folder).glob("*.py"):
            (copy / folder / path.name).write_bytes(path.read_bytes())
    before = timings.code_digest(copy)
    assert before == timings.code_digest()  # the sources as installed
    (copy / "train").mkdir()
    (copy / "train" / "loop.py").write_text("# training code: not what timings measure\n")
    assert timings.code_digest(copy) == before
    with (copy / "decode" / "static_cache.py").open("a") as file:
        file.write("# an edit\n")
    assert timings.code_digest(copy) != before
    measure = Counted("x")
    _remember(measure)
    monkeypatch.setattr(timings, "code_digest", lambda root=None: "other code")
    _remember(measure)
    assert measure.calls == 2
