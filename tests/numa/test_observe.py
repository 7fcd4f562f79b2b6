"""NodePeakSampler keeps per-node maxima and keeps its own cost bounded."""

from __future__ import annotations

import pytest

import bigmem.numa.observe as observe
from bigmem.numa.observe import NodePeakSampler


def test_peaks_per_node_and_wait_scaled_by_the_read_time(monkeypatch):
    readings = iter([{0: 100, 1: 50}, {0: 80, 1: 70}])
    monkeypatch.setattr(observe, "node_resident_bytes", lambda pid: next(readings))
    ticks = iter([0.0, 0.001, 10.0, 10.2])  # a 1 ms read, then a 200 ms one
    sampler = NodePeakSampler(interval_s=1.0, clock=lambda: next(ticks))
    sampler.sample()
    assert sampler.peak_bytes == {0: 100, 1: 50}
    assert sampler.wait_s == 1.0  # a cheap read keeps the interval asked for
    sampler.sample()
    assert sampler.peak_bytes == {0: 100, 1: 70}
    assert sampler.wait_s == pytest.approx(0.2 / NodePeakSampler.MAX_DUTY)  # 40 s: 0.5 % of the time at most


def test_real_process_has_a_resident_node():
    with NodePeakSampler(interval_s=0.01) as sampler:
        pass
    assert sampler.peak_bytes and all(value > 0 for value in sampler.peak_bytes.values())
