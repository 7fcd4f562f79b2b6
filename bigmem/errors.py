"""The exceptions bigmem raises, and the exit code each maps to (DESIGN.md).

0 ok · 1 a bigmem error (bad input, corrupt file, ...) · 2 usage error · 3 does not fit in memory.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_ERROR = 1
EXIT_USAGE = 2
EXIT_NO_FIT = 3


class BigmemError(Exception):
    """A failure the user can act on; printed as one line, never with a traceback (unless -v)."""

    exit_code = EXIT_ERROR


class UsageError(BigmemError):
    """A flag or option with a value bigmem cannot use."""

    exit_code = EXIT_USAGE


class DataError(BigmemError):
    """A store, case or file that is missing, unreadable or inconsistent."""


class TrainingError(BigmemError):
    """Training cannot go on (non-finite loss, a run directory in the way, ...)."""


class InsufficientMemoryError(BigmemError):
    """The job's predicted footprint does not fit the memory available to it."""

    exit_code = EXIT_NO_FIT

    def __init__(self, message: str, required_bytes: int, available_bytes: int):
        super().__init__(message)
        self.required_bytes = int(required_bytes)
        self.available_bytes = int(available_bytes)
