"""``bigmem report``: plots and a short summary of a run (or two, side by side)."""

from __future__ import annotations

import argparse

HELP = "plot a run's loss, throughput, memory, CPU, disk and page cache; summarise it"

DESCRIPTION = """\
Read RUN_DIR (metrics.jsonl, monitor.csv, summary.json, plan.json), finished or still running,
and write PNG plots (loss and Dice, voxels/s, RSS and per-node memory against the plan, CPU %,
disk MB/s, page cache) with report.md (peak memory vs plan, disk throughput, input stall share,
throughput) and report.json to --out (default RUN_DIR/report). Two run directories are drawn
on the same axes and summarised in adjacent columns.

examples:
  bigmem report runs/small-20261130-101500
  bigmem report compare/cpu_bigmem compare/data_parallel --out compare/report
"""


def register(subparsers, parents) -> None:
    parser = subparsers.add_parser("report", help=HELP, description=DESCRIPTION, parents=parents,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one run directory, or two to compare")
    parser.add_argument("--out", metavar="DIR", help="output folder (default: RUN_DIR/report of the first run)")
    parser.set_defaults(run=run)


def run(args) -> int:
    from pathlib import Path

    from bigmem.cli.common import check_output_dir
    from bigmem.errors import UsageError

    if len(args.run_dirs) > 2:
        raise UsageError(f"bigmem report takes one or two RUN_DIRs, got {len(args.run_dirs)}.")
    if args.out is not None:
        check_output_dir(args.out, "--out")
    elif Path(args.run_dirs[0]).is_dir():  # else make_report says there is no such directory
        check_output_dir(Path(args.run_dirs[0]) / "report", "--out (default RUN_DIR/report)")

    from rich.console import Console

    from bigmem import api
    from bigmem.units import format_bytes, format_count

    report = api.report(args.run_dirs, args.out)
    status = Console(soft_wrap=True, stderr=True)
    for summary in report.runs:
        for note in summary["notes"]:
            status.print(f"note: {note}", style="yellow", markup=False, highlight=False)
    console = Console(soft_wrap=True)
    for summary in report.runs:
        stall = summary["input_stall_share"]
        peak = summary["peak_rss_bytes"]
        console.print(f"{summary['run_dir']}: {summary['state']}, {format_count(summary['steps'], 'step')}, peak RSS "
                      f"{format_bytes(peak) if peak is not None else '-'}, input stalls "
                      f"{'-' if stall is None else f'{100 * stall:.1f}%'}")
    console.print(f"wrote {report.folder}/report.md, report.json and {len(report.plots)} plots")
    return 0
