"""``headway data regenerate --server URL``: answers from an OpenAI-compatible server.

The fast tests hold the retry rules and the HTTP client to a scripted stand-in server
(:mod:`tests.fault_server`). The slow ones start a real ``transformers serve`` on the embedded
SmolLM2-135M (fp32, CPU, one thread) and check that its answers equal the in-process engine's,
that the probe refuses a server that does not serve the target, that transient failures are
retried (a fault-injecting proxy in front of the real server), that a run stopped by a failure
resumes, and that a killed run resumes exactly (:mod:`tests.killing`).
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from headway.corpus.jsonl import read_jsonl
from headway.errors import ServerError
from headway.generation.in_flight import map_unordered
from headway.generation.server_client import (
    ChatServer,
    ServerOptions,
    TransientError,
    backoff_delay,
    server_url,
    with_retries,
)
from headway.target import DEFAULT_TARGET, Target, load_target, resolve_target_path
from headway.train.prompts import PromptItem
from headway.train.regenerate import RegenerateOptions, regenerate
from headway.train.server_answers import check_server, request_seed
from tests.fault_server import CANNED_TEXT, fault_server
from tests.killing import (
    kill_and_resume,
    kill_delays,
    make_workspace,
    regeneration,
    run_uninterrupted,
)
from tests.tiny import tiny_model
from tests.tokenizers_fixture import smollm2_tokenizer


def fast_retrying(url: str, model: str, **options: Any) -> ServerOptions:
    """Server options whose retries wait a millisecond or so, not seconds."""
    return ServerOptions(url, model, backoff_s=0.001, max_backoff_s=0.01, **options)


def read_all(out: Path) -> list[dict[str, Any]]:
    return [row for path in sorted((out / "data").glob("part-*")) for row in read_jsonl(path)]


def test_backoff_doubles_up_to_the_cap_with_jitter() -> None:
    rng = random.Random(0)
    for attempt, ceiling in enumerate([1.0, 2.0, 4.0, 8.0, 10.0, 10.0]):
        delay = backoff_delay(attempt, base=1.0, cap=10.0, rng=rng)
        assert ceiling / 2 <= delay < ceiling


def test_retries_transient_failures_then_gives_up_in_one_line() -> None:
    calls: list[int] = []
    waits: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise TransientError("HTTP 503", retry_after=5.0 if len(calls) == 2 else None)
        return "answer"

    assert (
        with_retries(flaky, retries=2, base=1.0, cap=60.0, what="w", sleep=waits.append) == "answer"
    )
    assert len(calls) == 3 and len(waits) == 2
    assert 0.5 <= waits[0] < 1.0 and waits[1] == 5.0  # the server's Retry-After, when longer

    def down() -> str:
        raise TransientError("ConnectionRefusedError: [Errno 111]")

    with pytest.raises(
        ServerError, match=r"w: gave up after 4 attempts, the last: Connection"
    ) as error:
        with_retries(down, retries=3, base=0.0, cap=0.0, what="w", sleep=lambda s: None)
    assert "\n" not in str(error.value)


def test_other_errors_are_not_retried() -> None:
    calls = []

    def refused() -> str:
        calls.append(1)
        raise ServerError("HTTP 400: bad request")

    with pytest.raises(ServerError, match="400"):
        with_retries(refused, retries=5, base=0.0, cap=0.0, what="w", sleep=lambda s: None)
    assert len(calls) == 1


def test_server_url_and_options_are_checked() -> None:
    assert server_url("http://host:8000/v1/") == "http://host:8000"
    assert server_url("https://h/proxy/v1") == "https://h/proxy"
    for bad in ("localhost:8000", "ftp://h", "http://"):
        with pytest.raises(ServerError, match="not an http"):
            server_url(bad)
    with pytest.raises(ServerError, match="concurrency"):
        ServerOptions("http://h", "m", concurrency=0)
    assert request_seed(0, "a", 1) == request_seed(0, "a", 1) != request_seed(0, "a", 0)


def test_map_unordered_yields_every_result_and_raises_the_first_error() -> None:
    assert sorted(map_unordered(lambda x: x * x, range(20), workers=4)) == [
        (x, x * x) for x in range(20)
    ]
    started = []

    def fail_on_three(x: int) -> int:
        started.append(x)
        if x == 3:
            raise ValueError("three")
        time.sleep(0.01)
        return x

    with pytest.raises(ValueError, match="three"):
        list(map_unordered(fail_on_three, range(100), workers=2))
    time.sleep(0.05)
    assert len(started) < 100  # nothing new starts after the failure


def test_client_retries_errors_that_may_pass() -> None:
    faults = ["503", "429", "drop", "truncate", "invalid"]
    with fault_server(faults) as (url, log):
        client = ChatServer(fast_retrying(url, "stub", retries=5))
        reply = client.chat(
            [{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, top_p=1
        )
        assert (reply.text, reply.completion_tokens, reply.finish_reason) == (
            CANNED_TEXT,
            8,
            "stop",
        )
        assert log.posts == [f"POST {fault}" for fault in [*faults, "pass"]]
    with fault_server(["503"] * 3) as (url, log):
        client = ChatServer(fast_retrying(url, "stub", retries=2))
        with pytest.raises(ServerError, match="gave up after 3 attempts, the last: HTTP 503"):
            client.chat([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, top_p=1)


def test_client_fails_at_once_on_a_client_error_with_the_servers_message() -> None:
    with fault_server(["400"]) as (url, log):
        client = ChatServer(fast_retrying(url, "stub", retries=5))
        with pytest.raises(ServerError, match=r"HTTP 400 .*max_tokens is too large") as error:
            client.chat([{"role": "user", "content": "hi"}], max_tokens=8, temperature=0, top_p=1)
        assert log.posts == ["POST 400"] and "\n" not in str(error.value)


def test_help_explains_every_server_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from headway.cli import main

    with pytest.raises(SystemExit):
        main(["data", "regenerate", "--help"])
    shown = capsys.readouterr().out
    for flag in ("--server URL", "--server-model NAME", "--server-check", "--concurrency N"):
        assert flag in shown
    assert "--retries N" in shown and "--request-timeout SECONDS" in shown


# ---- against a real server: `transformers serve` on the embedded SmolLM2-135M ----

OPTIONS = RegenerateOptions(max_new_tokens=10, batch_size=4, shard_size=2)
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def conversations() -> list[PromptItem]:
    turns = [
        ["What is the capital of France?", "And of Italy?"],
        ["Name a primary colour.", "Name another one."],
        ["Say hello in Spanish."],
    ]
    return [PromptItem(f"s/{i}", "test", user_turns) for i, user_turns in enumerate(turns)]


def _wait_until_serving(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"transformers serve exited: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=5):
                return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"transformers serve did not answer in 180 s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """``transformers serve FOLDER`` (fp32, CPU, one thread) on a free port: (URL, model name)."""
    for package in ("fastapi", "uvicorn", "openai"):
        pytest.importorskip(package, reason="`transformers serve` needs it (the dev extra)")
    folder = str(resolve_target_path(DEFAULT_TARGET))  # the embedded model, as a HF folder
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # free a moment ago; the next ones are tried if taken
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    command = [str(Path(sys.executable).with_name("transformers")), "serve", folder]
    command += ["--device", "cpu", "--dtype", "float32", "--host", "127.0.0.1"]
    for attempt in range(5):
        url = f"http://127.0.0.1:{port + attempt}"
        with log.open("ab") as sink:
            process = subprocess.Popen(
                [*command, "--port", str(port + attempt)], env=ENV, stdout=sink, stderr=sink
            )
        try:
            _wait_until_serving(url, process, log)
            break
        except BaseException as error:
            process.kill()  # ours; never left running
            process.wait()
            taken = isinstance(error, RuntimeError) and "address already in use" in log.read_text()
            if not taken or attempt == 4:
                raise
    try:
        yield url, folder
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def smollm2() -> Target:
    return load_target(DEFAULT_TARGET, dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def in_process(smollm2: Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The in-process engine's folder (batch, greedy, fp32) for :func:`conversations`."""
    out = tmp_path_factory.mktemp("in-process")
    regenerate(smollm2, conversations(), out, OPTIONS, mix={"test": 3})
    return out


