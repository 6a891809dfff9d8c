"""A client of an OpenAI-compatible chat-completions server (vLLM, SGLang, llama.cpp's server,
``transformers serve``): the server-backed way to let a target answer.

Standard library only (``urllib``): one connection per request, so many threads may call one
:class:`ChatServer` at once (:func:`headway.generation.in_flight.map_unordered`). Every request is
retried with exponential backoff when the failure may pass (a timeout, a refused or dropped
connection, HTTP 429 or 5xx, a body that is cut off or not the JSON asked for) and fails at once
when it will not (any other 4xx: the server's own message is passed on).
"""

from __future__ import annotations

import http.client
import json
import random
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from email.message import Message
from typing import Any, TypeVar

from headway.errors import ServerError

__all__ = [
    "ChatServer",
    "Reply",
    "ServerOptions",
    "TransientError",
    "backoff_delay",
    "server_url",
    "with_retries",
]

Result = TypeVar("Result")
_MESSAGE_CHARS = 300  # of a server's error body, quoted in one line


@dataclass(frozen=True)
class ServerOptions:
    """Where the answers come from and how hard to try.

    Attributes:
        url: the server's base URL (``http://host:8000``; a trailing ``/v1`` is accepted).
        model: the name the server lists the target under in ``GET /v1/models``.
        concurrency: conversations in flight at once (each sends its turns one after another).
        retries: further attempts of a request after a transient failure.
        request_timeout: seconds a request may wait on the server before it counts as failed.
        backoff_s: the first retry's delay; each later one doubles, up to ``max_backoff_s``.
    """

    url: str
    model: str
    concurrency: int = 16
    retries: int = 5
    request_timeout: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if self.concurrency < 1 or self.retries < 0:
            raise ServerError(
                f"concurrency must be >= 1 and retries >= 0, got {self.concurrency}, {self.retries}"
            )
        if not self.request_timeout > 0 or self.backoff_s < 0 or self.max_backoff_s < 0:
            raise ServerError("request_timeout must be > 0 and the backoff delays >= 0")
        if not self.model.strip():
            raise ServerError("the server model name is empty; pass --server-model NAME")
        server_url(self.url)  # refuse a URL that is not http(s) before any request


@dataclass(frozen=True)
class Reply:
    """One chat completion: the text, the tokens the server counts, its finish reason."""

    text: str
    completion_tokens: int
    finish_reason: str  # as the server says it: "stop", "length", ...


class TransientError(Exception):
    """A failure that may pass: retry after ``retry_after`` seconds if the server said so."""

    def __init__(self, reason: str, retry_after: float | None = None) -> None:
        super().__init__(reason)
        self.retry_after = retry_after


def server_url(url: str) -> str:
    """``http://host:8000/v1/`` -> ``http://host:8000``; anything but http(s) is refused."""
    parsed = urllib.parse.urlsplit(url.strip())
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ServerError(f"--server {url!r} is not an http(s) URL; e.g. http://localhost:8000")
    path = parsed.path.rstrip("/")
    path = path.removesuffix("/v1")
    return urllib.parse.urlunsplit((parsed.scheme, parsed.netloc, path, "", ""))


def backoff_delay(attempt: int, *, base: float, cap: float, rng: random.Random) -> float:
    """The wait before retry ``attempt`` (0 for the first): ``min(cap, base·2^attempt)``, scaled
    by a random factor in [0.5, 1) so that many clients failing together do not retry in step."""
    return min(cap, base * 2.0**attempt) * (0.5 + 0.5 * rng.random())


