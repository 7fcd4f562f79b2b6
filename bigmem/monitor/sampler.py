"""ResourceMonitor: a background thread writing RUN_DIR/monitor.csv once per interval.

Each row (monitor.csv's columns, README.md; units in the names): the process's CPU % (not normalised:
500% = five cores busy), threads, RSS and its peak (VmHWM), the system page cache, read and
write bytes/s of the block device that holds the store, memory used on each NUMA node, and,
where an NVIDIA driver is present, each GPU's utilisation and memory (``nvidia-smi``).

Every source is a small /proc or /sys read (psutil), so a sample costs well under a
millisecond on the training process; ``nvidia-smi`` is a subprocess, run only when GPUs exist.
Rows are flushed as they are written, so ``bigmem report`` can read a running run. Beside the
CSV, monitor.json says which disk device and NUMA nodes the columns describe.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

from bigmem.memory.procfs import status_bytes
from bigmem.numa.topology import NUMATopology
from bigmem.atomic import atomic_write_json

BASE_COLUMNS = ("time_s", "cpu_percent", "num_threads", "rss_bytes", "peak_rss_bytes", "page_cache_bytes",
                "disk_read_bytes_per_s", "disk_write_bytes_per_s")
NVIDIA_SMI_QUERY = ("nvidia-smi", "--query-gpu=utilization.gpu,memory.used,memory.total",
                    "--format=csv,noheader,nounits")


def block_device_of(path: str | os.PathLike | None, sys_root: str = "/") -> str | None:
    """The /proc/diskstats name of the block device holding ``path`` (its whole disk if a
    partition), or None when there is none (tmpfs, overlay, network file systems)."""
    if path is None:
        return None
    try:
        dev = os.stat(path).st_dev
    except OSError:
        return None
    link = Path(sys_root, "sys/dev/block", f"{os.major(dev)}:{os.minor(dev)}")
    try:
        resolved = link.resolve(strict=True)
    except OSError:
        return None
    # A partition's directory sits inside its disk's and has a 'partition' file; stats are per
    # name in /proc/diskstats either way, so the partition's own name is the precise one.
    return resolved.name


def gpu_columns(num_gpus: int) -> tuple[str, ...]:
    """monitor.csv's GPU columns: ``gpu<i>_util_percent`` and ``gpu<i>_memory_used_bytes`` per GPU."""
    return tuple(column for index in range(num_gpus)
                 for column in (f"gpu{index}_util_percent", f"gpu{index}_memory_used_bytes"))


def query_gpus(command: tuple[str, ...] = NVIDIA_SMI_QUERY, timeout_s: float = 5.0) -> list[tuple[float, int]]:
    """[(utilisation %, memory used bytes)] per GPU from nvidia-smi; [] without a driver or GPU."""
    if shutil.which(command[0]) is None:
        return []
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if result.returncode != 0:
        return []
    gpus = []
    for line in result.stdout.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        try:
            gpus.append((float(fields[0]), int(float(fields[1]) * 2**20)))  # memory.used is in MiB
        except (IndexError, ValueError):
            continue
    return gpus


@dataclass
class _Counters:
    time_s: float
    read_bytes: int
    write_bytes: int


