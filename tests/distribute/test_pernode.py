"""--strategy per-node: one worker per NUMA node (fake 2- and 4-node machines), and on loopback here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from bigmem.distribute.pernode import (PerNodePlan, Worker, WorkerFailed, check_node_memory, plan_workers, run_workers,
                                       worker_dirs)
from bigmem.errors import PeerLost
from bigmem.errors import InsufficientMemoryError, UsageError
from bigmem.numa.topology import NUMANode, NUMATopology
from bigmem.rundir import read_jsonl
from helpers import make_sysfs, run_cli

COMMON = ["--model", "tiny", "--volume", "16", "--seed", "2", "--optimizer", "sgd", "--reference-batch", "2",
          "--batch-size", "1"]


@pytest.fixture
def two_node(tmp_path):
    """2 x 4 CPUs, 64 GiB each; node 1 has 1 GiB free."""
    return NUMATopology.from_sysfs(make_sysfs(tmp_path, [("0-3", 64, 60), ("4-7", 64, 1)], [[10, 21], [21, 10]]))


@pytest.fixture
def four_node(tmp_path):
    """Nodes 0 and 2 with CPUs; 1 and 3 memory-only (as CXL expanders appear)."""
    return NUMATopology.from_sysfs(make_sysfs(
        tmp_path, [("0-1", 8, 6), ("", 8, 8), ("2-3", 8, 6), ("", 8, 8)],
        [[10, 21, 21, 21], [21, 10, 21, 21], [21, 21, 10, 21], [21, 21, 21, 10]]))


def test_one_worker_per_node_bound_to_it(two_node):
    plan = plan_workers(two_node, allowed_cpus=set(range(8)))
    assert [(w.index, w.node_id, w.cpus) for w in plan.workers] == [(0, 0, (0, 1, 2, 3)), (1, 1, (4, 5, 6, 7))]
    assert [w.placement() for w in plan.workers] == [{"policy": "bind:0"}, {"policy": "bind:1"}]
    ports = [int(w.address.split(":")[1]) for w in plan.workers]
    assert len(set(ports)) == 2
    assert all(w.address.startswith("127.0.0.1:") for w in plan.workers)
    for index in range(2):
        config = json.loads(plan.tf_config(index))
        assert config == {"cluster": {"worker": [w.address for w in plan.workers]},
                          "task": {"type": "worker", "index": index}}
    assert plan.global_batch(3) == 6
    assert plan.notes() == []


def test_memory_only_nodes_get_no_worker(four_node):
    plan = plan_workers(four_node, allowed_cpus=set(range(4)), ports=[1001, 1002])
    assert [(w.node_id, w.cpus, w.address) for w in plan.workers] == [(0, (0, 1), "127.0.0.1:1001"),
                                                                       (2, (2, 3), "127.0.0.1:1002")]
    assert plan.memory_only_nodes == (1, 3)
    assert plan.notes() == ["note: node(s) 1,3 have memory but no CPUs: no worker runs there (each worker's "
                            "memory stays on its own node)"]
    assert "global batch 4 (2 x --batch-size 2)" in plan.describe(2)


def test_a_node_outside_the_affinity_counts_as_memory_only(two_node):
    plan = plan_workers(two_node, allowed_cpus={4, 5})
    assert [w.node_id for w in plan.workers] == [1]
    assert plan.memory_only_nodes == (0,)
    with pytest.raises(UsageError, match="no NUMA node with CPUs"):
        plan_workers(two_node, allowed_cpus={99})


def test_workers_per_node_split_the_node_cpus(two_node):
    plan = plan_workers(two_node, workers_per_node=2, allowed_cpus=set(range(8)))
    assert [(w.node_id, w.cpus) for w in plan.workers] == [(0, (0, 1)), (0, (2, 3)), (1, (4, 5)), (1, (6, 7))]
    assert plan.workers[1].placement() == {"policy": "bind:0", "cpus": "2-3"}
    assert len({w.address for w in plan.workers}) == 4
    with pytest.raises(UsageError, match=r"node 0 has 4 CPU\(s\).*Try train_per_node\.workers_per_node 4"):
        plan_workers(two_node, workers_per_node=5, allowed_cpus=set(range(8)))
    with pytest.raises(UsageError, match=r"Invalid train_per_node\.workers_per_node 0"):
        plan_workers(two_node, workers_per_node=0)


def test_refused_when_a_node_cannot_hold_its_worker(two_node):
    plan = plan_workers(two_node, allowed_cpus=set(range(8)))
    check_node_memory(plan, two_node, 2**30 // 2)  # 0.5 GiB fits both nodes
    with pytest.raises(InsufficientMemoryError, match=r"node 1 cannot hold its worker.*node 1: 1.00 GiB free") as exc:
        check_node_memory(plan, two_node, 2 * 2**30)
    assert exc.value.exit_code == 3
    assert exc.value.required_bytes == 2 * 2**30
    split = plan_workers(two_node, workers_per_node=2, allowed_cpus=set(range(8)))
    with pytest.raises(InsufficientMemoryError, match="node 0 cannot hold its 2 workers"):
        check_node_memory(split, two_node, 31 * 2**30)  # 62 GiB on node 0's 60 free


def test_cli_refuses_before_launching(tiny_store, tmp_path):
    """The CLI's pre-flight (the job's own estimate) against the fake node 1's 1 GiB: exit 3, nothing started."""
    from bigmem.cli.main import build_parser
    from bigmem.cli.train import run_per_node

    args = build_parser().parse_args(["train", *COMMON, "--batch-size", "2", "--data", str(tiny_store),
                                      "--strategy", "per-node", "--steps", "1", "--out", str(tmp_path / "run")])
    tight = NUMATopology((NUMANode(0, (0,), 64 * 2**30, 60 * 2**30, (10, 21)),  # on this machine's CPUs 0 and 1
                          NUMANode(1, (1,), 64 * 2**30, 2**20, (21, 10))), "fake")
    with pytest.raises(InsufficientMemoryError, match="per-node: node 1 cannot hold its worker") as exc:
        run_per_node(args, topology=tight)
    assert exc.value.exit_code == 3
    assert not (tmp_path / "run").exists()