def with_retries(
    call: Callable[[], Result],
    *,
    retries: int,
    base: float,
    cap: float,
    what: str,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> Result:
    """``call()``, tried again up to `retries` times while it raises :class:`TransientError`
    (waiting :func:`backoff_delay`, or the server's ``Retry-After`` up to `cap`); any other
    exception goes through at once.

    Raises:
        ServerError: every attempt failed; names `what`, the attempts and the last reason.
    """
    rng = rng or random.Random()
    for attempt in range(retries + 1):
        try:
            return call()
        except TransientError as error:
            if attempt == retries:
                raise ServerError(
                    f"{what}: gave up after {retries + 1} attempts, the last: {error}"
                ) from None
            delay = backoff_delay(attempt, base=base, cap=cap, rng=rng)
            if error.retry_after is not None:
                delay = min(cap, max(delay, error.retry_after))
            sleep(delay)
    raise AssertionError("unreachable")  # the loop returns or raises


def _one_line(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= _MESSAGE_CHARS else flat[:_MESSAGE_CHARS] + "..."


def _error_message(body: bytes) -> str:
    """The message in an error body: OpenAI's ``{"error": {"message"}}``, FastAPI's
    ``{"detail"}``, ``{"error": "..."}`` or ``{"message"}``; else the body's text."""
    text = body.decode("utf-8", errors="replace")
    try:
        data = json.loads(text)
    except ValueError:
        return _one_line(text) or "(empty body)"
    if isinstance(data, dict):
        error = data.get("error")
        for found in (
            error.get("message") if isinstance(error, dict) else error,
            data.get("detail"),
            data.get("message"),
        ):
            if found:
                return _one_line(found if isinstance(found, str) else json.dumps(found))
    return _one_line(text)


def _body_of(error: urllib.error.HTTPError) -> bytes:
    """An error answer's body, or nothing where reading it fails too."""
    try:
        return error.read()
    except (OSError, http.client.HTTPException):
        return b""


def _retry_after(headers: Message) -> float | None:
    try:
        return max(0.0, float(headers.get("Retry-After", "")))
    except (TypeError, ValueError):
        return None  # absent, or an HTTP date (rare for these servers): our own backoff then


class ChatServer:
    """Requests to one server, each retried as :class:`ServerOptions` says; thread-safe."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.url = server_url(options.url)

    def _attempt(self, path: str, body: dict[str, Any] | None) -> Any:
        """One request; its JSON answer, or :class:`TransientError` / :class:`ServerError`."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.url + path,
            data=data,
            method="GET" if body is None else "POST",
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=self.options.request_timeout) as response:
                raw = response.read()
        except urllib.error.HTTPError as error:
            message = _error_message(_body_of(error))
            status = f"HTTP {error.code} from {self.url}{path}: {message}"
            if error.code == 429 or error.code >= 500:
                raise TransientError(status, _retry_after(error.headers)) from None
            raise ServerError(status) from None
        except (OSError, http.client.HTTPException) as error:
            # Refused, reset or dropped connections, timeouts, bodies cut short.
            reason = getattr(error, "reason", None) or error
            raise TransientError(f"{type(error).__name__}: {reason}") from None
        try:
            return json.loads(raw)
        except ValueError:
            start = _one_line(raw[:80].decode(errors="replace"))
            raise TransientError(f"not JSON ({len(raw)} bytes, truncated?): {start}") from None

    def _call(
        self, path: str, body: dict[str, Any] | None, parse: Callable[[Any], Result]
    ) -> Result:
        def attempt() -> Result:
            answer = self._attempt(path, body)
            try:
                return parse(answer)
            except (KeyError, IndexError, TypeError, ValueError, AttributeError) as error:
                raise TransientError(
                    f"an unexpected answer ({error!r}): {_one_line(str(answer))}"
                ) from None

        return with_retries(
            attempt,
            retries=self.options.retries,
            base=self.options.backoff_s,
            cap=self.options.max_backoff_s,
            what=f"{self.url}{path}",
        )

    def models(self) -> list[str]:
        """The model names ``GET /v1/models`` lists."""
        return self._call("/v1/models", None, lambda data: [str(m["id"]) for m in data["data"]])

    def chat(
        self,
        messages: Sequence[dict[str, str]],
        *,
        max_tokens: int,
        temperature: float,
        top_p: float,
        seed: int | None = None,
    ) -> Reply:
        """The server's answer to `messages` (its chat template applied), not streamed.

        ``seed`` is sent when given (vLLM, SGLang and llama.cpp seed that request alone;
        ``transformers serve`` reseeds its global generator)."""
        body: dict[str, Any] = {
            "model": self.options.model,
            "messages": list(messages),
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "stream": False,
        }
        if seed is not None:
            body["seed"] = seed
        return self._call("/v1/chat/completions", body, _reply)


def _reply(data: Any) -> Reply:  # Any: a JSON object of the server's, checked here
    choice = data["choices"][0]
    text = choice["message"].get("content") or ""
    tokens = data["usage"]["completion_tokens"]
    if not isinstance(text, str) or not isinstance(tokens, int):
        raise TypeError("content is not text or usage.completion_tokens not an integer")
    return Reply(text, tokens, str(choice.get("finish_reason")))