class ResourceMonitor:
    """Samples this process and the machine every ``interval_s`` into ``csv_path``.

    ``store_path`` picks the block device whose throughput is recorded (all disks when it has
    none). ``sys_root`` is injectable for the per-node memory (tests use fake sysfs trees).
    On resume (``csv_path`` exists with the same columns) rows are appended and ``time_s``
    continues from the last row.
    """

    def __init__(self, csv_path: str | os.PathLike, *, interval_s: float = 1.0,
                 store_path: str | os.PathLike | None = None, sys_root: str = "/",
                 gpu_command: tuple[str, ...] = NVIDIA_SMI_QUERY):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be positive, got {interval_s}")
        self.csv_path = Path(csv_path)
        self.interval_s = float(interval_s)
        self._cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        self.sys_root = sys_root
        self.device = block_device_of(store_path, sys_root)
        self.gpu_command = gpu_command
        self.num_gpus = len(query_gpus(gpu_command))
        self._node_totals = {node.node_id: node.total_bytes for node in NUMATopology.from_sysfs(sys_root).nodes}
        self.nodes = sorted(self._node_totals)
        self.columns = (*BASE_COLUMNS, *(f"node{n}_used_bytes" for n in self.nodes), *gpu_columns(self.num_gpus))
        self.samples = 0
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="bigmem-monitor", daemon=True)
        self._handle: io.TextIOWrapper | None = None
        self._offset_s = 0.0
        self._started = 0.0
        self._last: _Counters | None = None

    # ---- sources ------------------------------------------------------------------------------

    def _disk_counters(self) -> tuple[int, int]:
        if self.device is not None:
            counters = psutil.disk_io_counters(perdisk=True) or {}
            if self.device in counters:
                c = counters[self.device]
                return c.read_bytes, c.write_bytes
        total = psutil.disk_io_counters(perdisk=False)
        return (total.read_bytes, total.write_bytes) if total else (0, 0)

    def _node_used_bytes(self) -> dict[int, int]:
        return {node: _node_used(self.sys_root, node, total) for node, total in self._node_totals.items()}

    def sample(self) -> dict:
        """One row (also written to the CSV when the monitor is running)."""
        now = time.monotonic()
        read_bytes, write_bytes = self._disk_counters()
        if self._last is None:
            read_rate = write_rate = 0.0
        else:
            elapsed = max(now - self._last.time_s, 1e-9)
            read_rate = max(0, read_bytes - self._last.read_bytes) / elapsed
            write_rate = max(0, write_bytes - self._last.write_bytes) / elapsed
        self._last = _Counters(now, read_bytes, write_bytes)
        status = status_bytes()
        memory = psutil.virtual_memory()
        row = {
            "time_s": round(self._offset_s + now - self._started, 3),
            # psutil's CPU times come in scheduler ticks (10 ms per thread), so over short intervals
            # on a busy machine the ratio can pass what the allowed CPUs can do; that bound is physical.
            "cpu_percent": round(min(self._process.cpu_percent(interval=None), 100.0 * self._cpus), 1),
            "num_threads": self._process.num_threads(),
            "rss_bytes": status["VmRSS"],
            "peak_rss_bytes": status["VmHWM"],
            "page_cache_bytes": int(getattr(memory, "cached", 0)),
            "disk_read_bytes_per_s": int(read_rate),
            "disk_write_bytes_per_s": int(write_rate),
        }
        used = self._node_used_bytes()
        for node in self.nodes:
            row[f"node{node}_used_bytes"] = used.get(node, 0)
        if self.num_gpus:
            gpus = query_gpus(self.gpu_command)
            for index in range(self.num_gpus):
                util, memory_bytes = gpus[index] if index < len(gpus) else ("", "")
                row[f"gpu{index}_util_percent"] = util
                row[f"gpu{index}_memory_used_bytes"] = memory_bytes
        return row

    # ---- the thread ------------------------------------------------------------------------------

    def describe(self) -> dict:
        """What the columns measure here (written beside the CSV as monitor.json)."""
        return {"interval_s": self.interval_s, "disk_device": self.device or "all disks (the store has no block "
                "device of its own)", "numa_nodes": self.nodes, "num_gpus": self.num_gpus, "columns": self.columns}

    def _open(self) -> None:
        self.csv_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(self.csv_path.with_suffix(".json"), self.describe())
        same_columns, previous = _existing(self.csv_path, self.columns)
        if self.csv_path.exists() and not same_columns:  # written with other columns: keep it aside
            self.csv_path.replace(self.csv_path.with_suffix(".previous.csv"))
        elif same_columns:
            _drop_torn_tail(self.csv_path)
        self._offset_s = float(previous["time_s"]) + self.interval_s if previous else 0.0
        self._handle = open(self.csv_path, "a", newline="", buffering=1)
        if not same_columns:
            csv.DictWriter(self._handle, fieldnames=self.columns).writeheader()

    def _write(self, row: dict) -> None:
        # One write() per row, flushed: a reader (or a kill) sees whole rows, at most a torn last one.
        buffer = io.StringIO()
        csv.DictWriter(buffer, fieldnames=self.columns).writerow(row)
        self._handle.write(buffer.getvalue())
        self._handle.flush()
        self.samples += 1

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._write(self.sample())

    def __enter__(self) -> "ResourceMonitor":
        self._open()
        self._started = time.monotonic()
        self._process.cpu_percent(interval=None)  # starts psutil's CPU-time baseline
        self._write(self.sample())
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._write(self.sample())
        self._handle.close()


def _node_used(sys_root: str, node: int, total_bytes: int) -> int:
    """MemTotal - MemFree of one node (what the node's memory holds: processes and page cache)."""
    path = Path(sys_root, "sys/devices/system/node", f"node{node}", "meminfo")
    if not path.exists():  # no sysfs nodes: the whole machine is node 0
        memory = psutil.virtual_memory()
        return int(memory.total - memory.free)
    free = 0
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[2] == "MemFree:":
            free = int(parts[3]) * 1024
    return max(0, total_bytes - free)


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line without its newline (a row torn by a kill) before appending to ``path``."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)


def _existing(path: Path, columns: tuple[str, ...]) -> tuple[bool, dict | None]:
    """(whether ``path`` exists with exactly these columns, its last complete row or None)."""
    if not path.exists():
        return False, None
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        if tuple(reader.fieldnames or ()) != columns:
            return False, None
        last = None
        for row in reader:
            if None not in row.values() and row.get("time_s"):
                last = row
        return True, last
