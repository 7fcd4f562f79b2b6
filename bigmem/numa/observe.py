"""Read back where a process's threads and pages really are: the proof behind numa.json."""

from __future__ import annotations

import collections
import os
import re
import threading
import time
from pathlib import Path

_NODE_RE = re.compile(r"\bN(\d+)=(\d+)")
_PAGESIZE_RE = re.compile(r"kernelpagesize_kB=(\d+)")


def node_resident_bytes(pid: int | str = "self", proc_root: str = "/proc", *,
                        anonymous: bool = False) -> dict[int, int]:
    """Resident bytes of a process per NUMA node, summed over /proc/PID/numa_maps.

    Args:
        pid: the process (default: this one).
        proc_root: where procfs is mounted.
        anonymous: count only mappings without a file (heap, stack, anonymous mmaps), where the
            process's memory policy decides placement; file pages (libraries, page cache, shared
            memory) were often placed by whoever read them first.

    Returns:
        ``{node: bytes}``; empty when the process does not exist.
    """
    anonymous_bytes, file_bytes = resident_bytes_by_kind(pid, proc_root)
    if anonymous:
        return anonymous_bytes
    return {node: anonymous_bytes.get(node, 0) + file_bytes.get(node, 0)
            for node in sorted(set(anonymous_bytes) | set(file_bytes))}


def resident_bytes_by_kind(pid: int | str = "self", proc_root: str = "/proc") -> tuple[dict[int, int], dict[int, int]]:
    """``({node: anonymous bytes}, {node: file-backed bytes})`` of a process, from one read of its numa_maps.

    The two are apart because only the first is placed by the process's memory policy: whether
    an interleave spread the activations is read from the anonymous pages, while file pages
    (libraries, page cache, shared memory) sit where whoever read them first put them.
    """
    kinds: tuple[dict[int, int], dict[int, int]] = ({}, {})
    try:
        text = Path(proc_root, str(pid), "numa_maps").read_text()
    except OSError:  # no such process (or it ended meanwhile)
        return kinds
    for line in text.splitlines():
        totals = kinds[1] if " file=" in line else kinds[0]
        page = _PAGESIZE_RE.search(line)
        page_bytes = int(page.group(1)) * 1024 if page else os.sysconf("SC_PAGE_SIZE")
        for node, pages in _NODE_RE.findall(line):
            totals[int(node)] = totals.get(int(node), 0) + int(pages) * page_bytes
    return kinds


# How much of each thread's numa_maps thread_policies reads. The kernel builds the file by walking
# the thread's whole address space, page by page: read whole, a multiworker worker's ~108 threads
# (64 of them TensorFlow's idle gRPC pollers) took 3.5-6 s per numa.json write on 2 cores, and the
# walk grows with the footprint, which bigmem runs at up to a terabyte. The first mappings (the
# program, its libraries, the heap) carry the thread's policy as well as all of them do: with the
# first 16 KiB the 108 threads took 0.8 s instead of 3.8 s, with the same answer.
NUMA_MAPS_PREFIX_BYTES = 16 * 1024


def thread_policies(pid: int | str = "self", proc_root: str = "/proc") -> dict[str, int]:
    """{policy as numa_maps spells it: number of threads}.

    A thread's own memory policy shows in its /proc/PID/task/TID/numa_maps on every mapping
    that has no policy of its own; the most common entry among the first mappings
    (``NUMA_MAPS_PREFIX_BYTES``) is taken as the thread's policy.
    """
    counts: collections.Counter[str] = collections.Counter()
    for task in Path(proc_root, str(pid), "task").iterdir():
        try:
            with open(task / "numa_maps", "rb") as maps:
                text = maps.read(NUMA_MAPS_PREFIX_BYTES).decode(errors="replace")
        except OSError:  # the thread ended meanwhile
            continue
        lines = text.splitlines()
        if len(text) >= NUMA_MAPS_PREFIX_BYTES and lines:
            lines = lines[:-1]  # the last line may be cut
        policies = collections.Counter(line.split()[1] for line in lines if len(line.split()) > 1)
        if policies:
            counts[policies.most_common(1)[0][0]] += 1
    return dict(counts)


