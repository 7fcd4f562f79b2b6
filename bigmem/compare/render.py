"""``bigmem compare``'s report as people read it: the table (printed and in compare.md) and compare.png."""

from __future__ import annotations

from pathlib import Path

from bigmem.atomic import atomic_output
from bigmem.compare.gpu_reference import GpuReference
from bigmem.compare.report import LABELS, PATHS, ClassScore, CompareReport, PathResult
from bigmem.units import format_bytes, format_shape


def _dice_text(path: PathResult) -> str:
    spread = f" ± {path.dice_std:.3f}" if path.dice_std is not None else ""
    return f"{path.dice:.3f}{spread}"


def _number(value, digits: int = 3, unit: str = "") -> str:
    return "n/a" if value is None else f"{value:.{digits}f}{unit}"


def _score_text(score: ClassScore) -> str:
    return f"{_number(score.dice)} / {_number(score.hd95_mm, 1, ' mm')}"


def _flops(value: float) -> str:
    return f"{value / 1e12:.2f} TFLOP" if value >= 1e12 else f"{value / 1e9:.2f} GFLOP"


def rows(report: CompareReport) -> list[tuple[str, str, str]]:
    """The comparison table of ``report``.

    Args:
        report: the ``CompareReport``.

    Returns:
        ``(quantity, whole volumes, data parallel)`` per row, formatted; a class's row starts with two spaces.
    """
    cpu, dp = report.paths["cpu_bigmem"], report.paths["data_parallel"]
    seeds = report.seeds
    whole = (f"whole volumes at their own shapes (up to {format_shape(report.shape)})" if report.native_shapes
             else f"whole {format_shape(report.shape)} volumes")
    table = [
        ("training input", f"{whole}, batch {report.batch['cpu_bigmem']}",
         f"{format_shape(report.patch_size)} patches, global batch {report.batch['data_parallel']}"),
        ("held-out Dice" + (f" (mean ± sd, {seeds} seeds)" if seeds > 1 else ""), _dice_text(cpu), _dice_text(dp)),
    ]
    table += [(f"  class {c}: Dice / HD95", _score_text(cpu.per_class[c]), _score_text(dp.per_class[c]))
              for c in cpu.per_class]
    table += [
        ("inference", f"{cpu.inference_mode}, {cpu.inference_s_per_case:.2f} s/case",
         f"{dp.inference_mode}, {dp.inference_s_per_case:.2f} s/case"),
        ("training time / steps", f"{cpu.train_s:.0f} s / {cpu.steps:.0f}", f"{dp.train_s:.0f} s / {dp.steps:.0f}"),
        ("training FLOPs", _flops(cpu.train_flops), _flops(dp.train_flops)),
        ("voxels/s, time per step", f"{cpu.voxels_per_s / 1e6:.2f} M, {cpu.step_s:.3f} s",
         f"{dp.voxels_per_s / 1e6:.2f} M, {dp.step_s:.3f} s"),
        ("peak host memory", format_bytes(cpu.peak_host_bytes), format_bytes(dp.peak_host_bytes)),
        ("largest whole volume (planner)", f"{cpu.max_whole_volume}^3 ({cpu.max_whole_volume_mode})",
         f"{dp.max_whole_volume}^3 per GPU ({format_bytes(report.gpu_memory_bytes)})"
         if dp.max_whole_volume else "none fits"),
    ]
    if report.gpu_reference:
        table.append(("measured on a GPU (PyTorch)", "-", GpuReference.from_dict(report.gpu_reference).summary))
    return table


def provenance(report: CompareReport) -> str:
    """Which figures were measured on a GPU and which were simulated, in a sentence or two."""
    if not report.gpu_reference:
        return ("Nothing here was measured on a GPU: the data-parallel figures are from logical CPU devices."
                if report.simulated else "")
    reference = GpuReference.from_dict(report.gpu_reference)
    measured = reference.measured_sentence(report.patch_size[0] if len(set(report.patch_size)) == 1 else None)
    simulated = (" Simulated on CPU: the data-parallel run itself (its steps, times, host memory and Dice)."
                 if report.simulated else "")
    return f"{measured[0].upper()}{measured[1:]}; the patch and the GPU's memory above come from it.{simulated}"


