"""The memory budget: what a job's predicted peak may be, in one rule (``resolve_budget``).

Whether a job fits it is ``memory.plans``'s question (the planning API every command asks).
The rule:

1. an explicit budget (``--memory-budget SIZE``; ``--budget`` on ``bigmem plan``) wins;
2. else what the NUMA placement bigmem runs under can use: ``bind:NODES`` the bound nodes' free
   memory, ``interleave[:NODES]`` the smallest node's free memory times the nodes
   (``numa.capacity.placement_budget``);
3. else (no placement, or ``local``, ``preferred`` or ``none``, which may spill anywhere)
   MemAvailable. ``bigmem plan``'s search on a machine of several nodes sizes by what a layout
   can hold instead (``memory.plans.search_budget``).

An explicit budget larger than a bind or interleave placement can use is capped to it, with a
one-line note: the pages cannot land anywhere else. An explicit budget above MemAvailable is
kept (a plan for a bigger machine, or page cache the user knows can be dropped).
"""

from __future__ import annotations

from bigmem.errors import InsufficientMemoryError
from bigmem.memory.records import Budget as Budget  # re-exported: the budget's type
from bigmem.memory.search import (
    available_memory_bytes,
    machine_memory_bytes,
)
from bigmem.numa.capacity import placement_budget
from bigmem.numa.policy import Placement, PolicyKind
from bigmem.numa.topology import NUMATopology
from bigmem.units import format_bytes

EXPLICIT_FLAG = "--memory-budget"
# An explicit budget's source as the library names it: the setting, which the command line renders as its flag.
EXPLICIT_FIELD = "{memory.budget_bytes}"
# Policies whose pages stay on the placement's nodes: their free memory is the most a job can use.
NODE_BOUND_POLICIES = (PolicyKind.BIND, PolicyKind.INTERLEAVE)


def resolve_budget(explicit_bytes: int | None = None, *, flag: str = EXPLICIT_FLAG,
                   placement: Placement | None = None, topology: NUMATopology | None = None,
                   available_bytes: int | None = None) -> Budget:
    """The memory budget, by the one precedence rule of this module's docstring.

    Args:
        explicit_bytes: the budget the user gave, or None.
        flag: how the user spelled it (``--memory-budget``, or ``--budget`` on ``bigmem plan``);
            it becomes the budget's source.
        placement: the NUMA placement the job runs under (applied, or resolved for planning);
            None for none.
        topology: the machine's nodes (default: read from sysfs when a bind or interleave
            placement needs them).
        available_bytes: MemAvailable (default: read now, when the rule falls through to it).

    Returns:
        The ``Budget``.

    Example:
        >>> resolve_budget(2**30, available_bytes=2**40)
        Budget(budget_bytes=1073741824, source='--memory-budget', note='', placement=None, topology=None)
    """
    limit = None
    if placement is not None and placement.kind in NODE_BOUND_POLICIES:
        topology = topology or NUMATopology.from_sysfs()
        limit = placement_budget(placement, topology, 0)  # bind/interleave: the nodes' free memory only
    if explicit_bytes is not None:
        if limit is None or explicit_bytes <= limit[0]:
            return Budget(int(explicit_bytes), flag)
        note = (f"note: {flag} {format_bytes(explicit_bytes)} is more than --numa {placement.text} can use; "
                f"budgeting {format_bytes(limit[0])} ({limit[1]})")
        return Budget(limit[0], limit[1], note, placement, topology)
    if limit is not None:
        return Budget(limit[0], limit[1], placement=placement, topology=topology)
    available = available_memory_bytes() if available_bytes is None else int(available_bytes)
    return Budget(available, "MemAvailable")


def check_budget_within_machine(budget: Budget, *, force: bool = False, machine_bytes: int | None = None) -> None:
    """Refuse (exit 3) an explicit budget above the machine's memory: the kernel, not bigmem, would stop the run.

    Args:
        budget: ``resolve_budget(...)``.
        force: keep it anyway (a user who knows better, e.g. swap the kernel will use).
        machine_bytes: MemTotal (default: read now).

    Raises:
        InsufficientMemoryError: an explicit budget (given by a flag or as ``EXPLICIT_FIELD``) exceeds MemTotal,
            unless ``force``.
    """
    if force or not (budget.source.startswith("--") or budget.source == EXPLICIT_FIELD):
        return
    total = machine_memory_bytes() if machine_bytes is None else int(machine_bytes)
    if budget.budget_bytes > total:
        raise InsufficientMemoryError(
            f"{budget.source} {format_bytes(budget.budget_bytes)} is more than this machine's memory "
            f"({format_bytes(total)}, MemTotal): a job planned for it would be killed by the kernel, not stopped by "
            f"bigmem. Give at most {format_bytes(total)}, or {{train.force}} to run anyway.", budget.budget_bytes,
            total)


__all__ = ["Budget", "EXPLICIT_FIELD", "EXPLICIT_FLAG", "check_budget_within_machine", "resolve_budget"]