@pytest.fixture(scope="module")
def reference(in_process: Path) -> list[dict[str, Any]]:
    return read_all(in_process)


@pytest.mark.slow
def test_server_answers_equal_the_in_process_engines(
    served: tuple[str, str], smollm2: Target, in_process: Path, tmp_path: Path
) -> None:
    """Greedy, fp32, two turns: the same text, token counts and finish reasons, turn by turn
    (each later turn sent after the server's own earlier answers), in the same shards."""
    url, model = served
    server = ServerOptions(url + "/v1", model, concurrency=3)
    manifest = regenerate(
        smollm2, conversations(), tmp_path, OPTIONS, mix={"test": 3}, server=server
    )
    rows = read_all(tmp_path)
    assert rows == read_all(in_process)
    in_process_settings = json.loads((in_process / "manifest.json").read_text())["settings"]
    assert [len(row["messages"]) for row in rows if row["id"] != "s/2"] == [4, 4]
    assert manifest["server"] == {"url": url, "model": model} and manifest["complete"]
    assert manifest["settings"] == in_process_settings  # a resume may switch engines
    assert len(list((tmp_path / "data").glob("part-*.jsonl.gz"))) == 2
    assert not list(tmp_path.rglob(".*"))  # no temporary file left


@pytest.mark.slow
def test_the_probe_refuses_a_server_that_does_not_serve_the_target(
    served: tuple[str, str], tmp_path: Path
) -> None:
    url, model = served
    wrong = ServerOptions(url, "someone/other-model")
    with pytest.raises(ServerError, match="does not serve 'someone/other-model'") as error:
        regenerate(None, conversations(), tmp_path, OPTIONS, mix={"test": 3}, server=wrong)
    assert "\n" not in str(error.value) and "--server-model" in str(error.value)
    assert not (tmp_path / "manifest.json").exists()  # refused before anything was written
    # A local target on other weights (and another tokenizer): the greedy probe parts.
    other = Target(tiny_model("llama", vocab_size=400), smollm2_tokenizer(), "tiny")
    with pytest.raises(ServerError, match="does not answer as the local target 'tiny'") as error:
        check_server(ChatServer(ServerOptions(url, model)), other)
    assert "\n" not in str(error.value) and "--server-check models" in str(error.value)


