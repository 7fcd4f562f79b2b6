"""Put a Placement in force on this process, before TensorFlow creates its threads.

A memory policy applies to the calling thread and the threads it creates afterwards; CPU
affinity likewise. TensorFlow creates its thread pools at import and first use, so both must be
set before ``import tensorflow``: the CLI applies the placement before importing anything heavy.
If TensorFlow is already imported, the placement is refused rather than silently half-applied.

Memory policy goes through py-libnuma (a ctypes wrapper over the system's libnuma), imported
only when a policy other than 'none' is asked for.
"""

from __future__ import annotations

import os
import sys

from bigmem.errors import BigmemError
from bigmem.numa.policy import Placement, PolicyKind
from bigmem.tfenv import set_thread_pools

_applied: Placement | None = None


def current() -> Placement | None:
    """The placement applied in this process, if any."""
    return _applied


def _libnuma():
    try:
        import numa  # py-libnuma
    except (ImportError, OSError) as exc:
        raise BigmemError(f"NUMA policies need libnuma: cannot load py-libnuma/libnuma.so.1 ({exc}). Install the "
                          "system package (Debian: libnuma1) or run with --numa none.") from None
    if not numa.info.numa_available():
        raise BigmemError("NUMA policies need a kernel with NUMA support (numa_available() is false); "
                          "run with --numa none.")
    return numa


def place(policy: str | None, cpus: str | None = None, threads: int | None = None, *,
          sysfs_root: str = "/") -> Placement:
    """Resolve ``--numa/--cpus/--threads`` against this machine and apply them."""
    from bigmem.numa.policy import resolve_placement
    from bigmem.numa.topology import NUMATopology

    topology = NUMATopology.from_sysfs(sysfs_root)
    allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else {c for n in topology.nodes
                                                                                      for c in n.cpus}
    return apply_placement(resolve_placement(policy, cpus, threads, topology, allowed))


def apply_placement(placement: Placement) -> Placement:
    """Set the memory policy and CPU affinity of this process (and the threads it will create).

    The placement's thread-pool sizes are handed to ``bigmem.tfenv``, which applies them when it
    imports TensorFlow.
    """
    global _applied
    if "tensorflow" in sys.modules and placement.kind is not PolicyKind.NONE:
        raise BigmemError(f"Cannot apply --numa {placement.text}: TensorFlow is already imported in this process, "
                          "and its threads would not inherit the policy. Apply the placement first (the bigmem "
                          "command does), or start a new process.")
    if placement.kind is not PolicyKind.NONE:
        numa = _libnuma()
        if placement.kind is PolicyKind.INTERLEAVE:
            numa.memory.set_interleave_nodes(*placement.nodes)
        elif placement.kind is PolicyKind.BIND:
            numa.memory.set_membind_nodes(*placement.nodes)
        elif placement.kind is PolicyKind.PREFERRED:
            numa.schedule.set_preferred_node(placement.nodes[0])
        elif placement.kind is PolicyKind.LOCAL:
            numa.memory.set_local_alloc()
    if placement.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)
    set_thread_pools(placement.intra_op_threads, placement.inter_op_threads)
    _applied = placement
    return placement
