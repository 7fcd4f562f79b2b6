"""``bigmem compare``'s API: the big-memory CPU path against the data-parallel GPU baseline.

Both paths train the same model on the same data for the same budget, each as a real
``bigmem train`` run in its own process (its own peak memory; simulated devices stay in that
process). Then both models are evaluated on held-out whole volumes, and the planner says how
large a whole volume each path could train: host RAM against one GPU's memory.
"""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np

from bigmem.config.schema import ExperimentConfig
from bigmem.errors import BigmemError, UsageError
from bigmem.rundir import RunDir, atomic_write_json, atomic_write_text
from bigmem.units import format_bytes

PATHS = ("cpu_bigmem", "data_parallel")


def _run_train(argv: list[str], out: Path) -> dict:
    result = subprocess.run([sys.executable, "-m", "bigmem", "train", *argv, "--out", str(out)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        tail = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise BigmemError(f"The {out.name} run failed (exit {result.returncode}): {tail}")
    run = RunDir(out)
    rows, summary, config, plan = run.read_metrics(), run.read_summary(), run.read_config(), run.read_plan()
    steady = rows[1:] or rows  # the first step includes tracing
    step_s = float(np.median([r["step_s"] for r in steady]))
    batch = plan["data_parallel"]["global_batch"] if plan.get("data_parallel") else config["train"]["batch_size"]
    return {"run_dir": str(out), "steps": summary["steps"], "step_s": step_s,
            "voxels_per_s": float(np.median([r["voxels_per_s"] for r in steady])),
            "samples_per_s": batch / step_s, "peak_host_bytes": summary["peak_rss_bytes"],
            "train_s": summary["train_s"], "final_train_dice": summary["dice"], "config": config, "plan": plan,
            "curve": [{"time_s": float(np.sum([r["step_s"] for r in rows[:i + 1]])), "dice": r["dice"]}
                      for i, r in enumerate(rows)]}


def evaluate(model_path: Path, store_path: str, case_ids: list[str], volume: int) -> float:
    """Mean foreground Dice of the model on whole held-out volumes (crop/pad to ``volume``).

    Args:
        model_path: a saved Keras model (a run's ``model.keras``).
        store_path: the store holding the cases.
        case_ids: the held-out cases.
        volume: the cube edge in voxels each case is cropped/padded to.

    Returns:
        The mean over cases of the mean Dice over the foreground classes (a class absent from
        both prediction and label counts 1).
    """
    import keras

    import bigmem.nets.unet3d  # noqa: F401  (registers UNet3D for loading)
    from bigmem.data.pipeline import fit_to_volume, normalize
    from bigmem.data.store import HDF5VolumeStore

    model = keras.models.load_model(model_path)
    store = HDF5VolumeStore(store_path)
    scores = []
    for case_id in case_ids:
        image, label = store.read_case(case_id)
        image, label = fit_to_volume(normalize(image, case_id), label, volume, np.random.default_rng(0))
        predicted = np.argmax(np.asarray(model(image[np.newaxis], training=False))[0], axis=-1)
        dice = []
        for cls in range(1, store.num_classes):
            p, t = predicted == cls, label == cls
            total = p.sum() + t.sum()
            dice.append(1.0 if total == 0 else 2.0 * np.logical_and(p, t).sum() / total)
        scores.append(float(np.mean(dice)))
    store.close()
    return float(np.mean(scores))


def largest_whole_volumes(config: ExperimentConfig, gpu_memory_bytes: int,
                          memory_budget_bytes: int | None = None) -> dict:
    """From the planner: the largest whole volume (batch 1) on one GPU and in this host's RAM.

    Args:
        config: the compared model.
        gpu_memory_bytes: one GPU's memory.
        memory_budget_bytes: the host's budget (``--memory-budget``); default as
            ``memory.preflight.resolve_budget`` decides without one (this process runs no placement:
            MemAvailable).

    Returns:
        ``{gpu, host, host_mode, host_budget_bytes}``: edges (None when none fits), the host's mode.
    """
    from bigmem.distribute.planning import largest_edge
    from bigmem.memory.preflight import resolve_budget, search_plan
    from bigmem.memory.profile import counts_function

    counts_for = counts_function(config)
    host = search_plan(config, counts_for, resolve_budget(memory_budget_bytes), batch_size=1)
    gpu = largest_edge(config, counts_for, gpu_memory_bytes, 1, 4096)
    return {"gpu": gpu, "host": host.chosen.volume if host.chosen else None,
            "host_mode": (f"{host.chosen.precision}, recompute {host.chosen.recompute}" if host.chosen else None),
            "host_budget_bytes": host.budget_bytes}


def compare(config: ExperimentConfig, out: Path, *, replicas: int, simulate: bool, gpu_memory_bytes: int,
            steps: int | None, time_budget_s: float | None, common: list[str], progress=print,
            memory_budget_bytes: int | None = None) -> dict:
    """Train the big-memory CPU path and the data-parallel baseline alike, then compare them.

    Each path is a ``bigmem train`` run in its own process under ``out`` (``cpu_bigmem/``: whole
    volumes; ``data_parallel/``: the mirrored strategy on patches). Both are evaluated on the
    store's held-out whole volumes, and the planner gives the largest whole volume each could
    train. Writes ``compare.json``, ``compare.md`` and ``compare.png`` to ``out``.

    Args:
        config: the compared configuration (for the planner's largest volumes).
        out: the output folder (created).
        replicas: data-parallel replicas (GPUs, or simulated CPU devices).
        simulate: simulate the replicas as logical CPU devices instead of using GPUs.
        gpu_memory_bytes: one GPU's memory, for the patch size and the largest whole volume.
        steps: training steps of each run, when ``time_budget_s`` is None.
        time_budget_s: seconds of training for each run instead of a step count.
        common: ``bigmem train`` flags both runs share (model, data, seed, ...).
        progress: called with one line per phase (default ``print``).
        memory_budget_bytes: the host's budget for the largest whole volume (default: as
            ``memory.preflight.resolve_budget`` decides without one).

    Returns:
        The report (``compare.json``): ``simulated``, ``replicas``, ``gpu_memory_bytes``,
        ``model``, ``volume``, ``held_out_cases``, ``patch_size`` and ``paths``: for each of
        ``cpu_bigmem`` and ``data_parallel``, throughput (``voxels_per_s``, ``samples_per_s``,
        ``step_s``), ``peak_host_bytes``, ``train_s``, ``steps``, Dice (``final_train_dice``,
        held-out ``dice``), ``max_whole_volume`` (edge in voxels), the training ``curve`` and
        ``run_dir``.

    Raises:
        UsageError: ``replicas`` < 1, or neither a positive ``steps`` nor a positive, finite
            ``time_budget_s``.
        BigmemError: a training run failed (the message ends with its last line of stderr).

    Example:
        >>> report = compare(config, Path("cmp"), replicas=2, simulate=True, gpu_memory_bytes=16 * 2**30,
        ...                  steps=20, time_budget_s=None, common=["--model", "tiny", "--holdout", "2"])
    """
    if replicas < 1:
        raise UsageError(f"Invalid replicas {replicas}: expected at least 1 data-parallel replica.")
    if time_budget_s is not None and not 0 < time_budget_s < math.inf:
        raise UsageError(f"Invalid time_budget_s {time_budget_s:g}: expected a positive, finite number of seconds.")
    if time_budget_s is None and (steps is None or steps < 1):
        raise UsageError(f"Invalid steps {steps}: expected a positive number of steps (or a time_budget_s).")
    out.mkdir(parents=True, exist_ok=True)
    budget = ["--time-budget", str(time_budget_s), "--steps", "1000000"] if time_budget_s else ["--steps", str(steps)]
    base = [*common, *budget, "--checkpoint-every", "1000000"]
    progress("training the big-memory path (whole volumes) ...")
    cpu = _run_train(base, out / "cpu_bigmem")
    progress(f"training the data-parallel path ({replicas} {'simulated replicas' if simulate else 'GPUs'}) ...")
    dp_flags = ["--strategy", "mirrored", "--gpu-memory", str(gpu_memory_bytes),
                "--simulate-replicas" if simulate else "--gpus", str(replicas)]
    dp = _run_train([*base, *dp_flags], out / "data_parallel")
    store = cpu["config"]["data"]["store"]
    held_out = _held_out(store, cpu["config"]["data"]["holdout"])
    volume = cpu["config"]["data"]["volume"]
    progress(f"evaluating both on {len(held_out)} held-out whole volumes ...")
    volumes = largest_whole_volumes(config, gpu_memory_bytes, memory_budget_bytes)
    report = {"simulated": simulate, "replicas": replicas, "gpu_memory_bytes": gpu_memory_bytes,
              "model": config.model.name, "volume": volume, "held_out_cases": held_out,
              "patch_size": dp["plan"]["data_parallel"]["patch"], "paths": {}}
    for name, run in (("cpu_bigmem", cpu), ("data_parallel", dp)):
        report["paths"][name] = {
            **{k: run[k] for k in ("steps", "step_s", "voxels_per_s", "samples_per_s", "peak_host_bytes", "train_s",
                                   "final_train_dice", "run_dir", "curve")},
            "max_whole_volume": volumes["host"] if name == "cpu_bigmem" else volumes["gpu"],
            "dice": evaluate(RunDir(run["run_dir"]).model, store, held_out, volume),
        }
    report["paths"]["cpu_bigmem"]["max_whole_volume_mode"] = volumes["host_mode"]
    report["paths"]["data_parallel"]["peak_device_bytes"] = None if simulate else "not measured"
    atomic_write_json(out / "compare.json", report)
    atomic_write_text(out / "compare.md", markdown(report))
    plot(report, out / "compare.png")
    return report


def _held_out(store_path: str, holdout: int) -> list[str]:
    from bigmem.data.store import HDF5VolumeStore

    with HDF5VolumeStore(store_path, holdout=holdout) as store:
        return list(store.held_out)


def rows(report: dict) -> list[tuple[str, str, str]]:
    """The comparison table of ``report``: (quantity, big-memory CPU, data parallel), formatted."""
    cpu, dp = report["paths"]["cpu_bigmem"], report["paths"]["data_parallel"]
    return [
        ("voxels/s", f"{cpu['voxels_per_s'] / 1e6:.2f} M", f"{dp['voxels_per_s'] / 1e6:.2f} M"),
        ("samples/s", f"{cpu['samples_per_s']:.2f}", f"{dp['samples_per_s']:.2f}"),
        ("time per step", f"{cpu['step_s']:.3f} s", f"{dp['step_s']:.3f} s"),
        ("training input", f"whole {report['volume']}^3 volumes", f"{report['patch_size']}^3 patches"),
        ("peak host memory", format_bytes(cpu["peak_host_bytes"]), format_bytes(dp["peak_host_bytes"])),
        ("largest whole volume (planner)", f"{cpu['max_whole_volume']}^3 ({cpu['max_whole_volume_mode']})",
         f"{dp['max_whole_volume']}^3 per GPU ({format_bytes(report['gpu_memory_bytes'])})"
         if dp["max_whole_volume"] else "none fits"),
        ("held-out whole-volume Dice", f"{cpu['dice']:.3f}", f"{dp['dice']:.3f}"),
        ("steps in the budget", str(cpu["steps"]), str(dp["steps"])),
    ]


def markdown(report: dict) -> str:
    """``compare.md``: what was compared (SIMULATED when it was) and the ``rows`` table."""
    where = (f"{report['replicas']} logical CPU devices — SIMULATED ON CPU, not a GPU result" if report["simulated"]
             else f"{report['replicas']} GPUs")
    lines = [f"# bigmem compare: {report['model']}", "",
             f"Data-parallel path: {where}. Held-out cases: {', '.join(report['held_out_cases'])}.", "",
             "| | big-memory CPU (bigmem) | data parallel |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows(report)]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Write ``compare.png`` to ``path`` (atomically): throughput, peak host memory, Dice over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cpu, dp = report["paths"]["cpu_bigmem"], report["paths"]["data_parallel"]
    names = ["big-memory CPU", "data parallel" + (" (simulated)" if report["simulated"] else "")]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(names, [cpu["voxels_per_s"] / 1e6, dp["voxels_per_s"] / 1e6], color=["tab:blue", "tab:orange"])
    axes[0].set_ylabel("Mvoxels / s")
    axes[0].set_title("throughput")
    peaks = [cpu["peak_host_bytes"] / 2**30, dp["peak_host_bytes"] / 2**30]
    axes[1].bar(names, peaks, color=["tab:blue", "tab:orange"])
    axes[1].set_ylabel("GiB")
    axes[1].set_title("peak host memory")
    for run, name, color in ((cpu, names[0], "tab:blue"), (dp, names[1], "tab:orange")):
        axes[2].plot([p["time_s"] for p in run["curve"]], [p["dice"] for p in run["curve"]], label=name, color=color)
        axes[2].axhline(run["dice"], color=color, linestyle="--", linewidth=1)
    axes[2].set_xlabel("training time (s)")
    axes[2].set_ylabel("Dice")
    axes[2].set_title("training Dice vs time (dashed: held-out)")
    axes[2].legend()
    fig.suptitle(f"bigmem compare: {report['model']}" + (" — data parallel SIMULATED ON CPU" if report["simulated"]
                                                          else ""))
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)
