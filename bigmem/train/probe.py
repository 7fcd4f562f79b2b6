"""Child process that trains a configuration for a few steps and reports its peak memory.

Run as ``python -m bigmem.train.probe REQUEST.json`` (by ``bigmem.memory.measure``); prints one JSON
line. A fresh process per configuration, so one measurement's peak never leaks into the next
(README.md, "Memory"). It lives with the trainer it runs; the memory layer starts it as a program and
never imports it.
"""

from __future__ import annotations

import io
import os
import statistics
import sys
import tempfile

from rich.console import Console

from bigmem.child import serve
from bigmem.config.schema import ExperimentConfig
from bigmem.memory.procfs import peak_rss_bytes, rss_bytes
from bigmem.numa.observe import node_resident_bytes
from bigmem.rundir import RunDir
from bigmem.tfenv import import_tensorflow


def probe(request: dict) -> dict:
    config = ExperimentConfig.from_dict(request["config"], source="probe request")
    from bigmem.numa.apply import place

    place(config.numa.policy, config.numa.cpus, config.numa.threads)  # before TensorFlow starts its threads
    import_tensorflow()
    import keras  # noqa: F401  (part of the framework's fixed cost, as in a real run)

    baseline_bytes = rss_bytes()
    from bigmem.train.trainer import train  # after the placement, and outside the baseline (TF and Keras only)

    with tempfile.TemporaryDirectory(prefix="bigmem-probe-") as run_dir:
        train(config, f"{run_dir}/run", console=Console(file=io.StringIO()),
              recompute_stages=request.get("recompute_stages"), force=bool(request.get("force", False)))
        rows = RunDir(f"{run_dir}/run").read_metrics()
    step_s = [r["step_s"] for r in rows[1:]] or [rows[0]["step_s"]]
    return {
        "peak_bytes": peak_rss_bytes(),
        "baseline_bytes": baseline_bytes,
        "node_bytes": {str(k): v for k, v in node_resident_bytes().items()},
        "steps": len(rows),
        "step_s": statistics.median(step_s),
        "cores": len(os.sched_getaffinity(0)),  # after the placement: what the steps ran on
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m bigmem.train.probe REQUEST.json``: ``probe``'s result as one JSON line (``child.serve``)."""
    return serve(probe, argv)


if __name__ == "__main__":
    sys.exit(main())
