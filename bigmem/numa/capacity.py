"""Memory budgets per NUMA node: what a placement can really use.

bind: the free memory of the bound nodes, not of the machine. interleave: pages spread evenly,
so the job fits only if each node can hold its share: the budget is (smallest free) x nodes.
preferred, local and none may spill anywhere: the machine's MemAvailable.
"""

from __future__ import annotations

from bigmem.errors import InsufficientMemoryError
from bigmem.numa.policy import Placement, PolicyKind
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes


def placement_budget(placement: Placement, topology: NUMATopology, machine_available_bytes: int) -> tuple[int, str]:
    """(budget bytes, where it comes from) for the pre-flight check and the planner."""
    if placement.kind is PolicyKind.BIND:
        free = sum(topology.node(n).free_bytes for n in placement.nodes)
        return free, f"free memory of node(s) {','.join(map(str, placement.nodes))}"
    if placement.kind is PolicyKind.INTERLEAVE:
        return interleave_budget(placement.nodes, topology)
    return machine_available_bytes, "MemAvailable"


def interleave_budget(nodes, topology: NUMATopology) -> tuple[int, str]:
    """(budget bytes, where it comes from) of one process interleaved over ``nodes``: each holds an equal
    share, so the smallest node's free memory times the nodes.

    Example:
        >>> interleave_budget([0, 1], topology)  # two nodes with 100 and 80 GiB free
        (171798691840, '2 interleaved node(s) x the smallest free 80.00 GiB')
    """
    smallest = min(topology.node(n).free_bytes for n in nodes)
    return smallest * len(nodes), f"{len(nodes)} interleaved node(s) x the smallest free {format_bytes(smallest)}"


def check_nodes_fit(required_bytes: int, placement: Placement, topology: NUMATopology) -> None:
    """Raise InsufficientMemoryError (exit 3) with per-node figures when the placement cannot hold the job."""
    if placement.kind not in (PolicyKind.BIND, PolicyKind.INTERLEAVE):
        return
    free = {n: topology.node(n).free_bytes for n in placement.nodes}
    figures = ", ".join(f"node {n}: {format_bytes(b)} free" for n, b in free.items())
    if placement.kind is PolicyKind.BIND and required_bytes > sum(free.values()):
        raise InsufficientMemoryError(
            f"Predicted peak {format_bytes(required_bytes)} does not fit {{numa.policy}} {placement.text} ({figures}; "
            f"{format_bytes(sum(free.values()))} in all). Bind more nodes, or use {{numa.policy}} interleave.",
            required_bytes, sum(free.values()))
    share = required_bytes / len(free)
    short = [n for n, b in free.items() if b < share]
    if placement.kind is PolicyKind.INTERLEAVE and short:
        raise InsufficientMemoryError(
            f"Predicted peak {format_bytes(required_bytes)} interleaved over {len(free)} node(s) needs "
            f"{format_bytes(share)} on each; node {short[0]} has {format_bytes(free[short[0]])} ({figures}).",
            required_bytes, min(free.values()) * len(free))
