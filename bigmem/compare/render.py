"""``bigmem compare``'s report as people read it: the table, compare.md and compare.png."""

from __future__ import annotations

from pathlib import Path

from bigmem.atomic import atomic_output
from bigmem.compare.run import LABELS, PATHS
from bigmem.units import as_shape, format_bytes, format_shape


def _patch_text(patch) -> str:
    """A report's patch: an edge (reports written before patches took the dataset's aspect) or a shape."""
    return format_shape(as_shape(patch))


def _dice_text(path: dict) -> str:
    spread = f" ± {path['dice_std']:.3f}" if path["dice_std"] is not None else ""
    return f"{path['dice']:.3f}{spread}"


def _number(value, digits: int = 3, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def _flops(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP" if value >= 1e12 else f"{value / 1e9:.2f} GFLOP"


def rows(report: dict) -> list[tuple[str, str, str]]:
    """The comparison table of ``report``: (quantity, whole volumes, data parallel), formatted."""
    cpu, dp = report["paths"]["cpu_bigmem"], report["paths"]["data_parallel"]
    seeds = report["seeds"]
    table = [
        ("training input", (f"whole volumes at their own shapes (up to {format_shape(report['shape'])})"
                            if report.get("native_shapes") else
                            f"whole {format_shape(report.get('shape') or [report['volume']] * 3)} volumes")
         + f", batch {report['batch']['cpu_bigmem']}",
         f"{_patch_text(report['patch_size'])} patches, global batch {report['batch']['data_parallel']}"),
        ("held-out Dice" + (f" (mean ± sd, {seeds} seeds)" if seeds > 1 else ""), _dice_text(cpu), _dice_text(dp)),
    ]
    for c in cpu["per_class"]:
        table.append((f"  class {c}: Dice / HD95",
                      f"{_number(cpu['per_class'][c]['dice'])} / {_number(cpu['per_class'][c]['hd95_mm'], 1, ' mm')}",
                      f"{_number(dp['per_class'][c]['dice'])} / {_number(dp['per_class'][c]['hd95_mm'], 1, ' mm')}"))
    table += [
        ("inference", f"{cpu['inference_mode']}, {cpu['inference_s_per_case']:.2f} s/case",
         f"{dp['inference_mode']}, {dp['inference_s_per_case']:.2f} s/case"),
        ("training time / steps", f"{cpu['train_s']:.0f} s / {cpu['steps']:.0f}",
         f"{dp['train_s']:.0f} s / {dp['steps']:.0f}"),
        ("training FLOPs", _flops(cpu["train_flops"]), _flops(dp["train_flops"])),
        ("voxels/s, time per step", f"{cpu['voxels_per_s'] / 1e6:.2f} M, {cpu['step_s']:.3f} s",
         f"{dp['voxels_per_s'] / 1e6:.2f} M, {dp['step_s']:.3f} s"),
        ("peak host memory", format_bytes(cpu["peak_host_bytes"]), format_bytes(dp["peak_host_bytes"])),
        ("largest whole volume (planner)", f"{cpu['max_whole_volume']}^3 ({cpu['max_whole_volume_mode']})",
         f"{dp['max_whole_volume']}^3 per GPU ({format_bytes(report['gpu_memory_bytes'])})"
         if dp["max_whole_volume"] else "none fits"),
    ]
    return table


def markdown(report: dict) -> str:
    """``compare.md``: what was compared (SIMULATED when it was), the ``rows`` table and the conclusion."""
    where = (f"{report['replicas']} logical CPU devices — SIMULATED ON CPU, not a GPU result" if report["simulated"]
             else f"{report['replicas']} GPUs")
    memory = (f"GPU memory: {report['gpu_memory_stand_in']}." if report["gpu_memory_stand_in"]
              else f"GPU memory: {format_bytes(report['gpu_memory_bytes'])}.")
    lines = [f"# bigmem compare: {report['model']}", "",
             f"Data-parallel path: {where}. {memory} Budget: {report['budget']}. "
             f"Held-out cases: {', '.join(report['held_out_cases'])}.", "",
             "| | whole volumes in RAM (bigmem) | GPU data parallel on patches |", "|---|---|---|"]
    lines += [f"| {a.strip()} | {b} | {c} |" for a, b, c in rows(report)]
    lines += ["", f"**Conclusion:** {report['conclusion']['text']}"]
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    """Write ``compare.png`` (atomically): held-out Dice against training time, per-class Dice, inference time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"cpu_bigmem": "tab:blue", "data_parallel": "tab:orange"}
    names = {name: LABELS[name] + (" (simulated)" if report["simulated"] and name == "data_parallel" else "")
             for name in PATHS}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in PATHS:
        for index, run in enumerate(report["paths"][name]["runs"]):
            points = [(p["time_s"], p["val_dice"]) for p in run["curve"] if "val_dice" in p]
            if points:
                axes[0].plot(*zip(*points), marker="o", markersize=3, color=colors[name], alpha=0.8,
                             label=names[name] if index == 0 else None)
            axes[0].plot([run["train_s"]], [run["held_out"]["dice"]], marker="*", markersize=12, color=colors[name],
                         markeredgecolor="black", label="final model (predict + evaluate)" if index == 0 and
                         name == "data_parallel" else None)
    axes[0].set_xlabel("training time (s, validation not counted)")
    axes[0].set_ylabel("held-out Dice")
    axes[0].set_title("time to Dice")
    axes[0].legend(fontsize=8)
    classes = list(report["paths"]["cpu_bigmem"]["per_class"])
    width = 0.38
    for offset, name in ((-width / 2, "cpu_bigmem"), (width / 2, "data_parallel")):
        per_class = report["paths"][name]["per_class"]
        axes[1].bar([i + offset for i in range(len(classes))], [per_class[c]["dice"] or 0 for c in classes], width,
                    color=colors[name], label=names[name])
    axes[1].set_xticks(range(len(classes)), [f"class {c}" for c in classes])
    axes[1].set_ylim(0, 1.2)  # room above the bars for the legend
    axes[1].set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axes[1].set_ylabel("held-out Dice (final model)")
    axes[1].set_title("per class")
    axes[1].legend(fontsize=8)
    times = [report["paths"][name]["inference_s_per_case"] for name in PATHS]
    axes[2].bar([report["paths"][name]["inference_mode"] for name in PATHS], times,
                color=[colors[name] for name in PATHS])
    axes[2].set_ylabel("seconds per case")
    axes[2].set_title("inference")
    fig.suptitle(f"bigmem compare: {report['model']}, {report['budget']}"
                 + (" — data parallel SIMULATED ON CPU" if report["simulated"] else ""), fontsize=10)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
