"""``bigmem profile``: the memory footprint of a configuration, predicted and optionally measured."""

from __future__ import annotations

import argparse
import json
import os

from bigmem.cli.common import (
    add_budget_flag, add_memory_flags, add_model_flags, add_numa_flags, budget_arguments, model_overrides,
    numa_overrides, parse_shape,
)
from bigmem.errors import UsageError

HELP = "predict (and measure) the memory footprint of a training configuration"

DESCRIPTION = """\
Predict the peak resident memory of one training step, per component, before anything is
allocated; with --measure, also run a few real steps in a child process and read the kernel's
peak (VmHWM). --sweep measures several sizes and fits peak = fixed + bytes/voxel x voxels.
--calibrate fits this machine's activation multiplier and overhead (stored in ~/.cache/bigmem)
for the chosen --model, --precision and --recompute; later estimates use it. Without one, the
shipped defaults for this CPU's ISA class are used, or, where there are none, another class's
plus a stated safety margin (the breakdown shows it as its own component).

Measurements use synthetic volumes of the same shape (voxel values do not change the footprint).
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("profile", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, volume_help="cubic volume edge N (N^3 voxels), a multiple of 2^depth")
    parser.add_argument("--shape", metavar="D,H,W", help="a non-cubic volume, e.g. 240,240,144 (estimate only)")
    add_memory_flags(parser)
    add_budget_flag(parser, help_text="the budget --recompute auto fits (default: what the --numa placement can use, "
                                      "else MemAvailable)")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--measure", action="store_true", help="also measure the peak in a child process")
    measure.add_argument("--steps", type=int, default=3, metavar="K", help="training steps to measure (default 3)")
    measure.add_argument("--sweep", metavar="N,N,...", help="measure and predict each volume, e.g. 32,48,64,96")
    measure.add_argument("--calibrate", nargs="?", const="32,64,96", metavar="N,N,...",
                         help="fit this machine's calibration from measured volumes (default 32,64,96)")
    add_numa_flags(parser)
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def _volumes(text: str, flag: str) -> list[int]:
    try:
        volumes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        volumes = []
    if not volumes or min(volumes) < 1:
        raise UsageError(f"Invalid {flag} {text!r}: expected volume edges such as 32,48,64.")
    return volumes


def run(args) -> int:
    from bigmem.tfenv import import_tensorflow

    import_tensorflow(verbose=getattr(args, "verbose", False))  # quietly, before anything imports Keras
    from rich.console import Console

    from bigmem.config.presets import resolve_config
    from bigmem.memory import profile as api
    from bigmem.nets.unet3d import UNet3D

    if args.shape and args.volume:
        raise UsageError("Give either --volume or --shape, not both.")
    if args.shape and (args.measure or args.sweep or args.calibrate):
        raise UsageError("--measure, --sweep and --calibrate need a cubic --volume (the measured run trains on cubes).")
    if args.steps < 1:
        raise UsageError(f"Invalid --steps {args.steps}: expected a positive integer.")
    if args.recompute == "auto" and (args.sweep or args.calibrate):
        raise UsageError("--recompute auto chooses stages per size and budget; --sweep and --calibrate take "
                         "--recompute none or stages.")
    config = resolve_config(args.model or "small", {**model_overrides(args), "numa": numa_overrides(args)})
    from bigmem.numa.policy import resolve_placement  # validate here; the measuring child applies it
    from bigmem.numa.topology import NUMATopology

    topology = NUMATopology.from_sysfs()
    placement = resolve_placement(config.numa.policy, config.numa.cpus, config.numa.threads, topology,
                                  set(os.sched_getaffinity(0)))
    shape = parse_shape(args.shape) if args.shape else (config.data.volume,) * 3
    counts_for = api.counts_function(config)
    UNet3D(config.model).check_spatial_shape(shape, field="--shape" if args.shape else "data.volume")
    console = Console(soft_wrap=True)
    status = Console(soft_wrap=True, stderr=True)  # progress goes to stderr: stdout may be --json
    show = _Printer(console, config)

    if args.calibrate:
        volumes = _volumes(args.calibrate, "--calibrate")
        for v in volumes:
            UNet3D(config.model).check_spatial_shape((v,) * 3, field="data.volume")
        calibration, points = api.calibrate(config, volumes, counts_for, steps=args.steps,
                                            progress=lambda v: status.print(f"measuring {v}^3 ...", style="dim"))
        if args.json:
            print(json.dumps({"calibration": calibration.to_dict(), "points": points}, indent=2))
        else:
            show.calibration(calibration, points)
        return 0
    if args.sweep:
        volumes = _volumes(args.sweep, "--sweep")
        for v in volumes:
            UNet3D(config.model).check_spatial_shape((v,) * 3, field="--sweep")
        results, law = api.sweep(config, volumes, counts_for, steps=args.steps,
                                 progress=lambda v: status.print(f"measuring {v}^3 ...", style="dim"))
        if args.json:
            print(json.dumps({"points": [r.to_dict() for r in results], "scaling_law": law.to_dict()}, indent=2))
        else:
            show.sweep(results, law)
        return 0
    stages = _stages(args, config, counts_for, placement, topology, shape, status)
    result = api.profile(config, shape, counts_for, do_measure=args.measure, steps=args.steps,
                         recompute_stages=stages)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        show.breakdown(result)
    return 0


def _stages(args, config, counts_for, placement, topology, shape, status) -> list[str]:
    """The recomputed stages, as ``bigmem train`` chooses them (auto: the fewest that fit the budget)."""
    from bigmem.memory.preflight import recompute_stages, resolve_budget

    budget = None
    if args.recompute == "auto":
        if len(set(shape)) != 1:
            raise UsageError("--recompute auto needs a cubic --volume.")
        explicit, flag = budget_arguments(args)
        resolved = resolve_budget(explicit, flag=flag, placement=placement, topology=topology)
        if resolved.note:
            status.print(resolved.note, style="yellow")
        budget = resolved.budget_bytes
    return recompute_stages(config, counts_for, shape, budget)


class _Printer:
    def __init__(self, console, config):
        self.console = console
        self.config = config

    def _mode(self, estimate) -> str:
        recompute = f", recomputing {len(estimate.recompute_stages)} stages" if estimate.recompute_stages else ""
        return f"{estimate.precision}{recompute}"

    def breakdown(self, result) -> None:
        from rich.table import Table

        from bigmem.units import format_bytes

        est = result.estimate
        shape = "x".join(map(str, est.spatial_shape))
        table = Table(title=f"{self.config.model.name}: {shape} x batch {est.batch_size}, {self._mode(est)}, "
                            f"{est.param_count:,} parameters")
        table.add_column("component")
        table.add_column("bytes", justify="right")
        table.add_column("share", justify="right")
        total = est.predicted_peak_bytes
        for name, value in sorted(est.components.items(), key=lambda kv: -kv[1]):
            table.add_row(name, format_bytes(value), f"{100 * value / total:.1f}%")
        table.add_row("[bold]predicted peak", f"[bold]{format_bytes(total)}", "100.0%")
        self.console.print(table)
        self.console.print(f"{est.train_flops_per_step / 1e9:,.1f} GFLOP per training step; "
                           f"calibration: {est.calibration.source}", style="dim")
        for note in est.notes:
            self.console.print(f"note: {note}", style="dim")
        if result.measurement is not None:
            m = result.measurement
            nodes = ", ".join(f"node {k}: {format_bytes(v)}" for k, v in sorted(m.node_bytes.items()))
            self.console.print(f"measured peak (VmHWM): {format_bytes(m.peak_bytes)}; predicted "
                               f"{format_bytes(total)}; error {result.error_pct:+.1f}%  ({nodes}; "
                               f"{m.step_s:.2f} s/step)")

    def sweep(self, results, law) -> None:
        from rich.table import Table

        from bigmem.units import format_bytes

        table = Table(title=f"{self.config.model.name}: measured vs predicted peak, batch "
                            f"{self.config.train.batch_size}, {self._mode(results[0].estimate)}")
        for column in ("volume", "predicted", "measured", "error"):
            table.add_column(column, justify="right")
        for r in results:
            table.add_row(f"{r.estimate.spatial_shape[0]}^3", format_bytes(r.estimate.predicted_peak_bytes),
                          format_bytes(r.measurement.peak_bytes), f"{r.error_pct:+.1f}%")
        self.console.print(table)
        self.console.print(f"fitted: peak = {format_bytes(law.fixed_bytes)} + {law.bytes_per_voxel:.1f} B/voxel x "
                           f"voxels; at 512^3: {format_bytes(law.peak_at(512))}; 1 TiB is reached at about "
                           f"{law.volume_reaching(2**40):.0f}^3")

    def calibration(self, calibration, points) -> None:
        from bigmem.units import format_bytes

        sizes = ", ".join(f"{p['volume']}^3: {format_bytes(p['measured_peak_bytes'])}" for p in points)
        self.console.print(f"measured {sizes}")
        self.console.print(f"calibration ({calibration.key['preset']}, {calibration.key['precision']}, recompute "
                           f"{calibration.key['recompute']}): "
                           f"activation scale {calibration.activation_scale:.3f}, framework "
                           f"{format_bytes(calibration.framework_bytes)}; saved for {calibration.key['cpu']} "
                           f"({calibration.key['isa']}), TF {calibration.key['tensorflow']}")
