"""Process memory from /proc: the ground truth for bigmem's measurements (DESIGN.md).

TensorFlow's allocator statistics on CPU depend on the oneDNN setting and miss memory outside
its allocator, so bigmem reads the kernel's view: VmHWM (peak resident set) and VmRSS from
/proc/PID/status, per-node pages from /proc/PID/numa_maps.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_STATUS_RE = re.compile(r"^(VmHWM|VmRSS|VmPeak|VmSize):\s+(\d+)\s+kB", re.MULTILINE)
_NODE_RE = re.compile(r"\bN(\d+)=(\d+)")
_PAGESIZE_RE = re.compile(r"kernelpagesize_kB=(\d+)")


def status_bytes(pid: int | str = "self", proc_root: str = "/proc") -> dict[str, int]:
    """{'VmHWM': bytes, 'VmRSS': bytes, ...} of a process."""
    text = Path(proc_root, str(pid), "status").read_text()
    return {key: int(kb) * 1024 for key, kb in _STATUS_RE.findall(text)}


def peak_rss_bytes(pid: int | str = "self") -> int:
    """The process's peak resident set size (VmHWM) since start or the last reset."""
    return status_bytes(pid)["VmHWM"]


def rss_bytes(pid: int | str = "self") -> int:
    return status_bytes(pid)["VmRSS"]


def reset_peak_rss(pid: int | str = "self") -> bool:
    """Reset VmHWM to the current RSS (writing 5 to clear_refs, Linux >= 4.0). False if refused."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as handle:
            handle.write("5")
        return True
    except OSError:
        return False


def node_resident_bytes(pid: int | str = "self", proc_root: str = "/proc") -> dict[int, int]:
    """Resident bytes of a process per NUMA node, summed over /proc/PID/numa_maps."""
    totals: dict[int, int] = {}
    path = Path(proc_root, str(pid), "numa_maps")
    if not path.exists():
        return totals
    for line in path.read_text().splitlines():
        page = _PAGESIZE_RE.search(line)
        page_bytes = int(page.group(1)) * 1024 if page else os.sysconf("SC_PAGE_SIZE")
        for node, pages in _NODE_RE.findall(line):
            totals[int(node)] = totals.get(int(node), 0) + int(pages) * page_bytes
    return totals