def thread_cpus(pid: int | str = "self", proc_root: str = "/proc") -> dict[str, int]:
    """{Cpus_allowed_list: number of threads}."""
    counts: collections.Counter[str] = collections.Counter()
    for task in Path(proc_root, str(pid), "task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    counts[line.split(":", 1)[1].strip()] += 1
        except OSError:
            continue
    return dict(counts)


def _children(pid: int | str) -> list[int]:
    """The pids of a process's descendants (its input readers); empty when it has ended."""
    import psutil

    try:
        process = psutil.Process() if pid == "self" else psutil.Process(int(pid))
        return [child.pid for child in process.children(recursive=True)]
    except psutil.Error:
        return []


def descendant_bytes_by_kind(pid: int | str = "self") -> tuple[int, dict[int, int], dict[int, int]]:
    """``(how many descendants, {node: their anonymous bytes}, {node: their file-backed bytes})``, summed
    over a process's descendants (its input readers) alive now."""
    children = _children(pid)
    summed: tuple[dict[int, int], dict[int, int]] = ({}, {})
    for child in children:
        for total, values in zip(summed, resident_bytes_by_kind(child)):
            for node, value in values.items():
                total[node] = total.get(node, 0) + value
    return len(children), summed[0], summed[1]


def _raise(peaks: dict[int, int], values: dict[int, int]) -> None:
    for node, value in values.items():
        peaks[node] = max(peaks.get(node, 0), value)


class NodePeakSampler:
    """Samples the process's resident bytes per NUMA node every ``interval_s`` and keeps each maximum.

    Its descendants (the input reader processes) are sampled too and kept apart, summed over
    those alive at each read: they place their own pages, under the policy they inherited. The
    shared-memory slots they fill are mapped by both sides, so they count among the file pages of
    each.

    Reading /proc/PID/numa_maps walks the page tables of every mapping under the process's mmap
    lock, so its cost grows with the resident set: on the dev machine a 6 GB training process
    (kits19 at 128^3) ran 3 % slower with a read every second. The sampler therefore waits at
    least ``1 / MAX_DUTY`` times as long as its last read took, keeping its share of the time
    under ``MAX_DUTY`` however large the process grows.
    """

    MAX_DUTY = 0.005

    def __init__(self, interval_s: float = 1.0, pid: int | str = "self", clock=time.perf_counter):
        self.interval_s = interval_s
        self.pid = pid
        self.peak_bytes: dict[int, int] = {}  # all resident pages, per node
        self.anonymous_peak_bytes: dict[int, int] = {}  # those the memory policy placed
        self.file_peak_bytes: dict[int, int] = {}  # libraries, page cache, shared memory
        self.children_anonymous_peak_bytes: dict[int, int] = {}  # the input readers', summed
        self.children_file_peak_bytes: dict[int, int] = {}
        self.children_peak_count = 0  # the most descendants seen at once
        self.wait_s = interval_s
        self._clock = clock
        self._stop = threading.Event()
        self._lock = threading.Lock()  # its own thread samples, and so does whoever writes a report
        self._thread = threading.Thread(target=self._loop, name="bigmem-numa-sampler", daemon=True)

    def sample(self) -> None:
        """Read the per-node resident bytes once, raise ``peak_bytes`` where higher, and set the next wait."""
        with self._lock:
            self._sample()

    def _sample(self) -> None:
        start = self._clock()
        anonymous, files = resident_bytes_by_kind(self.pid)
        _raise(self.anonymous_peak_bytes, anonymous)
        _raise(self.file_peak_bytes, files)
        _raise(self.peak_bytes, {n: anonymous.get(n, 0) + files.get(n, 0) for n in set(anonymous) | set(files)})
        count, children_anonymous, children_files = descendant_bytes_by_kind(self.pid)
        self.children_peak_count = max(self.children_peak_count, count)
        _raise(self.children_anonymous_peak_bytes, children_anonymous)
        _raise(self.children_file_peak_bytes, children_files)
        self.wait_s = max(self.interval_s, (self._clock() - start) / self.MAX_DUTY)

    def _loop(self) -> None:
        while not self._stop.wait(self.wait_s):
            self.sample()

    def __enter__(self) -> "NodePeakSampler":
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def observed(placement_dict: dict, sampler: NodePeakSampler | None = None) -> dict:
    """numa.json's content: requested, observed policy per thread, CPU affinity, per-node peaks (its own and its
    input readers')."""
    return {
        "requested": placement_dict,
        "observed": thread_policies(),
        "cpus_allowed": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "thread_cpus": thread_cpus(),
        "node_peak_bytes": _by_node(sampler.peak_bytes if sampler else {}),
        "node_peak_anonymous_bytes": _by_node(sampler.anonymous_peak_bytes if sampler else {}),
        "node_peak_file_bytes": _by_node(sampler.file_peak_bytes if sampler else {}),
        "input_workers": {
            "processes": sampler.children_peak_count if sampler else 0,
            "node_peak_anonymous_bytes": _by_node(sampler.children_anonymous_peak_bytes if sampler else {}),
            "node_peak_file_bytes": _by_node(sampler.children_file_peak_bytes if sampler else {}),
        },
    }


def _by_node(peaks: dict[int, int]) -> dict[str, int]:
    return {str(node): value for node, value in sorted(peaks.items())}