def test_cli_refuses_numa_flags(capsys):
    code, _, err = run_cli(["train", "--strategy", "per-node", "--numa", "bind:0"], capsys)
    assert code == 2
    assert "leave out --numa and --cpus" in err
    code, _, err = run_cli(["train", "--workers-per-node", "2"], capsys)
    assert code == 2
    assert "--workers-per-node is for --strategy per-node" in err


def test_in_process_per_node_strategy_is_refused():
    from bigmem.config.presets import resolve_config
    from bigmem.distribute.strategy import setup_replicas

    config = resolve_config("tiny", {"distribute": {"strategy": "per-node"}})
    with pytest.raises(UsageError, match="starts one process per NUMA node"):
        setup_replicas(config)


def test_resume_seeds_other_workers_from_the_chief(tmp_path):
    plan = PerNodePlan((Worker(0, 0, (0,), "127.0.0.1:1"), Worker(1, 0, (1,), "127.0.0.1:2")))
    run = tmp_path / "run"
    (run / "checkpoints" / "ckpt-3").mkdir(parents=True)
    (run / "tensorboard").mkdir()
    (run / "config.json").write_text("{}")
    dirs = worker_dirs(plan, run, resume=True, scratch=tmp_path / "scratch")
    assert dirs[0] == run
    assert (dirs[1] / "checkpoints" / "ckpt-3").is_dir()
    assert (dirs[1] / "config.json").exists()
    assert not (dirs[1] / "tensorboard").exists()
    assert not worker_dirs(plan, run, resume=False, scratch=tmp_path / "fresh")[1].exists()


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def test_a_dead_worker_stops_the_others(tmp_path):
    """Plain processes stand in for workers: one dies, the other (and its child) is gone within seconds."""
    plan = PerNodePlan((Worker(0, 0, (0,), "127.0.0.1:1"), Worker(1, 0, (1,), "127.0.0.1:2")))
    sleeper = [sys.executable, "-c", "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
               "'import time; time.sleep(600)']); time.sleep(600)"]
    dies = [sys.executable, "-c", "import sys, time; time.sleep(1); print('out of disk', file=sys.stderr); "
            "sys.exit(7)"]
    started = []
    begun = time.monotonic()
    with pytest.raises(Exception, match=r"per-node worker 1 \(node 0, pid \d+\) exited with code 7: out of disk; "
                                        r"stopped the other 1 worker\(s\)") as exc:
        run_workers(plan, [sleeper, dies], on_start=started.extend, failure_grace_s=1.0)
    assert exc.value.exit_code == 1
    assert time.monotonic() - begun < 10
    assert _alive([p.pid for _, p in started]) == []
    descendants = [p for p in psutil.process_iter(["cmdline"]) if "time.sleep(600)" in " ".join(p.info["cmdline"]
                                                                                                   or [])]
    assert _alive([p.pid for p in descendants]) == []


def _launch(tmp_path, store, *extra, **popen):
    """The per-node launcher with two workers on this host's one node.

    ``--force`` skips the launcher's pre-flight, which imports TensorFlow and builds the network
    before any worker starts (test_cli_refuses_before_launching proves that check); each worker
    still plans its memory, and the tiny job fits, so --force changes nothing they do.
    TF_GRPC_WORKER_CACHE_QUEUES (passed on to the workers): TensorFlow's gRPC client polls 64
    completion queues by default, a thread each, and each numa.json write reads every thread's
    numa_maps (numa/observe.thread_policies), seconds per write here; two loopback workers need few.
    """
    return subprocess.Popen([sys.executable, "-m", "bigmem", "train", *COMMON, "--data", str(store),
                             "--strategy", "per-node", "--workers-per-node", "2", "--out", str(tmp_path / "run"),
                             "--force", *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "TF_GRPC_WORKER_CACHE_QUEUES": "4"}, **popen)


