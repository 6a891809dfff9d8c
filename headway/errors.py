"""headway's own exceptions.

Every error a user can cause (a bad file, a bad key, a wrong pairing) is raised as a subclass of
:class:`HeadwayError` with a message that says what was wrong, where, and what to do. The CLI prints
such errors as one line and exits with status 2; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class HeadwayError(Exception):
    """Base class for errors caused by user input, files or environment."""


class ConfigError(HeadwayError):
    """A config file or override is invalid (unknown key, wrong type, impossible value)."""


class DataError(HeadwayError):
    """A dataset file or row cannot be used (malformed JSON, missing turns, bad encoding)."""


class TargetError(HeadwayError):
    """A target model cannot be found or loaded, or does not match what was expected."""


class FolderBusyError(HeadwayError):
    """Another live process is writing the output folder (see :mod:`headway.locks`)."""


class TrainingError(HeadwayError):
    """Training cannot go on (a non-finite loss, a missing checkpoint, a stale feature cache)."""


class HardwareError(HeadwayError, ValueError):
    """A route or dtype that this machine cannot run was asked for by name (e.g. ``--gemm
    packed`` in bf16 on a CPU without oneDNN's bf16 kernels); a ValueError too."""


class SlidingWindowError(TargetError, ValueError):
    """Tree decoding would pass a sliding-window layer's window (a ValueError too, as before)."""


class ServerError(HeadwayError):
    """An OpenAI-compatible server refused a request, does not serve the target, or stayed
    unreachable through every retry (:mod:`headway.generation.server_client`)."""
