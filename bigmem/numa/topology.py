"""NUMA topology read from sysfs (an injectable root, so tests can describe big machines)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import psutil

from bigmem.errors import DataError


def parse_cpulist(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = part.split("-")
                cpus.extend(range(int(lo), int(hi) + 1))
            else:
                cpus.append(int(part))
        except ValueError:
            raise DataError(f"Cannot parse CPU list {text.strip()!r}: expected a list such as 0-3,8,10-11.") from None
    return tuple(sorted(set(cpus)))


@dataclass(frozen=True)
class NUMANode:
    """One NUMA node: its CPUs, its memory (total, and free including reclaimable page cache) and distances."""

    node_id: int
    cpus: tuple[int, ...]
    total_bytes: int
    free_bytes: int
    distances: tuple[int, ...]


@dataclass(frozen=True)
class NUMATopology:
    """The machine's NUMA nodes, as read by ``from_sysfs``."""

    nodes: tuple[NUMANode, ...]
    source: str  # where it was read from

    @property
    def num_nodes(self) -> int:
        """The number of nodes."""
        return len(self.nodes)

    @property
    def total_bytes(self) -> int:
        """Memory of all nodes together, in bytes."""
        return sum(n.total_bytes for n in self.nodes)

    def node(self, node_id: int) -> NUMANode:
        """The node with id ``node_id``.

        Args:
            node_id: the kernel's node number.

        Returns:
            That ``NUMANode``.

        Raises:
            KeyError: no such node.
        """
        for node in self.nodes:
            if node.node_id == node_id:
                return node
        raise KeyError(node_id)

    @classmethod
    def from_sysfs(cls, root: str | os.PathLike = "/") -> "NUMATopology":
        """Read ``<root>/sys/devices/system/node``; a machine without it is one node."""
        base = Path(root) / "sys/devices/system/node"
        node_dirs = sorted((p for p in base.glob("node[0-9]*") if p.is_dir()), key=lambda p: int(p.name[4:]))
        if not node_dirs:
            memory = psutil.virtual_memory()
            cpus = tuple(sorted(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else ()
            return cls((NUMANode(0, cpus, memory.total, memory.available, (10,)),), source="psutil (no sysfs nodes)")
        nodes = []
        for node_dir in node_dirs:
            meminfo = _read_meminfo(node_dir / "meminfo")
            distance_file = node_dir / "distance"
            distances = tuple(int(d) for d in distance_file.read_text().split()) if distance_file.exists() else ()
            nodes.append(NUMANode(
                node_id=int(node_dir.name[4:]),
                cpus=parse_cpulist((node_dir / "cpulist").read_text()) if (node_dir / "cpulist").exists() else (),
                total_bytes=meminfo.get("MemTotal", 0),
                free_bytes=meminfo.get("MemFree", 0) + meminfo.get("FilePages", 0) - meminfo.get("Shmem", 0),
                distances=distances,
            ))
        return cls(tuple(nodes), source=str(base))

    def to_dict(self) -> dict:
        """The topology as JSON values: ``{source, nodes: [{node, cpus, total_bytes, free_bytes, distances}]}``."""
        return {"source": self.source, "nodes": [
            {"node": n.node_id, "cpus": list(n.cpus), "total_bytes": n.total_bytes, "free_bytes": n.free_bytes,
             "distances": list(n.distances)} for n in self.nodes]}


def _read_meminfo(path: Path) -> dict[str, int]:
    """Per-node meminfo lines look like 'Node 0 MemTotal:  24624868 kB'."""
    values: dict[str, int] = {}
    if not path.exists():
        return values
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 4 and parts[0] == "Node":
            values[parts[2].rstrip(":")] = int(parts[3]) * (1024 if parts[-1] == "kB" else 1)
    return values
