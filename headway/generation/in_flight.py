"""Many calls in flight at once, results as they come: a bounded pool of daemon threads.

Not :class:`concurrent.futures.ThreadPoolExecutor`: its workers are joined when the interpreter
exits, so a run stopped by an error (or Ctrl-C) would wait for every request still in flight to
time out. Daemon threads end with the process; after the first failure no new call starts.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar, cast

__all__ = ["map_unordered"]

Input = TypeVar("Input")
Output = TypeVar("Output")


def map_unordered(
    function: Callable[[Input], Output], inputs: Iterable[Input], *, workers: int
) -> Iterator[tuple[Input, Output]]:
    """``(x, function(x))`` for every input, in the order the calls finish, with at most
    `workers` calls running at once (each on its own daemon thread).

    The first exception a call raises is raised here; no call starts after it (or after the
    caller stops iterating), and those already running finish on their own threads.

    Example::

        >>> sorted(map_unordered(len, ["ab", "c"], workers=2))
        [('ab', 2), ('c', 1)]
    """
    todo: queue.SimpleQueue[Input] = queue.SimpleQueue()
    count = 0
    for item in inputs:
        todo.put(item)
        count += 1
    done: queue.SimpleQueue[tuple[Input, Output | None, BaseException | None]]
    done = queue.SimpleQueue()
    stop = threading.Event()

    def work() -> None:
        while not stop.is_set():
            try:
                item = todo.get_nowait()
            except queue.Empty:
                return
            try:
                done.put((item, function(item), None))
            except BaseException as error:  # handed to the caller, who raises it
                done.put((item, None, error))
                return

    for _ in range(min(workers, count)):
        threading.Thread(target=work, daemon=True, name="headway-in-flight").start()
    try:
        for _ in range(count):
            item, output, error = done.get()
            if error is not None:
                raise error
            yield item, cast(Output, output)  # set whenever error is None
    finally:
        stop.set()
