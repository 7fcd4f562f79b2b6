"""What every benchmark shares: its flags, its timing, its child processes and its results file.

- ``bench_parser``: ``--out`` always; ``--repeats``, ``--warmup`` and ``--quick`` where the script
  has them, so every script spells them the same.
- ``time_calls`` and ``spread``: untimed warm-up calls, then ``repeats`` timed ones; the median and
  the range (min and max: with the 3-7 repeats these scripts afford, quartiles would be
  interpolations between two of the few points, and the range is what every table prints).
- ``run_command`` and ``run_function``: a command, or a module-level function of a benchmark script,
  in a fresh process, with its exit status, output, wall seconds and peak resident set.
- ``heavy_turn``: the lock multi-GB measurements on one machine take turns on.
- ``write_results`` and ``machine_slug`` (``_results.py``): the JSON, keyed by machine.

The child's peak is the kernel's: ``resource.getrusage(RUSAGE_CHILDREN).ru_maxrss``, read in a
supervisor process (``python -m harness``, started through ``bigmem.child.run_child``) that has
exactly one child, the measured one. The alternatives are worse: VmHWM in /proc/<pid>/status can
only be read while the process lives (a child that crashes or is killed never reports it, and
after its exit the parent finds no VmHWM left), and RUSAGE_CHILDREN in the benchmark itself is the
largest of *all* the children it has waited for, so every child after a big one would read big.
ru_maxrss is the same high-water mark as VmHWM (Linux keeps it in KiB), taken when the child is
reaped, however it ended (for a child that starts processes of its own: the largest of them and
it, not their sum). The kernel keeps one mark: a child that resets its VmHWM
(``procfs.reset_peak_rss``) lowers this one too, and reports the peak it wants in its result.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib.util
import inspect
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from _results import machine_slug, write_results

from bigmem.child import run_child, serve
from bigmem.errors import BigmemError

__all__ = ["ChildRun", "Spread", "Timed", "bench_parser", "command_line", "heavy_turn", "machine_slug",
           "run_command", "run_function", "spread", "time_calls", "write_results"]

BENCHMARKS = Path(__file__).resolve().parent
RESULTS = BENCHMARKS / "results"
# Measurements of several GB take turns on this lock so that two never share the machine's memory.
HEAVY_LOCK_PATH = "/tmp/bigmem-heavy.lock"
SIGNAL_NAMES = {"SIGSEGV": "segfault", "SIGABRT": "abort", "SIGBUS": "bus error"}


# ---- flags ---------------------------------------------------------------------------------------


class BenchParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose ``--quick`` swaps in the smallest settings; flags given still win."""

    quick_defaults: dict[str, Any] = {}

    def parse_args(self, args=None, namespace=None):
        parsed = super().parse_args(args, namespace)
        if getattr(parsed, "quick", False) and self.quick_defaults:
            self.set_defaults(**self.quick_defaults)
            parsed = super().parse_args(args, namespace)
        return parsed


def bench_parser(description: str | None, *, repeats: int | None = None, warmup: int | None = None,
                 quick: dict[str, Any] | None = None, repeats_help: str = "timed repeats",
                 warmup_help: str = "untimed warm-up calls before the timed ones", quick_help: str | None = None,
                 quick_aliases: Sequence[str] = ()) -> BenchParser:
    """The flags every benchmark shares; the script adds its own.

    Args:
        description: the script's docstring (printed as written by ``--help``).
        repeats: ``--repeats N`` (also spelt ``--repeat``) with this default; None: no such flag.
        warmup: ``--warmup N`` with this default; None: no such flag.
        quick: ``--quick`` sets these defaults (keys are ``dest`` names); None: no such flag.
        repeats_help, warmup_help, quick_help: what the flags mean in this script.
        quick_aliases: other spellings of ``--quick`` the script had (``--small``).

    Returns:
        A parser with ``--out`` (default ``benchmarks/results``) and the flags asked for.

    Example:
        >>> parser = bench_parser(__doc__, repeats=3, quick={"repeats": 1, "cases": 1})
        >>> parser.add_argument("--cases", type=int, default=2)
    """
    parser = BenchParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS), help="folder for the JSON (default benchmarks/results)")
    if repeats is not None:
        parser.add_argument("--repeats", "--repeat", dest="repeats", type=int, default=repeats,
                            help=f"{repeats_help} (default {repeats})")
    if warmup is not None:
        parser.add_argument("--warmup", type=int, default=warmup, help=f"{warmup_help} (default {warmup})")
    if quick is not None:
        settings = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in quick.items())
        parser.add_argument("--quick", *quick_aliases, dest="quick", action="store_true",
                            help=quick_help or f"the smallest settings, to check that the script runs ({settings})")
        parser.quick_defaults = dict(quick)
    return parser


