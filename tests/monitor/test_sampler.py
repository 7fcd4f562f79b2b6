"""ResourceMonitor: monitor.csv's columns and values, resume, GPUs through nvidia-smi, fake NUMA nodes."""

from __future__ import annotations

import csv
import json
import os
import time

import psutil
import pytest

from bigmem.monitor.sampler import BASE_COLUMNS, ResourceMonitor, block_device_of, query_gpus
from helpers import GIB_KB, make_sysfs


def _rows(path):
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture
def two_nodes(tmp_path):
    """A fake 2-socket sysfs: node 0 has 68 GiB used (768 - 700), node 1 384 GiB (768 - 384)."""
    return str(make_sysfs(tmp_path / "sysroot", [("0-1", 768, 700), ("2-3", 768, 384)], [[10, 21], [21, 10]]))


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(i * i for i in range(1000))


def test_writes_the_columns_with_sane_values(tmp_path, two_nodes):
    csv_path = tmp_path / "run" / "monitor.csv"
    with ResourceMonitor(csv_path, interval_s=0.05, store_path=tmp_path, sys_root=two_nodes,
                         gpu_command=("no-such-nvidia-smi",)) as monitor:
        # Busy for at least 0.4 s and until the thread has written 3 rows: on a loaded CI runner the busy
        # loop can hold the GIL long enough that a fixed 0.4 s gives the thread only one or two turns.
        deadline = time.perf_counter() + 30.0
        _busy(0.4)
        while monitor.samples < 4 and time.perf_counter() < deadline:
            _busy(0.05)
    rows = _rows(csv_path)
    assert monitor.samples == len(rows) >= 5
    info = json.loads((tmp_path / "run" / "monitor.json").read_text())
    assert info["numa_nodes"] == [0, 1]
    assert info["num_gpus"] == 0
    assert info["columns"] == list(rows[0])
    # The fake sysfs root has no /sys/dev/block: the monitor falls back to all disks and says so.
    assert info["disk_device"] == "all disks (the store has no block device of its own)"
    assert list(rows[0]) == [*BASE_COLUMNS, "node0_used_bytes", "node1_used_bytes"]  # no GPU columns
    times = [float(r["time_s"]) for r in rows]
    assert times == sorted(times)
    assert times[0] == 0.0
    for row in rows:
        assert 0 < int(row["rss_bytes"]) <= int(row["peak_rss_bytes"])
        assert 0.0 <= float(row["cpu_percent"]) <= 100.0 * psutil.cpu_count()
        assert int(row["num_threads"]) >= 2  # this thread and the monitor's
        assert int(row["page_cache_bytes"]) >= 0
        assert int(row["disk_read_bytes_per_s"]) >= 0
        assert int(row["disk_write_bytes_per_s"]) >= 0
        assert int(row["node0_used_bytes"]) == 68 * GIB_KB * 1024
        assert int(row["node1_used_bytes"]) == 384 * GIB_KB * 1024
    # A busy loop on one thread shows as CPU time (not normalised by the number of cores).
    assert max(float(r["cpu_percent"]) for r in rows[1:]) > 30.0


def test_resume_appends_and_continues_time(tmp_path, two_nodes):
    csv_path = tmp_path / "monitor.csv"
    with ResourceMonitor(csv_path, interval_s=0.05, sys_root=two_nodes, gpu_command=("none",)):
        time.sleep(0.12)
    first = _rows(csv_path)
    with open(csv_path, "a") as handle:  # a row torn by a kill
        handle.write("12.5,3")
    with ResourceMonitor(csv_path, interval_s=0.05, sys_root=two_nodes, gpu_command=("none",)):
        time.sleep(0.12)
    rows = _rows(csv_path)
    assert csv_path.read_text().count("time_s") == 1  # one header
    assert rows[:len(first)] == first
    later = [float(r["time_s"]) for r in rows[len(first):]]
    assert later
    assert min(later) >= float(first[-1]["time_s"]) + 0.05
    assert all(None not in r.values() for r in rows)  # the torn row is gone


def test_a_file_with_other_columns_is_kept_aside(tmp_path, two_nodes):
    csv_path = tmp_path / "monitor.csv"
    csv_path.write_text("time_s,something_else\n1,2\n")
    with ResourceMonitor(csv_path, interval_s=0.05, sys_root=two_nodes, gpu_command=("none",)):
        pass
    assert (tmp_path / "monitor.previous.csv").read_text() == "time_s,something_else\n1,2\n"
    assert list(_rows(csv_path)[0])[0] == "time_s"


def test_gpu_columns_from_nvidia_smi(tmp_path, two_nodes):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '37, 1024, 81920\\n12, 2048, 81920\\n'\n")
    fake.chmod(0o755)
    command = (str(fake), "--query-gpu=utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits")
    assert query_gpus(command) == [(37.0, 1024 * 2**20), (12.0, 2048 * 2**20)]
    csv_path = tmp_path / "monitor.csv"
    with ResourceMonitor(csv_path, interval_s=0.05, sys_root=two_nodes, gpu_command=command):
        pass
    row = _rows(csv_path)[-1]
    assert float(row["gpu0_util_percent"]) == 37.0
    assert int(row["gpu0_memory_used_bytes"]) == 1024 * 2**20
    assert float(row["gpu1_util_percent"]) == 12.0
    assert int(row["gpu1_memory_used_bytes"]) == 2048 * 2**20


def test_failing_nvidia_smi_means_no_gpus(tmp_path):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    fake.chmod(0o755)
    assert query_gpus((str(fake),)) == []
    assert query_gpus(("definitely-not-installed-nvidia-smi",)) == []


def test_block_device_of_the_store(tmp_path):
    name = block_device_of(tmp_path)
    if name is not None:  # a real block device: its stats exist under that name
        assert name in (psutil.disk_io_counters(perdisk=True) or {})
    assert block_device_of(tmp_path / "missing") is None
    assert block_device_of(tmp_path, sys_root=str(tmp_path)) is None  # no /sys/dev/block there
    dev = os.stat(tmp_path).st_dev
    fake = tmp_path / "sys/dev/block"
    (tmp_path / "sys/block/vdz/vdz1").mkdir(parents=True)
    fake.mkdir(parents=True)
    (fake / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(tmp_path / "sys/block/vdz/vdz1")
    assert block_device_of(tmp_path, sys_root=str(tmp_path)) == "vdz1"


def test_rejects_a_non_positive_interval(tmp_path):
    with pytest.raises(ValueError, match="interval_s must be positive"):
        ResourceMonitor(tmp_path / "m.csv", interval_s=0)
