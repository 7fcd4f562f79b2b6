"""/proc readers: peak RSS and its reset on the real process; status parsing on a fake /proc."""

from __future__ import annotations

import numpy as np

from bigmem.memory.procfs import peak_rss_bytes, reset_peak_rss, rss_bytes, status_bytes


def test_peak_follows_an_allocation_and_resets():
    import mmap

    assert reset_peak_rss()
    before = peak_rss_bytes()
    # 64 MiB mapped and touched directly: freeing it unmaps it, whatever allocator the process has loaded
    # (a numpy array's memory can stay with its allocator after del, and then nothing lowers the RSS)
    block = mmap.mmap(-1, 64 * 2**20)
    np.frombuffer(block, np.uint8)[:] = 1
    peak = peak_rss_bytes()
    assert peak - before > 60 * 2**20
    block.close()
    assert reset_peak_rss()
    assert peak_rss_bytes() < peak - 30 * 2**20
    assert rss_bytes() <= peak_rss_bytes()


def test_fake_proc(tmp_path):
    proc = tmp_path / "123"
    proc.mkdir()
    (proc / "status").write_text("Name:\tx\nVmPeak:\t  100 kB\nVmHWM:\t   40 kB\nVmRSS:\t   30 kB\n")
    assert status_bytes(123, proc_root=str(tmp_path)) == {"VmPeak": 102400, "VmHWM": 40960, "VmRSS": 30720}