def command_line(script: str | Path, argv: Sequence[str] | None = None) -> str:
    """``python benchmarks/KIND/SCRIPT ARGS``: how a results file says what made it, runnable from the repository root.

    Args:
        script: the script's path (``__file__``, ``sys.argv[0]``), from any folder; its path below the last
            ``benchmarks`` folder it is in is kept (the script's name alone if it is in none).
        argv: its arguments (default ``sys.argv[1:]``), quoted where a shell needs it (``--sizes ''``).
    """
    parts = Path(script).resolve().parts
    below = parts[len(parts) - parts[::-1].index("benchmarks"):] if "benchmarks" in parts[:-1] else parts[-1:]
    return shlex.join(["python", "/".join(("benchmarks", *below)), *(sys.argv[1:] if argv is None else argv)])


# ---- timing --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Spread:
    """Median and range of some repeated figures (seconds, rates)."""

    median: float
    min: float
    max: float
    n: int

    @property
    def spread_pct(self) -> float:
        """(max - min) / median, in percent."""
        return 100.0 * (self.max - self.min) / self.median

    def as_dict(self, suffix: str = "_s") -> dict[str, float]:
        """``{"median_s": ..., "min_s": ..., "max_s": ...}`` (each key ends in ``suffix``)."""
        return {f"median{suffix}": self.median, f"min{suffix}": self.min, f"max{suffix}": self.max}


def spread(values: Iterable[float]) -> Spread:
    """The median, min and max of ``values``.

    Raises:
        ValueError: ``values`` is empty.

    Example:
        >>> spread([3.0, 1.0, 2.0, 10.0])
        Spread(median=2.5, min=1.0, max=10.0, n=4)
    """
    values = list(values)
    if not values:
        raise ValueError("No figures to summarise: expected at least one repeat.")
    return Spread(statistics.median(values), min(values), max(values), len(values))


@dataclass
class Timed:
    """The timed calls of one function: the last call's value and each call's seconds."""

    value: Any
    times_s: list[float]

    @property
    def spread(self) -> Spread:
        return spread(self.times_s)


