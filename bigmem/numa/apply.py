"""Put a Placement in force on this process, before TensorFlow creates its threads.

A memory policy applies to the calling thread and the threads it creates afterwards; CPU
affinity likewise. TensorFlow creates its thread pools at import and first use, so both must be
set before ``import tensorflow``: the CLI applies the placement before importing anything heavy.
If TensorFlow is already imported, the placement is refused rather than silently half-applied.

Memory policy goes through py-libnuma (a ctypes wrapper over the system's libnuma), imported
only when a policy other than 'none' is asked for.
"""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

from bigmem.errors import BigmemError
from bigmem.numa.policy import Placement, PolicyKind, format_nodes
from bigmem.numa.topology import parse_cpulist
from bigmem.tfenv import set_thread_pools

_applied: Placement | None = None

# <linux/mempolicy.h>: the mode get_mempolicy reports once each policy is in force
_MPOL_MODE = {PolicyKind.PREFERRED: 1, PolicyKind.BIND: 2, PolicyKind.INTERLEAVE: 3, PolicyKind.LOCAL: 4}
_MPOL_MODE_FLAGS = 0xE000  # MPOL_F_STATIC_NODES | MPOL_F_RELATIVE_NODES | MPOL_F_NUMA_BALANCING


def current() -> Placement | None:
    """The placement applied in this process, if any."""
    return _applied


def _libnuma():
    try:
        import numa  # py-libnuma
    except (ImportError, OSError) as exc:
        raise BigmemError(f"NUMA policies need libnuma: cannot load py-libnuma/libnuma.so.1 ({exc}). Install the "
                          "system package (Debian: libnuma1) or run with {numa.policy} none.") from None
    if not numa.info.numa_available():
        raise BigmemError("NUMA policies need a kernel with NUMA support (numa_available() is false); "
                          "run with {numa.policy} none.")
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
        raise BigmemError(f"Cannot apply {{numa.policy}} {placement.text}: TensorFlow is already imported in this "
                          "process, and its threads would not inherit the policy. Apply the placement first (the "
                          "bigmem command does), or start a new process.")
    if placement.kind is not PolicyKind.NONE:
        _check_mems_allowed(placement)
        numa = _libnuma()
        if placement.kind is PolicyKind.INTERLEAVE:
            numa.memory.set_interleave_nodes(*placement.nodes)
            disable_huge_page_collapse()
        elif placement.kind is PolicyKind.BIND:
            numa.memory.set_membind_nodes(*placement.nodes)
            migrate_to(placement.nodes, numa)
        elif placement.kind is PolicyKind.PREFERRED:
            numa.schedule.set_preferred_node(placement.nodes[0])
        elif placement.kind is PolicyKind.LOCAL:
            numa.memory.set_local_alloc()
        _check_in_force(placement, numa)
    if placement.cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, placement.cpus)
    set_thread_pools(placement.intra_op_threads, placement.inter_op_threads)
    _applied = placement
    return placement


def migrate_to(nodes, numa, online: str | None = None) -> int | None:
    """Move this process's pages on other nodes onto ``nodes``: what it touched before the policy was set.

    A bind policy decides where pages go from now on; the interpreter, the imports before the
    placement and the heap they grew stay where they were first touched, on the node of whichever
    CPU the process started on, and the heap is reused later. A per-node worker started on the other
    node's CPU had 5% of its anonymous memory there (measured on the 4-node guest); migrate_pages(2)
    moves it. Only pages this process alone maps move (shared library pages stay).

    Args:
        nodes: the bound nodes.
        numa: py-libnuma (``_libnuma``).
        online: the nodes to move from, a node list (default: /sys/devices/system/node/online),
            less ``nodes``.

    Returns:
        The pages that could not be moved (0: all), or None when there was nothing to move from or
        libnuma refused (the policy is in force either way).
    """
    try:
        listed = online or Path("/sys/devices/system/node/online").read_text().strip()
    except OSError:
        return None
    others = [n for n in parse_cpulist(listed) if n not in set(nodes)]
    if not others:
        return None
    lib = numa.LIBNUMA
    lib.numa_parse_nodestring.restype = ctypes.c_void_p
    lib.numa_parse_nodestring.argtypes = [ctypes.c_char_p]
    lib.numa_migrate_pages.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.numa_bitmask_free.argtypes = [ctypes.c_void_p]
    source = lib.numa_parse_nodestring(format_nodes(others).encode())
    target = lib.numa_parse_nodestring(format_nodes(list(nodes)).encode())
    try:
        if not source or not target:
            return None
        left = lib.numa_migrate_pages(0, source, target)
        return None if left < 0 else left
    finally:
        for mask in (source, target):
            if mask:
                lib.numa_bitmask_free(mask)


