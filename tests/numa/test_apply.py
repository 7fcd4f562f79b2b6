"""The real system calls, on node 0 of this machine, each in a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bigmem.numa.observe import thread_cpus, thread_policies

CHILD = """
import json, sys, threading
from bigmem.numa.apply import place
place(sys.argv[1])
started = threading.Event(); stop = threading.Event()
def worker():
    started.set(); stop.wait()
t = threading.Thread(target=worker); t.start(); started.wait()
from bigmem.numa.observe import thread_policies
print(json.dumps(thread_policies())); stop.set(); t.join()
"""


@pytest.mark.parametrize("policy, observed", [
    ("interleave", "interleave:0"), ("bind:0", "bind:0"), ("preferred:0", "prefer:0"), ("local", "local"),
    ("none", "default"),
])
def test_policies_reach_every_thread(policy, observed):
    result = subprocess.run([sys.executable, "-c", CHILD, policy], capture_output=True, text=True, check=True)
    assert json.loads(result.stdout) == {observed: 2}


THP_CHILD = """
import ctypes, subprocess, sys
from bigmem.numa.apply import place
place(sys.argv[1])
libc = ctypes.CDLL(None)
child = subprocess.run([sys.executable, "-c", "import ctypes; print(ctypes.CDLL(None).prctl(42, 0, 0, 0, 0))"],
                       capture_output=True, text=True, check=True)
