"""One MultiWorkerMirroredStrategy worker per NUMA node of this host: plan, launch, supervise.

Intel's recipe for TensorFlow on multi-socket Xeons is one or two ranks per socket: each worker's
memory and threads stay on its own node, and only the gradients cross the interconnect. This
module plans the workers against a ``NUMATopology`` (injectable, so tests describe any machine):
one per node that has CPUs (memory-only nodes, such as CXL expanders, get none), each with a free
loopback port, its TF_CONFIG and its ``bind:N`` placement. It then starts them as
``python -m bigmem train --config WORKER.json``, each given the resolved config as JSON (strategy
multiworker, its own placement), and supervises them: a signal to the
launcher is forwarded to every worker, and the death of any worker stops the others (a survivor
blocks in the next all-reduce forever, so it is killed after a short grace).

Only worker 0, the chief, writes the run directory; the others train in temporary folders that
are removed at the end. A resume seeds each of those with a copy of the chief's directory, so
every worker continues from the same checkpoint (their weights are identical by construction).

TensorFlow is never imported here.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from bigmem.atomic import atomic_write_json
from bigmem.config.schema import ExperimentConfig
from bigmem.errors import BigmemError, InsufficientMemoryError, PeerLost, UsageError
from bigmem.numa.capacity import check_nodes_fit
from bigmem.numa.policy import Placement, PolicyKind, format_nodes
from bigmem.numa.topology import NUMATopology

# A signalled worker finishes its step and writes a checkpoint before it exits; 60 s covers a
# kits19 checkpoint (31 M parameters with Adam's two slots, ~0.4 GB) on a slow disk.
STOP_GRACE_S = 60.0
# After a worker died its peers are blocked in an all-reduce and cannot reach a step boundary:
# SIGTERM cannot stop them, so they get a short grace and then SIGKILL.
FAILURE_GRACE_S = 3.0
POLL_S = 0.2


@dataclass(frozen=True)
class Worker:
    """One worker of a per-node run.

    Attributes:
        index: its task index in TF_CONFIG (0 is the chief, which writes the run directory).
        node_id: the NUMA node whose memory and CPUs it is bound to.
        cpus: the CPUs it runs on (its node's, or its share of them with several workers per node).
        address: ``host:port`` it listens on for the collectives.
        split: True when its node's CPUs are shared out between several workers (``--cpus`` is given).
    """

    index: int
    node_id: int
    cpus: tuple[int, ...]
    address: str
    split: bool = False

    @property
    def numa(self) -> str:
        """Its ``--numa`` policy: the memory of its node only."""
        return f"bind:{self.node_id}"

    def placement(self) -> dict:
        """Its ``numa`` settings: ``bind:N`` and, when its node's CPUs are split, its own CPUs."""
        return {"policy": self.numa, **({"cpus": format_nodes(self.cpus)} if self.split else {})}


def worker_config(config: ExperimentConfig, worker: Worker) -> ExperimentConfig:
    """``config`` as one per-node worker trains it: multiworker, placed on its node (``Worker.placement``)."""
    return config.updated({"distribute": {"strategy": "multiworker"}, "numa": worker.placement()})


@dataclass(frozen=True)
class PerNodePlan:
    """The workers of a per-node run (``plan_workers`` makes it).

    Attributes:
        workers: one per node with CPUs (or ``workers_per_node`` each), in node order.
        memory_only_nodes: nodes with memory but no CPUs: no worker runs there.
        workers_per_node: workers on each node with CPUs.
    """

    workers: tuple[Worker, ...]
    memory_only_nodes: tuple[int, ...] = ()
    workers_per_node: int = 1

    @property
    def num_workers(self) -> int:
        """The number of workers."""
        return len(self.workers)

    @property
    def cluster(self) -> dict:
        """TF_CONFIG's ``cluster``: ``{"worker": [address, ...]}``."""
        return {"worker": [w.address for w in self.workers]}

    def tf_config(self, index: int) -> str:
        """The TF_CONFIG of worker ``index``, as the JSON text the environment variable holds."""
        return json.dumps({"cluster": self.cluster, "task": {"type": "worker", "index": index}})

    def global_batch(self, batch_size: int) -> int:
        """Samples per step over every worker when each takes ``batch_size``."""
        return batch_size * self.num_workers

    def notes(self) -> list[str]:
        """Lines to tell the user: the memory-only nodes that get no worker."""
        if not self.memory_only_nodes:
            return []
        return [f"note: node(s) {format_nodes(self.memory_only_nodes)} have memory but no CPUs: no worker runs there "
                "(each worker's memory stays on its own node)"]

    def describe(self, batch_size: int) -> str:
        """One line: how many workers on which nodes, and the global batch."""
        where = ", ".join(f"worker {w.index} on node {w.node_id} (CPUs {format_nodes(w.cpus)}, {w.address})"
                          for w in self.workers)
        workers = f"{self.num_workers} worker{'s' if self.num_workers != 1 else ''}"
        return (f"per-node: {workers}, global batch {self.global_batch(batch_size)} "
                f"({self.num_workers} x --batch-size {batch_size}): {where}")


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports free on ``host`` now (all held open together while chosen, so never equal)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def plan_workers(topology: NUMATopology, *, workers_per_node: int = 1, allowed_cpus: set[int] | None = None,
                 host: str = "127.0.0.1", ports: Sequence[int] | None = None) -> PerNodePlan:
    """Plan one worker per NUMA node that has CPUs (or ``workers_per_node`` each, sharing its CPUs).

    Args:
        topology: the machine's nodes (``NUMATopology.from_sysfs``; tests pass fake ones).
        workers_per_node: workers on each node (default 1); a node's CPUs are split into that many
            contiguous shares.
        allowed_cpus: the CPUs this process may use (default: its affinity); a node none of whose
            allowed CPUs remain counts as memory-only.
        host: the address the workers listen on (default loopback: they all run on this host).
        ports: one port per worker (default: ``free_ports``).

    Returns:
        The ``PerNodePlan``.

    Raises:
        UsageError: ``workers_per_node`` below 1, no node has CPUs, a node has fewer CPUs than
            workers, or ``ports`` has the wrong length.

    Example:
        >>> plan = plan_workers(NUMATopology.from_sysfs("/tmp/fake-2-node"))
        >>> [w.numa for w in plan.workers]
        ['bind:0', 'bind:1']
    """
    if workers_per_node < 1:
        raise UsageError(f"Invalid {{train_per_node.workers_per_node}} {workers_per_node}: expected a positive "
                         f"integer.")
    if allowed_cpus is None:
        allowed_cpus = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else {
            c for n in topology.nodes for c in n.cpus}
    with_cpus, memory_only = [], []
    for node in topology.nodes:
        cpus = tuple(c for c in node.cpus if c in allowed_cpus)
        (with_cpus if cpus else memory_only).append((node.node_id, cpus))
    if not with_cpus:
        raise UsageError("{distribute.strategy} per-node found no NUMA node with CPUs this process may use "
                         f"({topology.source}); run without {{distribute.strategy}} per-node.")
    shares = []
    for node_id, cpus in with_cpus:
        if len(cpus) < workers_per_node:
            raise UsageError(f"Invalid {{train_per_node.workers_per_node}} {workers_per_node}: node {node_id} has "
                             f"{len(cpus)} CPU(s) this process may use, fewer than its workers. "
                             f"Try {{train_per_node.workers_per_node}} {len(cpus)}.")
        step = len(cpus) / workers_per_node
        shares += [(node_id, cpus[round(k * step):round((k + 1) * step)]) for k in range(workers_per_node)]
    ports = list(ports) if ports is not None else free_ports(len(shares), host)
    if len(ports) != len(shares):
        raise UsageError(f"{len(ports)} port(s) given for {len(shares)} workers.")
    workers = tuple(Worker(i, node_id, cpus, f"{host}:{port}", workers_per_node > 1)
                    for i, ((node_id, cpus), port) in enumerate(zip(shares, ports)))
    return PerNodePlan(workers, tuple(n for n, _ in memory_only), workers_per_node)


def check_node_memory(plan: PerNodePlan, topology: NUMATopology, worker_peak_bytes: int) -> None:
    """Refuse a plan whose workers on some node need more than that node's free memory.

    Args:
        plan: the workers (``plan_workers``).
        topology: the nodes and their free memory.
        worker_peak_bytes: one worker's predicted peak (``memory.plans.plan_job`` at its batch).

    Raises:
        InsufficientMemoryError: (exit 3) naming the first node that cannot hold its workers.
    """
    for node_id in sorted({w.node_id for w in plan.workers}):
        count = sum(1 for w in plan.workers if w.node_id == node_id)
        bind = Placement(PolicyKind.BIND, (node_id,), (), 1, 1, text=f"bind:{node_id}")
        try:
            check_nodes_fit(worker_peak_bytes * count, bind, topology)  # the one bind-fits rule
        except InsufficientMemoryError as exc:
            who = "its worker" if count == 1 else f"its {count} workers"
            raise InsufficientMemoryError(f"{{distribute.strategy}} per-node: node {node_id} cannot hold {who}. "
                                          f"{exc.template}",
                                          exc.required_bytes, exc.available_bytes) from None


class WorkerFailed(BigmemError):
    """A worker of a per-node run died; the others were stopped. Exit 3 when it refused for memory, else 1."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def worker_dirs(plan: PerNodePlan, run_dir: Path, *, resume: bool, scratch: Path) -> list[Path]:
    """Each worker's ``--out``: the run directory for the chief, a folder under ``scratch`` for the others.

    Resuming, each other worker's folder starts as a copy of the chief's run directory (without its
    TensorBoard events), so all of them restore the same checkpoint.
    """
    dirs = [Path(run_dir)]
    for worker in plan.workers[1:]:
        target = scratch / f"worker{worker.index}"
        if resume and (Path(run_dir) / "config.json").exists():
            shutil.copytree(run_dir, target, ignore=shutil.ignore_patterns("tensorboard"), symlinks=True)
        dirs.append(target)
    return dirs


@dataclass
class _Running:
    worker: Worker
    process: subprocess.Popen
    last_line: str = ""
    reader: threading.Thread | None = None


def _read_stderr(running: _Running, echo) -> None:
    for line in running.process.stderr:
        if line.strip():
            running.last_line = line.strip()
        if echo is not None and not _is_error_line(line):  # a failed worker's error is the launcher's to report
            echo.write(line)
            echo.flush()


def _is_error_line(line: str) -> bool:
    """The CLI's closing line of a failed ``bigmem train`` (``bigmem train: error: ...``)."""
    return line.startswith(("bigmem train: error:", "bigmem train: internal error:"))


def _root_failure(running: list[_Running]) -> _Running | None:
    """The worker that failed first in cause: one that did not merely lose a peer (``PeerLost``)."""
    failed = [r for r in running if r.process.poll() not in (None, 0)]
    for r in failed:
        r.reader.join(timeout=0.5)  # its last line read to the end of its stderr
    return next((r for r in failed if not r.last_line.endswith(PeerLost.MESSAGE)), failed[0] if failed else None)


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(process.pid, sig)  # the worker and its reader processes (each worker leads its own group)
    except (ProcessLookupError, PermissionError):
        pass


def _stop(running: list[_Running], sig: int, grace_s: float) -> None:
    """Send ``sig`` to every worker still running, wait up to ``grace_s``, then SIGKILL and reap them all."""
    for r in running:
        if r.process.poll() is None:
            _signal_group(r.process, sig)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(r.process.poll() is None for r in running):
        time.sleep(POLL_S / 2)
    for r in running:
        _signal_group(r.process, signal.SIGKILL)  # the leader may be gone while its readers live on
        r.process.wait()


def _how(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


def _start(plan: PerNodePlan, worker: Worker, command: Sequence[str], env: dict | None, echo) -> "_Running":
    """Worker ``worker`` started with its TF_CONFIG, in its own session (a terminal's Ctrl-C reaches the launcher,
    which forwards it), its stderr read by a thread (the chief's echoed)."""
    process = subprocess.Popen(
        list(command), env={**(os.environ if env is None else env), "TF_CONFIG": plan.tf_config(worker.index)},
        stdout=None if worker.index == 0 else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True)
    r = _Running(worker, process)
    r.reader = threading.Thread(target=_read_stderr, args=(r, echo if worker.index == 0 else None), daemon=True)
    r.reader.start()
    return r


def _fail(plan: PerNodePlan, running: list["_Running"], failed: "_Running", failure_grace_s: float) -> None:
    """A worker died: the others stopped, then ``WorkerFailed`` naming it and its last line.

    A worker that says its peer was lost is a consequence: the cause gets ``failure_grace_s`` to show.
    """
    if failed.last_line.endswith(PeerLost.MESSAGE):
        deadline = time.monotonic() + failure_grace_s
        while time.monotonic() < deadline and failed.last_line.endswith(PeerLost.MESSAGE):
            time.sleep(POLL_S / 2)
            failed = _root_failure(running)
    _stop(running, signal.SIGTERM, failure_grace_s)
    failed.reader.join(timeout=1.0)
    code = failed.process.returncode
    w = failed.worker
    raise WorkerFailed(f"per-node worker {w.index} (node {w.node_id}, pid {failed.process.pid}) {_how(code)}: "
                       f"{failed.last_line or 'no output'}; stopped the other {plan.num_workers - 1} worker(s).",
                       3 if code == 3 else 1)


def run_workers(plan: PerNodePlan, commands: Sequence[Sequence[str]], *, env: dict | None = None,
                echo=None, stop_grace_s: float = STOP_GRACE_S, failure_grace_s: float = FAILURE_GRACE_S,
                on_start=None) -> int:
    """Start the workers' ``commands`` and supervise them until all end.

    The chief's stdout is this process's; its stderr is echoed to ``echo``; the others' stdout is
    discarded and their last line of stderr kept for a failure's message.

    Args:
        plan: the workers; worker i runs ``commands[i]`` with ``TF_CONFIG`` = ``plan.tf_config(i)``.
        commands: one argv per worker.
        env: the workers' environment before TF_CONFIG (default: this process's).
        echo: where the chief's stderr goes (default ``sys.stderr``).
        stop_grace_s: after SIGTERM/SIGINT to this process (forwarded to every worker), how long
            they may take to checkpoint and exit before SIGKILL.
        failure_grace_s: after a worker died, how long the others get after SIGTERM before SIGKILL.
        on_start: called with the list of ``(Worker, Popen)`` once all are started (tests).

    Returns:
        0 when every worker exited 0; 128 + the signal when this process was signalled.

    Raises:
        WorkerFailed: a worker exited non-zero or by a signal; the others were stopped, none is left.
    """
    echo = sys.stderr if echo is None else echo
    received: list[int] = []
    in_main = threading.current_thread() is threading.main_thread()
    previous = {}
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda signum, frame: received.append(signum))
    running: list[_Running] = []
    try:
        for worker, command in zip(plan.workers, commands):
            running.append(_start(plan, worker, command, env, echo))
        if on_start is not None:
            on_start([(r.worker, r.process) for r in running])
        while True:
            if received:
                _stop(running, received[0], stop_grace_s)
                return 128 + received[0]
            failed = _root_failure(running)
            if failed is not None:
                _fail(plan, running, failed, failure_grace_s)
            if all(r.process.poll() == 0 for r in running):
                return 0
            time.sleep(POLL_S)
    finally:
        _stop(running, signal.SIGKILL, 0.0)
        for r in running:
            if r.reader is not None:
                r.reader.join(timeout=1.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_per_node(plan: PerNodePlan, config: ExperimentConfig, run_dir: str | os.PathLike, *, resume: bool = False,
                 flags: Sequence[str] = (), env: dict | None = None, **supervise) -> int:
    """Train with one worker per planned node: ``python -m bigmem train --config WORKER.json``.

    Each worker gets the resolved config as JSON (``worker_config``: the job's, with the strategy
    multiworker and the worker's own placement), never flag strings, so it trains exactly what
    the launcher planned.

    Args:
        plan: the workers (``plan_workers``).
        config: the resolved job (``bigmem train``'s flags, or the resumed run's config.json).
        run_dir: the run directory, written by the chief (worker 0) only.
        resume: continue the run from its newest checkpoint (every worker from the same one).
        flags: flags that are not settings, for every worker (``--force``, ``--verbose``).
        env: the workers' environment (default: this process's).
        **supervise: ``run_workers``'s keyword arguments.

    Returns:
        0, or 128 + the signal that stopped the run.

    Raises:
        WorkerFailed: as ``run_workers``.
    """
    with tempfile.TemporaryDirectory(prefix="bigmem-per-node-") as scratch:
        dirs = worker_dirs(plan, Path(run_dir), resume=resume, scratch=Path(scratch))
        commands = []
        for worker, out in zip(plan.workers, dirs):
            path = Path(scratch) / f"worker-{worker.index}.json"
            atomic_write_json(path, worker_config(config, worker).to_dict())
            commands.append([sys.executable, "-m", "bigmem", "train", "--config", str(path), "--out", str(out),
                             *(["--resume"] if resume else []), *flags])
        return run_workers(plan, commands, env=env, **supervise)