@pytest.mark.slow
def test_transient_failures_are_retried_and_a_failed_run_resumes(
    served: tuple[str, str], smollm2: Target, reference: list[dict[str, Any]], tmp_path: Path
) -> None:
    """503, a dropped connection and a truncated answer are retried and change nothing; a
    server that stays down stops the run in one line with only whole shards written, and the
    same call resumes it to the uninterrupted rows."""
    url, model = served
    with fault_server(["503", "drop", "truncate"], upstream=url) as (proxy, log):
        server = fast_retrying(proxy, model, concurrency=2, retries=3)
        regenerate(
            smollm2, conversations(), tmp_path / "retried", OPTIONS, mix={"test": 3}, server=server
        )
        assert read_all(tmp_path / "retried") == reference
        assert log.posts[:3] == ["POST 503", "POST drop", "POST truncate"]
    one_per_shard = replace(OPTIONS, shard_size=1)
    stopped = tmp_path / "stopped"
    with fault_server(["pass"] * 3 + ["503"] * 50, upstream=url) as (proxy, log):
        server = fast_retrying(proxy, model, concurrency=1, retries=2)
        with pytest.raises(ServerError, match="rerun the same command to resume") as error:
            regenerate(
                smollm2, conversations(), stopped, one_per_shard, mix={"test": 3}, server=server
            )
        assert "\n" not in str(error.value)
    written = sorted((stopped / "data").glob("part-*"))
    assert 1 <= len(written) < 3 and not list(stopped.rglob(".*"))
    server = ServerOptions(url, model, concurrency=2)
    regenerate(smollm2, conversations(), stopped, one_per_shard, mix={"test": 3}, server=server)
    assert read_all(stopped) == reference


@pytest.mark.slow
def test_a_killed_server_backed_run_resumes_exactly(
    served: tuple[str, str], tmp_path: Path
) -> None:
    """SIGKILL ``headway data regenerate --server`` at a random moment, rerun it: the rows
    and the manifest equal an uninterrupted run's, and no temporary file is left."""
    url, model = served
    workspace = make_workspace(tmp_path / "workspace")

    def command(out: Path) -> list[str]:
        argv = [str(Path(sys.executable).with_name("headway")), "data", "regenerate"]
        argv += ["--target", model, "--dtype", "float32", "--device", "cpu"]
        argv += ["--server", url, "--server-model", model, "--concurrency", "2"]
        argv += ["--server-check", "models"]  # the probe is tested above; no local model here
        argv += ["--mix", f"{workspace.chat}:9", "--max-turns", "2", "--max-new-tokens", "6"]
        return [*argv, "--shard-size", "2", "--out", str(out)]

    pipeline = replace(regeneration(workspace), command=command)
    uninterrupted = run_uninterrupted(pipeline, tmp_path / "reference")
    assert uninterrupted.outcome["manifest"]["server"] == {"url": url, "model": model}
    points = [  # one kill point: make test's time
        kill_and_resume(pipeline, tmp_path / f"killed-{index}", delay, uninterrupted)
        for index, delay in enumerate(kill_delays(uninterrupted.window_s, 1, random.Random(7)))
    ]
    for point in points:
        assert point.exact, (
            f"killed {point.delay_s:.2f} s in ({point.at_kill}): {point.differences}"
        )
    assert any(point.killed for point in points)