print(libc.prctl(42, 0, 0, 0, 0), child.stdout.strip())
"""


@pytest.mark.parametrize("policy, disabled", [("interleave", "1 1"), ("bind:0", "0 0"), ("none", "0 0")])
def test_interleave_turns_huge_pages_off_here_and_in_children(policy, disabled):
    """khugepaged would gather interleaved pages on node 0: PR_GET_THP_DISABLE reads 1 under interleave only."""
    result = subprocess.run([sys.executable, "-c", THP_CHILD, policy], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == disabled


def test_refuses_after_tensorflow_is_imported():
    code = ("import tensorflow\nfrom bigmem.numa.apply import place\ntry:\n    place('bind:0')\nexcept Exception as e:"
            "\n    print(type(e).__name__, e)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert result.stdout.strip() == (
        "BigmemError Cannot apply numa.policy bind:0: TensorFlow is already imported in this process, and its threads "
        "would not inherit the policy. Apply the placement first (the bigmem command does), or start a new process.")


def test_missing_libnuma_is_a_clear_error():
    code = ("import sys\nsys.modules['numa'] = None\nfrom bigmem.cli.main import main\n"
            "sys.exit(main(['train', '--numa', 'interleave', '--model', 'tiny']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("bigmem train: error: NUMA policies need libnuma: cannot load "
                                            "py-libnuma/libnuma.so.1")
    assert "Traceback" not in result.stderr


def test_this_process_observed():
    policies = thread_policies()
    assert sum(policies.values()) >= 1
    assert sum(thread_cpus().values()) == sum(policies.values())


def test_the_command_line_starts_no_thread_pool_before_the_placement():
    """numpy (OpenBLAS starts its threads at import) and TensorFlow load only after --numa is applied."""
    code = "import sys\nimport bigmem.cli.main\nprint(sorted(m for m in ('numpy', 'tensorflow') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.parametrize("policy, expected", [("interleave", "interleave:0"), ("bind:0", "bind:0")])
def test_training_threads_checked_from_outside(tmp_path, tiny_store, policy, expected):
    out = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(tiny_store),
                                "--volume", "32", "--steps", "100000", "--numa", policy, "--num-workers", "1",
                                "--out", str(out)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").stat().st_size == 0:
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "training did not start"
            time.sleep(0.1)
        seen = thread_policies(process.pid)  # read from outside, while TF's pools run
        assert seen == {expected: sum(seen.values())}, seen
        assert sum(seen.values()) > 3, seen
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    assert "Traceback" not in err, err[-2000:]
    report = json.loads((out / "numa.json").read_text())
    assert report["requested"]["policy"] == policy.split(":")[0]
    assert report["observed"] == {expected: sum(report["observed"].values())}
    assert report["cpus_allowed"] == sorted(os.sched_getaffinity(0))
    assert int(report["node_peak_bytes"]["0"]) > 100 * 2**20
    # apart: the anonymous pages (what the policy placed: TF's heap, the tensors) and the file pages
    anonymous, files = report["node_peak_anonymous_bytes"]["0"], report["node_peak_file_bytes"]["0"]
    assert 50 * 2**20 < anonymous < report["node_peak_bytes"]["0"]
    assert 0 < files < report["node_peak_bytes"]["0"]
    # the input reader (with multiprocessing's resource tracker), its own pages and the shared slots it fills
    readers = report["input_workers"]
    assert readers["processes"] >= 2
    assert readers["node_peak_anonymous_bytes"]["0"] > 10 * 2**20
    assert readers["node_peak_file_bytes"]["0"] > 32**3 * 4


def test_bind_to_a_missing_node_names_the_nodes(tmp_path, capsys):
    from helpers import run_cli

    code, _, err = run_cli(["train", "--numa", "bind:1", "--out", tmp_path / "run"], capsys)
    assert code == 2
    assert err.strip() == ("bigmem train: error: Invalid --numa 'bind:1': node 1 does not exist; this machine has "
                           "node 0.")


@pytest.mark.parametrize("policy, message", [
    ("bind:1", "node 1 is outside the memory this process may use, node(s) 0 "),
    ("preferred:1", "node 1 is outside the memory this process may use, node(s) 0 "),
])
def test_nodes_outside_the_cpuset_are_refused_in_one_line(tmp_path, policy, message):
    from bigmem.numa import apply
    from bigmem.numa.policy import Placement, PolicyKind

    (tmp_path / "self").mkdir()
    (tmp_path / "self/status").write_text("Name:\tpython\nMems_allowed_list:\t0\n")
    kind = PolicyKind(policy.split(":")[0])
    with pytest.raises(apply.BigmemError) as info:
        apply._check_mems_allowed(Placement(kind, (1,), (0,), 1, 2, text=policy), proc_root=str(tmp_path))
    assert str(info.value) == (f"Cannot apply numa.policy {policy}: {message}(Mems_allowed_list in /proc/self/status, "
                               f"set by a cpuset cgroup, Slurm or numactl). Name only those nodes, e.g. numa.policy "
                               f"{kind.value}:0.")
    apply._check_mems_allowed(Placement(kind, (0,), (0,), 1, 2, text="bind:0"), proc_root=str(tmp_path))


class _FakeLibnuma:
    """libnuma's nodestring parser and migrate_pages, recording what they were given."""

    def __init__(self, left: int = 0):
        self.masks, self.calls, self.freed, self.left = {}, [], [], left
        # plain functions, which take the restype and argtypes ctypes functions are given
        self.numa_parse_nodestring = lambda text: self._parse(text)
        self.numa_migrate_pages = lambda pid, source, target: self._migrate(pid, source, target)
        self.numa_bitmask_free = lambda mask: self.freed.append(mask)

    def _parse(self, text: bytes) -> int:
        self.masks[len(self.masks) + 1] = text.decode()
        return len(self.masks)

    def _migrate(self, pid: int, source: int, target: int) -> int:
        self.calls.append((pid, self.masks[source], self.masks[target]))
        return self.left


@pytest.mark.parametrize("nodes, online, moved", [
    ((1,), "0-3", [(0, "0,2-3", "1")]),
    ((0, 1), "0-3", [(0, "2-3", "0-1")]),
    ((0,), "0", []),  # one node: nothing to move from, libnuma not called
])
def test_bind_moves_what_was_touched_before_it_onto_the_bound_nodes(nodes, online, moved):
    from types import SimpleNamespace

    from bigmem.numa.apply import migrate_to

    lib = _FakeLibnuma()
    left = migrate_to(nodes, SimpleNamespace(LIBNUMA=lib), online=online)
    assert lib.calls == moved
    assert left == 0 if moved else left is None
    assert sorted(lib.freed) == sorted(lib.masks)  # every mask given back
    assert migrate_to((1,), SimpleNamespace(LIBNUMA=_FakeLibnuma(left=-1)), online="0-1") is None  # refused
