"""Fake sysfs trees describing 2- and 4-socket machines."""

from __future__ import annotations

from pathlib import Path

import pytest

GIB_KB = 1024 * 1024  # sysfs meminfo is in kB


def make_sysfs(root: Path, nodes: list[tuple[str, int, int]], distances: list[list[int]]) -> Path:
    """nodes: (cpulist, total GiB, free GiB) per node."""
    base = root / "sys/devices/system/node"
    for node, (cpulist, total_gib, free_gib) in enumerate(nodes):
        d = base / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpulist + "\n")
        (d / "distance").write_text(" ".join(map(str, distances[node])) + "\n")
        (d / "meminfo").write_text(
            f"Node {node} MemTotal:       {total_gib * GIB_KB} kB\n"
            f"Node {node} MemFree:        {free_gib * GIB_KB} kB\n"
            f"Node {node} MemUsed:        {(total_gib - free_gib) * GIB_KB} kB\n"
            f"Node {node} FilePages:      0 kB\n"
            f"Node {node} Shmem:          0 kB\n")
    (base / "online").write_text(f"0-{len(nodes) - 1}\n")
    return root


@pytest.fixture
def two_socket(tmp_path):
    """2 x 24 cores with SMT siblings (0-23,48-71 | 24-47,72-95), 768 GiB each; node 1 half full."""
    return make_sysfs(tmp_path, [("0-23,48-71", 768, 700), ("24-47,72-95", 768, 384)], [[10, 21], [21, 10]])


@pytest.fixture
def four_socket(tmp_path):
    """4 x 20 cores (80 cores, as the 2020 paper's server), 384 GiB each; node 3 nearly full."""
    return make_sysfs(tmp_path, [("0-19", 384, 370), ("20-39", 384, 370), ("40-59", 384, 370), ("60-79", 384, 40)],
                      [[10, 21, 21, 21], [21, 10, 21, 21], [21, 21, 10, 21], [21, 21, 21, 10]])
