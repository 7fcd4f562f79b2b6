"""benchmarks/harness.py: the flags, timing and child processes every benchmark shares."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from bigmem.errors import BigmemError

import harness

CHILD = """
import os
import signal


def allocate(request):
    block = bytearray(request["mib"] * 2**20)  # zero-filled: every page touched
    return {"bytes": len(block), "twice": 2 * request["x"]}


def crash(request):
    os.kill(os.getpid(), signal.SIGSEGV)


def not_a_dict(request):
    return [1, 2]
"""


@pytest.fixture
def child(tmp_path):
    path = tmp_path / "tiny_child.py"
    path.write_text(CHILD)
    spec = importlib.util.spec_from_file_location("tiny_child", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_spread_is_the_median_and_range():
    even = harness.spread([3.0, 1.0, 2.0, 10.0])
    assert (even.median, even.min, even.max, even.n) == (2.5, 1.0, 10.0, 4)
    assert even.spread_pct == pytest.approx(360.0)
    assert harness.spread([5.0, 1.0, 3.0]).median == 3.0
    assert harness.spread([2.0]).spread_pct == 0.0
    assert even.as_dict() == {"median_s": 2.5, "min_s": 1.0, "max_s": 10.0}
    assert harness.spread([4.0, 2.0]).as_dict("") == {"median": 3.0, "min": 2.0, "max": 4.0}
    with pytest.raises(ValueError, match="^No figures to summarise: expected at least one repeat.$"):
        harness.spread([])


def test_time_calls_warms_up_untimed_then_times_each_repeat():
    calls, befores = [], []
    timed = harness.time_calls(lambda: calls.append(len(calls)) or len(calls), repeats=3, warmup=2,
                               before=lambda: befores.append(len(calls)))
    assert len(calls) == 5
    assert len(timed.times_s) == 3
    assert timed.value == 5
    assert befores == [2, 3, 4]  # before each timed call only
    assert all(t >= 0 for t in timed.times_s)
    assert timed.spread.n == 3
    with pytest.raises(ValueError, match=r"^Invalid repeats 0 / warmup 0: expected repeats >= 1"):
        harness.time_calls(lambda: None, repeats=0)


def test_quick_swaps_in_the_smallest_settings_but_a_given_flag_wins():
    parser = harness.bench_parser("doc", repeats=5, warmup=1, quick={"repeats": 1, "cases": 2},
                                  quick_aliases=("--small",))
    parser.add_argument("--cases", type=int, default=8)
    args = parser.parse_args([])
    assert (args.repeats, args.warmup, args.cases, args.quick) == (5, 1, 8, False)
    assert args.out == str(harness.RESULTS)
    assert (parser.parse_args(["--quick"]).repeats, parser.parse_args(["--quick"]).cases) == (1, 2)
    assert parser.parse_args(["--small", "--cases", "3"]).cases == 3
    assert parser.parse_args(["--repeat", "7"]).repeats == 7  # the older spelling
    bare = harness.bench_parser("doc").parse_args(["--out", "/tmp/x"])
    assert vars(bare) == {"out": "/tmp/x"}


def test_command_line_names_the_script_below_benchmarks_and_its_flags():
    assert harness.command_line("/x/benchmarks/proofs/bench_hd95.py", ["--repeats", "3"]) == \
        "python benchmarks/proofs/bench_hd95.py --repeats 3"
    assert harness.command_line(harness.BENCHMARKS / "tables" / "bench_train.py", ["--scaling", ""]) == \
        "python benchmarks/tables/bench_train.py --scaling ''"  # quoted as a shell needs it
    assert harness.command_line("/elsewhere/bench_copy.py", []) == "python benchmarks/bench_copy.py"


def test_run_function_returns_the_result_and_the_childs_own_peak(child):
    small = harness.run_function(child.allocate, {"mib": 1, "x": 21}, what="Allocating 1 MiB")
    assert small.ok
    assert small.result == {"bytes": 2**20, "twice": 42}
    assert small.function == "allocate"
    assert small.peak_rss_bytes > 0
    assert small.wall_s > 0
    big = harness.run_function(child.allocate, {"mib": 96, "x": 1}, what="Allocating 96 MiB")
    assert big.check("Allocating").result["bytes"] == 96 * 2**20
    assert big.peak_rss_bytes > small.peak_rss_bytes + 80 * 2**20
    again = harness.run_function(child.allocate, {"mib": 1, "x": 1}, what="Allocating 1 MiB")
    assert again.peak_rss_bytes < big.peak_rss_bytes - 80 * 2**20  # each child's own, not the largest so far


def test_a_crashed_child_still_reports_its_exit_signal_and_peak(child):
    run = harness.run_function(child.crash, {}, what="Crashing")
    assert (run.returncode, run.ok, run.result, run.failure()) == (-11, False, None, "segfault (-11)")
    assert run.peak_rss_bytes > 0
    with pytest.raises(BigmemError, match=r"^Crashing failed in the child process \(exit -11\): segfault \(-11\)$"):
        run.check("Crashing")
    wrong = harness.run_function(child.not_a_dict, {}, what="Listing")
    assert not wrong.ok
    assert wrong.failure() == "TypeError: tiny_child.py: not_a_dict returned list, not a dict."


def test_run_command_reports_exit_codes_and_timeouts():
    done = harness.run_command([sys.executable, "-c", "print('hi')"], what="Greeting")
    assert done.check("Greeting") is done
    assert done.stdout == "hi\n"
    assert done.peak_rss_bytes > 0
    failed = harness.run_command([sys.executable, "-c", "print('out'); raise SystemExit('the last word')"],
                                 what="Failing")
    assert (failed.returncode, failed.stdout, failed.failure()) == (1, "out\n", "the last word")
    with pytest.raises(BigmemError, match=r"^Failing failed in the child process \(exit 1\): the last word$"):
        failed.check("Failing")
    slow = harness.run_command([sys.executable, "-c", "import time; time.sleep(30)"], what="Sleeping", timeout_s=0.5)
    assert slow.timed_out
    assert slow.returncode == -9
    assert slow.failure() == "timeout (-9)"
    assert slow.wall_s < 20


def test_run_function_needs_a_top_level_function():
    with pytest.raises(ValueError, match=r"^run_function needs a function defined at the top level of a file; got "
                                         r"'test_run_function_needs_a_top_level_function\.<locals>\.<lambda>'\.$"):
        harness.run_function(lambda request: {}, {}, what="Nothing")