def console_table(report: CompareReport):
    """The ``rows`` as the ``rich.table.Table`` ``bigmem compare`` prints, titled SIMULATED when it was."""
    from rich.table import Table

    table = Table(title="bigmem compare" + (" — data-parallel path SIMULATED ON CPU" if report.simulated else ""))
    # fold, not '…': a shape ('200x240x192') cut by a narrow terminal would lose its digits
    table.add_column("", overflow="fold")
    table.add_column(LABELS["cpu_bigmem"], overflow="fold")
    table.add_column(f"data parallel on patches ({report.replicas} "
                     f"{'simulated replicas' if report.simulated else 'GPUs'})", overflow="fold")
    for row in rows(report):
        table.add_row(*row)
    return table


def markdown(report: CompareReport) -> str:
    """``compare.md``: what was compared (SIMULATED when it was), the ``rows`` table and the conclusion.

    Args:
        report: the ``CompareReport``.

    Returns:
        The document's text, ending in a newline.
    """
    where = (f"{report.replicas} logical CPU devices — SIMULATED ON CPU, not a GPU result" if report.simulated
             else f"{report.replicas} GPUs")
    memory = (f"GPU memory: {report.gpu_memory_stand_in}." if report.gpu_memory_stand_in
              else f"GPU memory: {format_bytes(report.gpu_memory_bytes)}.")
    lines = [f"# bigmem compare: {report.model}", "",
             f"Data-parallel path: {where}. {memory} Budget: {report.budget}. "
             f"Held-out cases: {', '.join(report.held_out_cases)}.", "",
             f"| | {LABELS['cpu_bigmem']} | {LABELS['data_parallel']} |", "|---|---|---|"]
    lines += [f"| {a.strip()} | {b} | {c} |" for a, b, c in rows(report)]
    if provenance(report):
        lines += ["", provenance(report)]
    lines += ["", f"**Conclusion:** {report.conclusion.text}"]
    return "\n".join(lines) + "\n"


def plot(report: CompareReport, path: Path) -> None:
    """Write ``compare.png`` (atomically): held-out Dice against training time, per-class Dice, inference time.

    Args:
        report: the ``CompareReport``.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"cpu_bigmem": "tab:blue", "data_parallel": "tab:orange"}
    names = {name: LABELS[name] + (" (simulated)" if report.simulated and name == "data_parallel" else "")
             for name in PATHS}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name in PATHS:
        for index, run in enumerate(report.paths[name].runs):
            points = [(p.time_s, p.val_dice) for p in run.training.curve if p.val_dice is not None]
            if points:
                axes[0].plot(*zip(*points), marker="o", markersize=3, color=colors[name], alpha=0.8,
                             label=names[name] if index == 0 else None)
            axes[0].plot([run.training.train_s], [run.held_out.dice], marker="*", markersize=12, color=colors[name],
                         markeredgecolor="black", label="final model (predict + evaluate)" if index == 0 and
                         name == "data_parallel" else None)
    axes[0].set_xlabel("training time (s, validation not counted)")
    axes[0].set_ylabel("held-out Dice")
    axes[0].set_title("time to Dice")
    axes[0].legend(fontsize=8)
    classes = list(report.paths["cpu_bigmem"].per_class)
    width = 0.38
    for offset, name in ((-width / 2, "cpu_bigmem"), (width / 2, "data_parallel")):
        per_class = report.paths[name].per_class
        axes[1].bar([i + offset for i in range(len(classes))], [per_class[c].dice or 0 for c in classes], width,
                    color=colors[name], label=names[name])
    axes[1].set_xticks(range(len(classes)), [f"class {c}" for c in classes])
    axes[1].set_ylim(0, 1.2)  # room above the bars for the legend
    axes[1].set_yticks([0, 0.2, 0.4, 0.6, 0.8, 1.0])
    axes[1].set_ylabel("held-out Dice (final model)")
    axes[1].set_title("per class")
    axes[1].legend(fontsize=8)
    axes[2].bar([report.paths[name].inference_mode for name in PATHS],
                [report.paths[name].inference_s_per_case for name in PATHS], color=[colors[name] for name in PATHS])
    axes[2].set_ylabel("seconds per case")
    axes[2].set_title("inference")
    fig.suptitle(f"bigmem compare: {report.model}, {report.budget}"
                 + (" — data parallel SIMULATED ON CPU" if report.simulated else ""), fontsize=10)
    fig.tight_layout()
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, format="png")
    plt.close(fig)
