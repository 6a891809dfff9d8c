"""A tiny HTTP server that fails chat-completion requests on a script, then forwards them to a
real OpenAI-compatible server (or, with no upstream, answers them itself): the faults a
regeneration through a server must survive, on demand.

Faults, one per POST in order (then every POST passes): ``"503"`` (Service Unavailable),
``"429"`` (with ``Retry-After: 0``), ``"400"`` (a client error with a message), ``"drop"``
(the connection is closed with no answer), ``"truncate"`` (an answer cut off before its
announced length), ``"invalid"`` (200 with a body that is not JSON), ``"pass"``.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CANNED_TEXT = "Paris is the capital of France."


@dataclass
class FaultLog:
    """The faults still to come and every request seen (``"GET /v1/models"``, ``"POST 503"``)."""

    faults: list[str]
    seen: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_fault(self) -> str:
        with self.lock:
            return self.faults.pop(0) if self.faults else "pass"

    def note(self, entry: str) -> None:
        with self.lock:
            self.seen.append(entry)

    @property
    def posts(self) -> list[str]:
        with self.lock:
            return [entry for entry in self.seen if entry.startswith("POST")]


def _canned(path: str, body: bytes) -> tuple[int, bytes]:
    """What the stand-in upstream answers: one model, or :data:`CANNED_TEXT`."""
    if path.endswith("/v1/models"):
        return 200, json.dumps({"object": "list", "data": [{"id": "stub"}]}).encode()
    request = json.loads(body)
    answer = {
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": CANNED_TEXT},
                "finish_reason": "stop",
            }
        ],
        "usage": {"completion_tokens": 8, "prompt_tokens": len(str(request["messages"]))},
    }
    return 200, json.dumps(answer).encode()


def _handler(log: FaultLog, upstream: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # quiet tests

        def _forward(self, body: bytes | None) -> tuple[int, bytes]:
            if upstream is None:
                return _canned(self.path, body or b"")
            request = urllib.request.Request(
                upstream + self.path,
                data=body,
                method=self.command,
                headers={"Content-Type": "application/json"},
            )
            try:
                with urllib.request.urlopen(request, timeout=600) as response:
                    return response.status, response.read()
            except urllib.error.HTTPError as error:
                return error.code, error.read()

        def _send(self, status: int, body: bytes, *, length: int | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body) if length is None else length))
            if status == 429:
                self.send_header("Retry-After", "0")
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            log.note(f"GET {self.path}")
            self._send(*self._forward(None))

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            fault = log.next_fault()
            log.note(f"POST {fault}")
            if fault in ("503", "429"):
                self._send(int(fault), b'{"error": "busy, try again"}')
            elif fault == "400":
                message = {"error": {"message": "max_tokens is too large for this model"}}
                self._send(400, json.dumps(message).encode())
            elif fault == "drop":
                self.close_connection = True  # nothing written: the client sees the socket close
            elif fault == "truncate":
                status, answer = self._forward(body)
                self._send(status, answer[: len(answer) // 2], length=len(answer))
                self.close_connection = True
            elif fault == "invalid":
                self._send(200, b"<html>502 Bad Gateway</html>")
            else:
                self._send(*self._forward(body))

    return Handler


@contextmanager
def fault_server(
    faults: Sequence[str], upstream: str | None = None
) -> Iterator[tuple[str, FaultLog]]:
    """A server on a free local port (its URL and log) that fails POSTs as `faults` say and
    forwards everything else to `upstream`; stopped on exit."""
    log = FaultLog(list(faults))
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(log, upstream))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
