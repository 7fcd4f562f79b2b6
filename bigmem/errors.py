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


# ``{section.name}``: a lowercase dotted identifier in braces, so a dict repr ({'a': 1}), a path or other
# braces in a message are never read as one.
FIELD_PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*)\}")


def dotted(name: str) -> str:
    """A field as a Python caller names it: unchanged (``train.batch_size``)."""
    return name


def render_fields(template: str, name_of: Callable[[str], str] = dotted) -> str:
    """``template`` with each ``{section.name}`` named by ``name_of`` (dotted names by default).

    Example:
        >>> render_fields("use {train.batch_size} 2")
        'use train.batch_size 2'
    """
    return FIELD_PLACEHOLDER.sub(lambda m: name_of(m.group(1)), template)


class BigmemError(Exception):
    """A failure the user can act on; printed as one line, never with a traceback (unless -v).

    The message is a template: ``{section.name}`` stands for a setting, either a config field
    (``{train.batch_size}``) or the argument of the ``bigmem.api`` function it is given to
    (``{predict.overlap}``). ``str(exc)`` names each by its dotted name; the command line renders
    each as the flag that sets it (``exc.render(bigmem.cli.common.flag_for)``). A message without
    one reads as it was written. To embed another error's message in one's own, embed its
    ``template`` so that its settings are rendered too.

    Example:
        >>> exc = UsageError("Invalid {predict.overlap} 1: expected a fraction in [0, 1).")
        >>> str(exc)
        'Invalid predict.overlap 1: expected a fraction in [0, 1).'
        >>> exc.render(lambda name: "--" + name.split(".")[1])
        'Invalid --overlap 1: expected a fraction in [0, 1).'
    """

    exit_code = EXIT_ERROR
    PLACEHOLDER = FIELD_PLACEHOLDER

    def __init__(self, template: object = "", *args: object):
        self.template = str(template)
        super().__init__(self.render(dotted), *args)

    def field_of(self, placeholder: str) -> str:
        """The dotted field a placeholder's text stands for (the text itself)."""
        return placeholder

    def render(self, name_of: Callable[[str], str]) -> str:
        """The message with every field named by ``name_of(dotted_field)``."""
        return self.PLACEHOLDER.sub(lambda m: name_of(self.field_of(m.group(1))), self.template)


class UsageError(BigmemError):
    """A flag or option with a value bigmem cannot use."""

    exit_code = EXIT_USAGE


class ConfigError(UsageError):
    """A config field with a value bigmem cannot use, named as a field (``data.volume``).

    The message is a template as every ``BigmemError``'s, where ``{field}`` also stands for this
    field: a Python caller reads ``Invalid data.volume 50: ...``; the command line renders it as the
    flag that sets it (``bigmem.cli.common.flag_for``): ``Invalid --volume 50: ...``.
    """

    PLACEHOLDER = re.compile(r"\{(field|[a-z_][a-z0-9_]*\.[a-z_][a-z0-9_]*)\}")

    def __init__(self, field: str, template: str):
        self.field = field
        super().__init__(template)

    def field_of(self, placeholder: str) -> str:
        """``{field}`` is this error's field; any other placeholder names its own."""
        return self.field if placeholder == "field" else placeholder


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