# <linux/prctl.h>
_PR_SET_THP_DISABLE, _PR_GET_THP_DISABLE = 41, 42


def disable_huge_page_collapse() -> bool:
    """Turn transparent huge pages off for this process and every process it starts; True if in force.

    Under an interleave policy the kernel's khugepaged undoes the interleave: it collapses runs of
    interleaved small pages into 2 MiB pages on one node, the first of equally loaded nodes, which
    for interleaved pages is always node 0 (measured on a 4-node guest, Linux 6.1: a 400 MiB numpy
    heap at 25% per node went to 99.4% on node 0 within a minute; a training run's heap was 91% on
    node 0). Huge pages taken when memory is first touched are interleaved like any page, but a
    process cannot keep those and refuse the collapse, so the whole feature goes: PR_SET_THP_DISABLE
    is inherited by children (the input workers) and kept across exec. What losing huge pages costs
    (TLB misses on large tensors) was not measured: the multi-node guest runs under emulation.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_THP_DISABLE, 1, 0, 0, 0) != 0:
        return False  # a kernel without the prctl (before 3.15): interleave still applies, less evenly
    return libc.prctl(_PR_GET_THP_DISABLE, 0, 0, 0, 0) == 1


def _check_mems_allowed(placement: Placement, proc_root: str = "/proc") -> None:
    """Refuse nodes outside this process's cpuset in one line: libnuma only warns, then crashes or carries on."""
    if placement.kind is PolicyKind.LOCAL:
        return
    try:
        status = Path(proc_root, "self/status").read_text().splitlines()
    except OSError:
        return
    listed = [line.split(":", 1)[1] for line in status if line.startswith("Mems_allowed_list:")]
    allowed = parse_cpulist(listed[0]) if listed else ()
    outside = [n for n in placement.nodes if n not in allowed]
    if allowed and outside:
        example = format_nodes(allowed[:1] if placement.kind is PolicyKind.PREFERRED else allowed)
        raise BigmemError(f"Cannot apply {{numa.policy}} {placement.text}: node {outside[0]} is outside the memory "
                          f"this process may use, node(s) {format_nodes(allowed)} (Mems_allowed_list in "
                          f"/proc/self/status, set by a cpuset cgroup, Slurm or numactl). Name only those nodes, e.g. "
                          f"{{numa.policy}} {placement.kind.value}:{example}.")


def _check_in_force(placement: Placement, numa) -> None:
    """Read the policy back from the kernel: libnuma reports a refused set_mempolicy only on stderr."""
    mode = ctypes.c_int(-1)
    if numa.LIBNUMA.get_mempolicy(ctypes.byref(mode), None, ctypes.c_ulong(0), None, ctypes.c_ulong(0)) != 0:
        return  # cannot read it back (an old kernel): the numa.json report still shows what is in force
    if mode.value & ~_MPOL_MODE_FLAGS != _MPOL_MODE[placement.kind]:
        raise BigmemError(f"Cannot apply {{numa.policy}} {placement.text}: the kernel refused the memory policy "
                          f"(get_mempolicy reports mode {mode.value}, expected {_MPOL_MODE[placement.kind]}). Check "
                          "the nodes with `bigmem info`, or run with {numa.policy} none.")
