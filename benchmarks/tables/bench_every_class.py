"""Inference against training predictions for each preset at three shapes, on each ISA class (faked).

    python benchmarks/tables/bench_every_class.py [--out DIR]

For each class (avx2, avx512, avx512_bf16, amx), forced through ``BIGMEM_ISA_CLASS`` in a child
process of its own, with nothing tuned and the CPU model a CPU no shipped table was measured on:
the predicted peak of one training step (batch 1, nothing recomputed) and of one whole-volume
forward pass, fp32 and bf16, for tiny, small, kits19 and intelai-brats at three cube edges each,
and the calibration each took. No step is run: these are the planner's predictions, which is what
the class changes (oneDNN's kernels do not). Prints a table and writes JSON keyed by this machine
(never run by pytest; tests/memory/test_every_class.py checks the same property on every class).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: _results

CLASSES = ("avx2", "avx512", "avx512_bf16", "amx")
PRESETS = {"tiny": (16, 48, 96), "small": (32, 64, 96), "kits19": (64, 96, 160), "intelai-brats": (32, 64, 144)}
UNSEEN_CPU = "a CPU no table was measured on"

CHILD = """
import json, sys
from bigmem.config import resolve_config
from bigmem.memory import calibration
from bigmem.memory.estimate import Pass, estimate
from bigmem.memory.profile import counts_function

calibration.machine_cpu_model = lambda: sys.argv[1]
presets = json.loads(sys.argv[2])
rows = []
for preset, edges in presets.items():
    for precision in ("fp32", "bf16"):
        config = resolve_config(preset, {"train": {"precision": precision, "batch_size": 1}})
        counts_for = counts_function(config)
        for edge in edges:
            shape = (edge,) * 3
            counts = counts_for(shape)
            train = estimate(config, counts, shape, recompute_stages=[])
            forward = estimate(config, counts, shape, pass_=Pass.FORWARD)
            rows.append({"preset": preset, "precision": precision, "edge": edge,
                         "train_bytes": train.predicted_peak_bytes, "inference_bytes": forward.predicted_peak_bytes,
                         "train_calibration": train.calibration.source,
                         "inference_calibration": forward.calibration.source})
print(json.dumps(rows))
"""


def run_class(isa: str, cpu: str) -> list[dict]:
    """The rows for one forced class, from a child process (the class is read once per process)."""
    with tempfile.TemporaryDirectory() as nothing_tuned:
        env = {**os.environ, "BIGMEM_ISA_CLASS": isa, "TF_CPP_MIN_LOG_LEVEL": "3", "BIGMEM_TUNING_DIR": nothing_tuned,
               "BIGMEM_CACHE_DIR": nothing_tuned}
        env.pop("BIGMEM_NATIVE_BF16", None)
        result = subprocess.run([sys.executable, "-c", CHILD, cpu, json.dumps(PRESETS)], env=env,
                                capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    from _results import REPO, write_results

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    report = {"command": "python benchmarks/tables/bench_every_class.py", "cpu_model_seen": UNSEEN_CPU,
              "classes": {}}
    print(f"{'class':<12} {'preset':<14} {'prec':<5} {'edge':>5} {'training':>11} {'inference':>11} {'inf/train':>9}")
    worst = 0.0
    for isa in CLASSES:
        rows = run_class(isa, UNSEEN_CPU)
        report["classes"][isa] = rows
        for row in rows:
            ratio = row["inference_bytes"] / row["train_bytes"]
            worst = max(worst, ratio)
            print(f"{isa:<12} {row['preset']:<14} {row['precision']:<5} {row['edge']:>5} "
                  f"{row['train_bytes'] / 2**30:>9.3f} G {row['inference_bytes'] / 2**30:>9.3f} G {ratio:>9.3f}")
    report["largest_inference_over_training"] = round(worst, 4)
    print(f"largest inference / training: {worst:.3f}")
    write_results("every_class", report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
