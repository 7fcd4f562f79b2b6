"""numa_maps parsing, and NodePeakSampler keeping per-node maxima at a bounded cost."""

from __future__ import annotations

import pytest

import bigmem.numa.observe as observe
from bigmem.memory.procfs import rss_bytes
from bigmem.numa.observe import NodePeakSampler, node_resident_bytes, resident_bytes_by_kind


def test_real_numa_maps_cover_the_resident_set():
    nodes = node_resident_bytes()
    assert 0 in nodes
    assert sum(nodes.values()) > 0.5 * rss_bytes()


def test_fake_numa_maps(tmp_path):
    proc = tmp_path / "123"
    proc.mkdir()
    (proc / "numa_maps").write_text(
        "7f00 interleave:0-1 anon=6 dirty=6 N0=4 N1=2 kernelpagesize_kB=4\n"
        "7f10 bind:1 anon=1 N1=1 kernelpagesize_kB=2048\n"
        "7f20 default file=/lib/x.so\n")
    assert node_resident_bytes(123, proc_root=str(tmp_path)) == {0: 4 * 4096, 1: 2 * 4096 + 2 * 2**20}
    assert node_resident_bytes(456, proc_root=str(tmp_path)) == {}  # no such process: nothing resident
    (proc / "numa_maps").write_text(
        "7f00 interleave:0-1 heap anon=6 dirty=6 N0=4 N1=2 kernelpagesize_kB=4\n"
        "7f20 default file=/lib/x.so anon=1 mapped=3 N0=3 kernelpagesize_kB=4\n")
    assert node_resident_bytes(123, proc_root=str(tmp_path), anonymous=True) == {0: 4 * 4096, 1: 2 * 4096}
    assert resident_bytes_by_kind(123, proc_root=str(tmp_path)) == ({0: 4 * 4096, 1: 2 * 4096}, {0: 3 * 4096})


def test_peaks_per_node_and_wait_scaled_by_the_read_time(monkeypatch):
    readings = iter([({0: 100, 1: 50}, {0: 10}), ({0: 80, 1: 70}, {0: 30, 1: 5})])  # (anonymous, file)
    monkeypatch.setattr(observe, "resident_bytes_by_kind", lambda pid: next(readings))
    monkeypatch.setattr(observe, "_children", lambda pid: [])
    ticks = iter([0.0, 0.001, 10.0, 10.2])  # a 1 ms read, then a 200 ms one
    sampler = NodePeakSampler(interval_s=1.0, clock=lambda: next(ticks))
    sampler.sample()
    assert sampler.peak_bytes == {0: 110, 1: 50}
    assert sampler.wait_s == 1.0  # a cheap read keeps the interval asked for
    sampler.sample()
    assert sampler.peak_bytes == {0: 110, 1: 75}
    assert sampler.anonymous_peak_bytes == {0: 100, 1: 70}
    assert sampler.file_peak_bytes == {0: 30, 1: 5}
    assert sampler.wait_s == pytest.approx(0.2 / NodePeakSampler.MAX_DUTY)  # 40 s: 0.5 % of the time at most


def test_real_process_has_a_resident_node():
    with NodePeakSampler(interval_s=0.01) as sampler:
        pass
    assert sampler.peak_bytes
    assert all(value > 0 for value in sampler.peak_bytes.values())


def test_input_readers_are_summed_apart(monkeypatch):
    """Two readers at the first read, one at the second: each node's peak is of the sums, kept apart."""
    readings = {("self", 1): ({0: 100}, {0: 10}), (11, 1): ({0: 5, 1: 7}, {0: 40}), (12, 1): ({1: 3}, {0: 40}),
                ("self", 2): ({0: 90}, {0: 10}), (11, 2): ({0: 20}, {0: 40})}
    alive = {1: [11, 12], 2: [11]}
    read = {"n": 1}
    monkeypatch.setattr(observe, "_children", lambda pid: alive[read["n"]])
    monkeypatch.setattr(observe, "resident_bytes_by_kind", lambda pid: readings[(pid, read["n"])])
    sampler = NodePeakSampler()
    sampler.sample()
    read["n"] = 2
    sampler.sample()
    assert sampler.anonymous_peak_bytes == {0: 100}
    assert sampler.peak_bytes == {0: 110}  # the readers not in it
    assert sampler.children_anonymous_peak_bytes == {0: 20, 1: 10}
    assert sampler.children_file_peak_bytes == {0: 80}
    assert sampler.children_peak_count == 2
    report = observe.observed({"text": "local"}, sampler)["input_workers"]
    assert report == {"processes": 2, "node_peak_anonymous_bytes": {"0": 20, "1": 10},
                      "node_peak_file_bytes": {"0": 80}}


def test_real_children_are_found():
    import subprocess
    import sys

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert child.pid in observe._children("self")
        assert observe._children(2**22 + 7) == []
    finally:
        child.kill()
        child.wait()


def test_thread_policies_read_the_first_mappings_of_each_thread(tmp_path):
    from bigmem.numa.observe import NUMA_MAPS_PREFIX_BYTES, thread_policies

    line = "7f0000000000 interleave:0-3 anon=1 dirty=1 N0=1 kernelpagesize_kB=4\n"
    long = line * (2 * NUMA_MAPS_PREFIX_BYTES // len(line)) + "7f1000000000 bind:1 anon=1 N1=1\n" * 10**4
    for tid, text in (("100", long), ("101", "55d000000000 default file=/bin/x mapped=1 N0=1\n")):
        (tmp_path / "42" / "task" / tid).mkdir(parents=True)
        (tmp_path / "42" / "task" / tid / "numa_maps").write_text(text)
    # thread 100's file is mostly bind:1 past its first 16 KiB; its policy is what its first mappings say
    assert thread_policies(42, proc_root=str(tmp_path)) == {"interleave:0-3": 1, "default": 1}