def time_calls(fn: Callable[[], Any], *, repeats: int, warmup: int = 0,
               before: Callable[[], Any] | None = None) -> Timed:
    """Call ``fn`` ``warmup`` times untimed, then ``repeats`` times timed (``time.perf_counter``).

    Args:
        fn: the work; it must block until its result exists (call ``.numpy()`` on a tensor).
        repeats: timed calls (at least 1).
        warmup: untimed calls first (default 0).
        before: called, untimed, before each timed call (dropping the page cache for a cold read).

    Returns:
        ``Timed(value, times_s)``: ``times_s`` has ``repeats`` entries.

    Raises:
        ValueError: ``repeats`` < 1 or ``warmup`` < 0.

    Example:
        >>> timed = time_calls(lambda: sum(range(10**6)), repeats=5, warmup=1)
        >>> timed.spread.median
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"Invalid repeats {repeats} / warmup {warmup}: expected repeats >= 1 and warmup >= 0.")
    for _ in range(warmup):
        fn()
    value, times = None, []
    for _ in range(repeats):
        if before is not None:
            before()
        started = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - started)
    return Timed(value, times)


# ---- child processes -----------------------------------------------------------------------------


@dataclass
class ChildRun:
    """What one child process did (``run_command``, ``run_function``)."""

    returncode: int  # negative: killed by that signal
    stdout: str
    stderr: str
    wall_s: float
    peak_rss_bytes: int  # the child's peak resident set (ru_maxrss), however it ended
    timed_out: bool
    function: str | None = None  # run_function: the function called
    result: dict | None = None  # run_function: what it returned (None if it did not)

    @property
    def ok(self) -> bool:
        """Exit 0 within the time limit (and, for a function, a result)."""
        return self.returncode == 0 and not self.timed_out and (self.function is None or self.result is not None)

    def stderr_tail(self, lines: int = 1) -> list[str]:
        """The last ``lines`` lines of stderr (blank ends stripped)."""
        return self.stderr.strip().splitlines()[-lines:]

    def failure(self) -> str:
        """Why the child failed, in a few words: 'timeout (-9)', 'segfault (-11)', or its last line of stderr."""
        code = self.returncode
        if code < 0:
            try:
                name = signal.Signals(-code).name
            except ValueError:  # a real-time signal has no name
                name = f"signal {-code}"
            if name == "SIGKILL":
                return f"{'timeout' if self.timed_out else 'killed (out of memory?)'} ({code})"
            return f"{SIGNAL_NAMES.get(name, name)} ({code})"
        if code == 0 and self.function is not None and self.result is None:
            last = (self.stdout.strip().splitlines() or ["nothing"])[-1]
            return f"printed no result (its last line: {last[:200]!r})"
        return (self.stderr_tail() or ["no output"])[0][:300]

    def check(self, what: str) -> ChildRun:
        """This run, if the child succeeded.

        Raises:
            BigmemError: ``"{what} failed in the child process (exit N): <failure()>"``.
        """
        if not self.ok:
            raise BigmemError(f"{what} failed in the child process (exit {self.returncode}): {self.failure()}")
        return self


def _with_benchmarks_on_path(env: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(BENCHMARKS), env.get("PYTHONPATH")) if p)
    return env


def run_command(argv: Sequence[str], *, what: str, env: dict[str, str] | None = None,
                timeout_s: float | None = None, cwd: str | Path | None = None) -> ChildRun:
    """Run ``argv`` in a fresh process and report how it ended; a failing command is not an error here.

    Args:
        argv: the command (``[sys.executable, "-m", "bigmem", "train", ...]``).
        what: what the command does, for the message if the supervisor itself fails.
        env: the command's environment (default: this process's).
        timeout_s: SIGKILL the command after this many seconds (default None: no limit).
        cwd: the command's working folder (default: this one).

    Returns:
        A ``ChildRun``: exit status, stdout and stderr, wall seconds, peak resident bytes, whether
        it timed out. ``.check(what)`` raises if the command failed.

    Raises:
        BigmemError: the supervisor could not run (the command's own failure is in the ``ChildRun``).

    Example:
        >>> run = run_command([sys.executable, "-c", "print(1)"], what="Printing")
        >>> run.check("Printing").stdout, run.peak_rss_bytes
    """
    request = {"argv": [str(a) for a in argv], "env": dict(os.environ if env is None else env),
               "timeout_s": timeout_s, "cwd": None if cwd is None else str(cwd)}
    return ChildRun(**run_child("harness", request, what=what, env=_with_benchmarks_on_path(None)))


def run_function(function: Callable[[dict], dict], request: dict, *, what: str, env: dict[str, str] | None = None,
                 timeout_s: float | None = None) -> ChildRun:
    """Call ``function(request)`` in a fresh process: a function at the top level of a benchmark script.

    The child (``python -m harness``) imports the function's file by path, with benchmarks/ on
    its path so the script's own imports work, and prints the result as ``bigmem.child.serve``
    does; nothing else of the script runs.

    Args:
        function: takes the request, returns a JSON-serialisable dict.
        request: JSON-serialisable arguments.
        what: what the call does, for the message if the supervisor itself fails.
        env: the child's environment (default: this process's); benchmarks/ goes first on its PYTHONPATH.
        timeout_s: SIGKILL the child after this many seconds (default None: no limit).

    Returns:
        A ``ChildRun`` whose ``result`` is the function's dict (None if the child failed).

    Raises:
        ValueError: ``function`` is not at the top level of a file (a lambda, a nested function).

    Example:
        >>> run = run_function(child, {"depth": 128}, what="Depth 128")
        >>> run.check("Depth 128").result, run.peak_rss_bytes
    """
    if function.__qualname__ != function.__name__ or function.__name__ == "<lambda>":
        raise ValueError(f"run_function needs a function defined at the top level of a file; got "
                         f"{function.__qualname__!r}.")
    with tempfile.NamedTemporaryFile("w", suffix=".json", prefix="bigmem-bench-call-") as handle:
        json.dump({"call": {"path": os.path.abspath(inspect.getfile(function)), "function": function.__name__},
                   "request": request}, handle)
        handle.flush()
        run = run_command([sys.executable, "-m", "harness", handle.name], what=what, timeout_s=timeout_s,
                          env=_with_benchmarks_on_path(env))
    run.function = function.__name__
    if run.returncode == 0 and not run.timed_out:
        try:
            result = json.loads(run.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            result = None
        run.result = result if isinstance(result, dict) else None
    return run


@contextlib.contextmanager
def heavy_turn(needed: bool = True, say: Callable[[str], Any] = print, lock_path: str = HEAVY_LOCK_PATH):
    """Hold the exclusive lock (``flock``) that multi-GB measurements on this machine take turns on.

    Args:
        needed: False: take no turn (tiny tensors need none), yield at once.
        say: told once when the lock is busy and the turn must wait (default print).
        lock_path: the lock file (default /tmp/bigmem-heavy.lock, the one every such script uses).

    Example:
        >>> with heavy_turn(not args.quick, console.print):
        ...     run = run_function(child, request, what="conv3d above 2^31")
    """
    if not needed:
        yield
        return
    with open(lock_path, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            say(f"waiting for {lock_path} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


# ---- the child side: python -m harness REQUEST.json ----------------------------------------------


def _supervise(request: dict) -> dict:
    """Run ``request["argv"]`` as this process's only child; its exit status, output, seconds and peak."""
    started = time.perf_counter()
    with subprocess.Popen(request["argv"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          errors="replace", env=request["env"], cwd=request["cwd"]) as process:
        try:
            stdout, stderr = process.communicate(timeout=request["timeout_s"])
            timed_out = False
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
            timed_out = True
    wall_s = time.perf_counter() - started
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux; the one child's
    return {"returncode": process.returncode, "stdout": stdout, "stderr": stderr, "wall_s": wall_s,
            "peak_rss_bytes": peak_kib * 1024, "timed_out": timed_out}


def _call(request: dict) -> dict:
    """Import the file named in ``request["call"]`` by path and return its function's result."""
    path = Path(request["call"]["path"])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look their module up
    spec.loader.exec_module(module)
    result = getattr(module, request["call"]["function"])(request["request"])
    if not isinstance(result, dict):
        raise TypeError(f"{path.name}: {request['call']['function']} returned {type(result).__name__}, not a dict.")
    return result


def _handle(request: dict) -> dict:
    return _call(request) if "call" in request else _supervise(request)


def main(argv: list[str] | None = None) -> int:
    """The child side of ``run_command`` (a supervisor) and ``run_function`` (the call)."""
    return serve(_handle, argv)


if __name__ == "__main__":
    sys.exit(main())