@pytest.mark.slow
def test_two_workers_match_one_process_and_resume(tmp_path, tiny_store):
    """Two workers of batch 1 on this host = one process of batch 2, step by step; --resume continues."""
    launcher = _launch(tmp_path, tiny_store, "--steps", "3")
    out, err = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, err
    assert "per-node: 2 workers, global batch 2 (2 x --batch-size 1)" in out
    single = subprocess.run([sys.executable, "-m", "bigmem", "train", *COMMON, "--batch-size", "2", "--steps", "3",
                             "--data", str(tiny_store), "--out", str(tmp_path / "one")], capture_output=True, text=True)
    assert single.returncode == 0, single.stderr
    one = [r["loss"] for r in read_jsonl(tmp_path / "one" / "metrics.jsonl")]
    losses = [r["loss"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")]
    assert len(losses) == 3
    assert losses == pytest.approx(one, rel=1e-5)
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())["data_parallel"]
    assert (plan["workers"], plan["worker_index"], plan["global_batch"]) == (2, 0, 2)
    assert json.loads((tmp_path / "run" / "numa.json").read_text())["requested"]["text"] == "bind:0"

    # One step more is enough to continue from the checkpoint (a second would only cost each worker
    # another numa.json read of all its threads).
    resumed = _launch(tmp_path, tiny_store, "--steps", "4", "--resume")
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err
    rows = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["loss"] for r in rows[:3]] == losses  # the first three kept; step 4 from the checkpoint
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 4


@pytest.mark.slow
def test_killing_a_worker_stops_the_run(tmp_path, tiny_store):
    launcher = _launch(tmp_path, tiny_store, "--steps", "100000", start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (tmp_path / "run" / "metrics.jsonl").exists():  # the chief trains: every worker is past setup
            assert launcher.poll() is None, launcher.communicate()[1]
            assert time.monotonic() < deadline, launcher.communicate()[1]
            time.sleep(0.5)
        children = psutil.Process(launcher.pid).children(recursive=True)
        workers = [p for p in children if "TF_CONFIG" in p.environ()]
        worker1 = next(p for p in workers if json.loads(p.environ()["TF_CONFIG"])["task"]["index"] == 1)
        worker1.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        _, err = launcher.communicate(timeout=60)
        assert time.monotonic() - killed < 15
        assert launcher.returncode == 1
        # one line, and nothing else but the launcher's notes: no TensorFlow log of the broken collective
        others = [line for line in err.strip().splitlines() if not line.startswith("bigmem train: note:")]
        assert len(others) == 1, err
        [line] = others
        assert line.startswith(
            f"bigmem train: error: per-node worker 1 (node 0, pid {worker1.pid}) was killed by SIGKILL")
        assert _alive([p.pid for p in children]) == []
    finally:
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()


def test_the_worker_that_died_is_named_not_the_one_that_lost_its_peer():
    """The chief fails first, saying its collective was aborted; the launcher names the worker that caused it."""
    import io

    plan = PerNodePlan((Worker(0, 0, (0,), "127.0.0.1:1"), Worker(1, 0, (1,), "127.0.0.1:2")))
    lost = [sys.executable, "-c", f"import sys; print('step 1'); print({'bigmem train: error: ' + PeerLost.MESSAGE!r}, "
            "file=sys.stderr); sys.exit(1)"]
    killed = [sys.executable, "-c", "import os, signal, time; time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)"]
    echo = io.StringIO()
    with pytest.raises(WorkerFailed, match=r"per-node worker 1 \(node 0, pid \d+\) was killed by SIGKILL"):
        run_workers(plan, [lost, killed], echo=echo, failure_grace_s=5.0)
    assert "bigmem train: error:" not in echo.getvalue()


def test_sigterm_to_the_launcher_reaches_every_worker():
    """SIGTERM to the launcher is forwarded; each worker exits on it (as the trainer does after its step)."""
    import threading

    plan = PerNodePlan((Worker(0, 0, (0,), "127.0.0.1:1"), Worker(1, 0, (1,), "127.0.0.1:2")))
    sleeper = [sys.executable, "-c", "import signal, sys, time; "
               "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143)); time.sleep(600)"]
    started = []
    threading.Timer(2.0, os.kill, (os.getpid(), signal.SIGTERM)).start()
    begun = time.monotonic()
    assert run_workers(plan, [sleeper, sleeper], on_start=started.extend, stop_grace_s=10.0) == 128 + signal.SIGTERM
    assert time.monotonic() - begun < 10
    assert [p.returncode for _, p in started] == [143, 143]
    assert signal.getsignal(signal.SIGTERM) is not None
    assert _alive([p.pid for _, p in started]) == []
