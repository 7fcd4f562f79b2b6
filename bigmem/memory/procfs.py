"""Process memory from /proc: the ground truth for bigmem's measurements (docs/guide.md, "Planning memory").

TensorFlow's allocator statistics on CPU depend on the oneDNN setting and miss memory outside
its allocator, so bigmem reads the kernel's view: VmHWM (peak resident set) and VmRSS from
/proc/PID/status. Per-node pages (/proc/PID/numa_maps) are read by ``bigmem.numa.observe``.
"""

from __future__ import annotations

import re
from pathlib import Path

_STATUS_RE = re.compile(r"^(VmHWM|VmRSS|VmPeak|VmSize):\s+(\d+)\s+kB", re.MULTILINE)


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
