"""/proc readers: peak RSS and its reset on the real process; numa_maps parsing on a fake /proc."""

from __future__ import annotations

import numpy as np

from bigmem.memory.procfs import node_resident_bytes, peak_rss_bytes, reset_peak_rss, rss_bytes, status_bytes


def test_peak_follows_an_allocation_and_resets():
    assert reset_peak_rss()
    before = peak_rss_bytes()
    block = np.ones(64 * 2**20, np.uint8)  # 64 MiB, touched
    peak = peak_rss_bytes()
    assert peak - before > 60 * 2**20
    del block
    assert reset_peak_rss()
    assert peak_rss_bytes() < peak - 30 * 2**20
    assert rss_bytes() <= peak_rss_bytes()


def test_real_numa_maps_cover_the_resident_set():
    nodes = node_resident_bytes()
    assert 0 in nodes
    assert sum(nodes.values()) > 0.5 * rss_bytes()


def test_fake_proc(tmp_path):
    proc = tmp_path / "123"
    proc.mkdir()
    (proc / "status").write_text("Name:\tx\nVmPeak:\t  100 kB\nVmHWM:\t   40 kB\nVmRSS:\t   30 kB\n")
    (proc / "numa_maps").write_text(
        "7f00 interleave:0-1 anon=6 dirty=6 N0=4 N1=2 kernelpagesize_kB=4\n"
        "7f10 bind:1 anon=1 N1=1 kernelpagesize_kB=2048\n"
        "7f20 default file=/lib/x.so\n")
    assert status_bytes(123, proc_root=str(tmp_path)) == {"VmPeak": 102400, "VmHWM": 40960, "VmRSS": 30720}
    assert node_resident_bytes(123, proc_root=str(tmp_path)) == {0: 4 * 4096, 1: 2 * 4096 + 2 * 2**20}
