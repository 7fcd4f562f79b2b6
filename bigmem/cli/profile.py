"""``bigmem profile``: the memory footprint of a configuration, predicted and optionally measured."""

from __future__ import annotations

import argparse
import json

from bigmem.cli.common import (
    add_budget_flag,
    add_memory_flags,
    add_model_flags,
    add_numa_flags,
    add_shape_column,
    budget_arguments,
    check_positive,
    check_shape_argument,
    model_overrides,
    numa_overrides,
    shape_argument,
)
from bigmem.config.presets import DEFAULT_PRESET
from bigmem.errors import UsageError
from bigmem.memory import MEASURED_STEPS
from bigmem.units import format_shape

HELP = "predict (and measure) the memory footprint of a training configuration"

DESCRIPTION = """\
Predict the peak resident memory of one training step, per component, before anything is
allocated; with --measure, also run a few real steps in a child process and read the kernel's
peak (VmHWM). --sweep measures several sizes and fits peak = fixed + bytes/voxel x voxels.
--calibrate fits this machine's activation multiplier and overhead (stored in ~/.cache/bigmem)
for the chosen --model, --precision and --recompute; later estimates use it. Without one, the
shipped defaults for this CPU's ISA class are used, or, where there are none, another class's
plus a stated safety margin (the breakdown shows it as its own component).

Shapes are D,H,W (--shape 240,240,144; --volume N is N,N,N); without either, the preset's
reference cube. Measurements use synthetic volumes of the same shape (voxel values do not change
the footprint). --sweep and --calibrate take edges or shapes: 32,48x64x64,96.

--inference profiles segmenting one whole volume instead (bigmem predict's whole-volume path:
batch 1, no gradients, no optimizer): the weights, the input's copies, the forward pass's live
tensors, the probabilities and the source mapping's arrays; --volume or --shape need not be a
multiple of 2^depth (predict pads them). --measure then segments a random volume of that shape in
a child process.
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("profile", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_flags(parser, volume_help="a cube of N^3 voxels, N a multiple of 2^depth",
                    shape_help="the volume's shape, e.g. 240,240,144, each a multiple of 2^depth (default: the "
                               "preset's reference cube)")
    add_memory_flags(parser)
    add_budget_flag(parser, help_text="the budget --recompute auto fits (default: what the --numa placement can use, "
                                      "else MemAvailable)")
    measure = parser.add_argument_group("measurement")
    measure.add_argument("--measure", action="store_true", help="also measure the peak in a child process")
    measure.add_argument("--steps", type=int, metavar="K", help=f"training steps to measure (default {MEASURED_STEPS})")
    measure.add_argument("--sweep", metavar="N,N,...", help="measure and predict each size, e.g. 32,48,64,96 or "
                                                            "32x64x64,48x96x96 (DxHxW)")
    measure.add_argument("--calibrate", nargs="?", const="32,64,96", metavar="N,N,...",
                         help="fit this machine's calibration from measured sizes (edges or DxHxW; default 32,64,96)")
    add_numa_flags(parser)
    parser.add_argument("--inference", action="store_true",
                        help="the footprint of segmenting one whole volume (bigmem predict), not of a training step")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.set_defaults(run=run)


def _sizes(text: str, flag: str) -> list[tuple[int, int, int]]:
    """'32,48x64x64' -> [(32, 32, 32), (48, 64, 64)]: edges N (cubes) or DxHxW shapes."""
    sizes = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        try:
            parts = [int(v) for v in item.split("x")]
        except ValueError:
            parts = []
        if len(parts) not in (1, 3) or min(parts) < 1:
            raise UsageError(f"Invalid {flag} {text!r}: expected volume edges or DxHxW shapes such as 32,48,64 "
                             "or 32x64x64.")
        sizes.append(tuple(parts * 3 if len(parts) == 1 else parts))
    if not sizes:
        raise UsageError(f"Invalid {flag} {text!r}: expected volume edges or DxHxW shapes such as 32,48,64.")
    return sizes


def _checked(args):
    """(config, shape, the --calibrate/--sweep sizes) from the flags, every one checked before TensorFlow starts."""
    from bigmem.config.presets import resolve_config
    from bigmem.config.schema import check_shape

    inference = getattr(args, "inference", False)
    if inference and (args.sweep or args.calibrate or args.recompute or args.batch_size):
        raise UsageError("--inference profiles one whole-volume prediction (batch 1, nothing recomputed): "
                         "--sweep, --calibrate, --recompute and --batch-size do not apply.")
    if args.steps is None:
        args.steps = MEASURED_STEPS
    if args.steps < 1:
        raise UsageError(f"Invalid --steps {args.steps}: expected a positive integer.")
    if args.recompute == "auto" and (args.sweep or args.calibrate):
        raise UsageError("--recompute auto chooses stages per size and budget; --sweep and --calibrate take "
                         "--recompute none or stages.")
    check_positive("--batch-size", args.batch_size)
    asked = shape_argument(args)
    budget_arguments(args)  # a size it cannot read is a usage error now, not after TensorFlow starts
    overrides = model_overrides(args)
    overrides["data"].pop("shape", None)  # checked here, where inference may take any shape
    config = resolve_config(args.model or DEFAULT_PRESET, {**overrides, "numa": numa_overrides(args)})
    shape = asked or config.data.shape or (config.data.reference_volume,) * 3
    if not inference:  # predict pads any shape; a training step takes multiples of 2^depth
        if asked:
            check_shape_argument(args, shape, config.model)
        else:
            check_shape("data.reference_volume", shape, config.model)
        config = config.updated({"data": {"shape": list(shape)}})
    volumes = []
    if args.calibrate or args.sweep:
        flag = "--calibrate" if args.calibrate else "--sweep"
        volumes = _sizes(args.calibrate or args.sweep, flag)
        for size in volumes:
            check_shape(flag, size, config.model)
    return config, shape, volumes


def run(args) -> int:
    # Every flag is checked before TensorFlow is imported (seconds) or anything is computed.
    config, shape, volumes = _checked(args)
    from rich.console import Console

    from bigmem import api
    from bigmem.cli.common import flag_for
    from bigmem.errors import render_fields

    status = Console(soft_wrap=True, stderr=True)  # progress goes to stderr: stdout may be --json
    settings = {"budget_bytes": budget_arguments(args)[0], "verbose": getattr(args, "verbose", False),
                "progress": lambda line: status.print(line, style="dim")}
    if volumes and args.calibrate:
        calibrated = api.calibrate(config, volumes, steps=args.steps, **settings)
        return _show(args, config, {"calibration": calibrated.calibration.to_dict(), "points": calibrated.points},
                     lambda show: show.calibration(calibrated.calibration, calibrated.points))
    if volumes:
        swept = api.sweep(config, volumes, steps=args.steps, **settings)
        return _show(args, config, {"points": [r.to_dict() for r in swept.profiles],
                                    "scaling_law": swept.scaling_law.to_dict()},
                     lambda show: show.sweep(swept.profiles, swept.scaling_law))
    say = lambda note: status.print(render_fields(note, flag_for), style="yellow")  # noqa: E731
    result = api.profile(config, shape, inference=getattr(args, "inference", False), measure=args.measure,
                         steps=args.steps, say=say, **settings)
    return _show(args, config, result.to_dict(), lambda show: show.profile(result))


def _show(args, config, data: dict, table) -> int:
    """Print ``data`` as JSON with ``--json``, else ``table(printer)``; 0."""
    from rich.console import Console

    if args.json:
        print(json.dumps(data, indent=2))
    else:
        table(_Printer(Console(soft_wrap=True), config))
    return 0


class _Printer:
    def __init__(self, console, config):
        self.console = console
        self.config = config

    def _mode(self, estimate) -> str:
        recompute = f", recomputing {len(estimate.recompute_stages)} stages" if estimate.recompute_stages else ""
        return f"{estimate.precision}{recompute}"

    def profile(self, result) -> None:
        """One pass's breakdown (training step or whole-volume forward pass), its notes and its measurement."""
        from rich.table import Table

        from bigmem.memory.estimate import Pass
        from bigmem.units import format_bytes

        est = result.estimate
        forward = est.pass_ is Pass.FORWARD
        shape = "x".join(map(str, est.spatial_shape))
        if forward:
            source = "x".join(map(str, est.source_shape))
            padded = "" if est.source_shape == est.spatial_shape else f" (padded from {source})"
            title = (f"{self.config.model.name}: segmenting one whole {shape} volume{padded}, inference, "
                     f"{est.precision}, {est.param_count:,} parameters")
            work = f"{est.forward_flops / 1e9:,.1f} GFLOP per forward pass"
        else:
            title = (f"{self.config.model.name}: {shape} x batch {est.batch_size}, {self._mode(est)}, "
                     f"{est.param_count:,} parameters")
            work = f"{est.train_flops_per_step / 1e9:,.1f} GFLOP per training step"
        table = Table(title=title)
        table.add_column("component")
        table.add_column("bytes", justify="right")
        table.add_column("share", justify="right")
        total = est.predicted_peak_bytes
        for name, value in sorted(est.components.items(), key=lambda kv: -kv[1]):
            table.add_row(name, format_bytes(value), f"{100 * value / total:.1f}%")
        table.add_row("[bold]predicted peak", f"[bold]{format_bytes(total)}", "100.0%")
        self.console.print(table)
        self.console.print(f"{work}; calibration: {est.calibration.source}", style="dim")
        for note in est.notes:
            self.console.print(f"note: {note}", style="dim")
        m = result.measurement
        if m is None:
            return
        if forward:
            where = f"{m.seconds:.1f} s"
        else:
            nodes = ", ".join(f"node {k}: {format_bytes(v)}" for k, v in sorted(m.node_bytes.items()))
            where = f"{nodes}; {m.seconds:.2f} s/step"
        self.console.print(f"measured peak (VmHWM): {format_bytes(m.peak_bytes)}; predicted {format_bytes(total)}; "
                           f"error {result.error_pct:+.1f}%  ({where})")
        growth = est.components.get("allocator_growth", 0)
        if growth:
            self.console.print(f"note: the prediction holds {format_bytes(growth)} (allocator_growth) for what a long "
                               "run adds to its first steps' peak; a few steps seldom reach it "
                               "(--steps 20 comes closer)", style="dim")

    def sweep(self, results, law) -> None:
        from rich.table import Table

        from bigmem.units import format_bytes

        table = Table(title=f"{self.config.model.name}: measured vs predicted peak, batch "
                            f"{self.config.train.batch_size}, {self._mode(results[0].estimate)}")
        shapes = [format_shape(r.estimate.spatial_shape) for r in results]
        add_shape_column(table, "shape", shapes, justify="right")
        for column in ("predicted", "measured", "error"):
            table.add_column(column, justify="right")
        for r, shape in zip(results, shapes):
            table.add_row(shape, format_bytes(r.estimate.predicted_peak_bytes), format_bytes(r.measurement.peak_bytes),
                          f"{r.error_pct:+.1f}%")
        self.console.print(table)
        self.console.print(f"fitted: peak = {format_bytes(law.fixed_bytes)} + {law.bytes_per_voxel:.1f} B/voxel x "
                           f"voxels; at 512^3: {format_bytes(law.peak_at(512))}; 1 TiB is reached at about "
                           f"{law.volume_reaching(2**40):.0f}^3")

    def calibration(self, calibration, points) -> None:
        from bigmem.units import format_bytes

        sizes = ", ".join(f"{format_shape(p.get('shape') or [p['volume']] * 3)}: "
                          f"{format_bytes(p['measured_peak_bytes'])}"
                          + (f" at {p['step_s']:.3g} s/step" if "step_s" in p else "") for p in points)
        self.console.print(f"measured {sizes}")
        if calibration.step_gflops_per_core:
            self.console.print(f"step rate at {calibration.fitted_on[-1]}^3: {calibration.step_gflops_per_core:.1f} "
                               "GFLOP/s per core (bigmem plan predicts step times from it)")
        self.console.print(f"calibration ({calibration.key['preset']}, {calibration.key['precision']}, recompute "
                           f"{calibration.key['recompute']}): "
                           f"activation scale {calibration.activation_scale:.3f}, framework "
                           f"{format_bytes(calibration.framework_bytes)}; saved for {calibration.key['cpu']} "
                           f"({calibration.key['isa']}), TF {calibration.key['tensorflow']}")
