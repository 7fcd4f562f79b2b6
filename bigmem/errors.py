"""The exceptions bigmem raises, and the exit code each maps to (README.md, "Exit codes").

0 ok · 1 a bigmem error (bad input, corrupt file, ...) · 2 usage error · 3 does not fit in memory.
"""

from __future__ import annotations

import re
from typing import Callable

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


class ConfigError(UsageError):
    """A config field with a value bigmem cannot use, named as a field (``data.volume``).

    The message is a template: ``{field}`` stands for this field and ``{section.name}`` for
    another one. A Python caller reads the dotted names; the command line renders each as the
    flag that sets it (``bigmem.cli.common.flag_for``): ``Invalid --volume 50: ...``.
    """

    PLACEHOLDER = re.compile(r"\{(field|[a-z_]+\.[a-z_]+)\}")

    def __init__(self, field: str, template: str):
        self.field = field
        self.template = template
        super().__init__(self.render(lambda name: name))

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with every field named by ``name_of(dotted_field)``."""
        return self.PLACEHOLDER.sub(lambda m: name_of(self.field if m.group(1) == "field" else m.group(1)),
                                    self.template)


class DataError(BigmemError):
    """A store, case or file that is missing, unreadable or inconsistent."""


class TrainingError(BigmemError):
    """Training cannot go on (non-finite loss, a run directory in the way, ...)."""


class PeerLost(TrainingError):
    """Another worker of a multi-worker run stopped, so this one's collective was aborted."""

    MESSAGE = "another worker of this run stopped, which aborted this worker's collective"

    def __init__(self) -> None:
        super().__init__(self.MESSAGE)


class DiskFullError(BigmemError):
    """A write failed for lack of space (ENOSPC/EDQUOT) or the device failed (EIO): exit 1.

    Carries the path written, the bytes the write needed (an estimate where the writer knows
    one, else 0) and the bytes free on that filesystem when it failed.
    """

    def __init__(self, message: str, path: str, needed_bytes: int, free_bytes: int):
        super().__init__(message)
        self.path = str(path)
        self.needed_bytes = int(needed_bytes)
        self.free_bytes = int(free_bytes)


class InsufficientMemoryError(BigmemError):
    """The job's predicted footprint does not fit the memory available to it."""

    exit_code = EXIT_NO_FIT

    def __init__(self, message: str, required_bytes: int, available_bytes: int):
        super().__init__(message)
        self.required_bytes = int(required_bytes)
        self.available_bytes = int(available_bytes)
