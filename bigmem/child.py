"""The one protocol between bigmem and the child processes it starts.

Work that must run in a fresh process (a measurement of its peak memory, VmHWM; a training run
of its own) runs in a child: the parent writes the request as a JSON file, starts
``python -m MODULE REQUEST.json``, and reads the result from the child's last line of stdout,
one JSON object; a child that fails is reported with the last line of its stderr. Its users:
``memory/measure.py`` runs the probe (``train/probe.py``: a training run or a whole-volume
prediction), ``compare/run.py`` each run of a comparison (``compare/runner.py``), and the
benchmarks' harness its children; each child's ``main`` is ``serve``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from typing import Any, Callable

from bigmem.errors import BigmemError

PARENT_VARIABLE = "BIGMEM_CHILD_PARENT"  # the pid of the process that started this child (run_child)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def run_child(module: str, request: dict[str, Any], *, what: str, timeout_s: float | None = None,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python -m module REQUEST.json`` and return the JSON object it printed last.

    Args:
        module: the child's module (its ``main`` calls ``serve``).
        request: JSON-serialisable arguments.
        what: what the child does, for the message ("Measuring tiny at 32^3, batch 2").
        timeout_s: kill the child after this many seconds (default None: no limit).
        env: the child's environment (default: this process's).

    Returns:
        The child's result.

    Raises:
        BigmemError: the child exited non-zero (the message ends with its last line of stderr) or
            printed no JSON object last.
        subprocess.TimeoutExpired: the child ran past ``timeout_s``.
    """
    env = {**(os.environ if env is None else env), PARENT_VARIABLE: str(os.getpid())}
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bigmem-child-") as handle:
        json.dump(request, handle)
        handle.flush()
        result = subprocess.run([sys.executable, "-m", module, handle.name], capture_output=True, text=True,
                                timeout=timeout_s, env=env)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BigmemError(f"{what} failed in the child process (exit {result.returncode}): {tail}")
    lines = result.stdout.strip().splitlines()
    try:
        values = json.loads(lines[-1])
    except (IndexError, ValueError):
        values = None
    if not isinstance(values, dict):
        raise BigmemError(f"{what}: the child process printed no result (its last line: "
                          f"{(lines or ['nothing'])[-1][:200]!r}).")
    return values


def serve(handler: Callable[[dict[str, Any]], dict[str, Any]], argv: list[str] | None = None) -> int:
    """A child's ``main``: read the request file named by ``argv[0]``, print ``handler(request)`` as one JSON line.

    A child of ``run_child`` ends with its parent: a measurement whose parent was killed (Ctrl-C'd twice,
    SIGKILL, the kernel's OOM killer) would otherwise go on holding its memory for nothing.
    """
    end_with_parent()
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0]) as handle:
        request = json.load(handle)
    print(json.dumps(handler(request)), flush=True)
    return 0


def end_with_parent(environ=None) -> None:
    """Have the kernel kill this process when the parent ``run_child`` named (``PARENT_VARIABLE``) exits.

    Linux's ``PR_SET_PDEATHSIG``, set by the child itself (a ``preexec_fn`` in a parent running TensorFlow's
    threads could deadlock); a parent that died before it was set is seen as a changed parent id. Elsewhere,
    or outside ``run_child``, nothing is done.
    """
    import ctypes
    import signal

    environ = os.environ if environ is None else environ
    parent = environ.get(PARENT_VARIABLE)
    if not parent or not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):
        os._exit(1)
