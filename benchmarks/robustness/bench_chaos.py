"""Kill ``bigmem train`` with SIGKILL at random moments, resume each time, and compare the finished
run with an uninterrupted one of the same seed.

    python benchmarks/robustness/bench_chaos.py [--kills 20] [--steps 200] [--checkpoint-every 4] [--volume 32]
        [--seed 0] [--quick] [--out DIR]

One uninterrupted run (the reference, which also times start-up and a step), then ``--kills``
launches of the same command (``--resume`` added from the second on), each killed in one of four
phases in turn: during start-up (before the first step); mid-step (at a random step inside the
interval after the next checkpoint past the last logged step, a random fraction of a step
later); during a checkpoint write (as soon as the launch's temporary ``.ckpt-*.tmp-<pid>-*`` appears); and at any
moment of the time the launch needs (start-up, the steps left, the end). After every kill: every
JSON file of the run directory must parse (temporaries, hidden names, are not outputs) and
metrics.jsonl may only have its last line torn; the steps lost are the last logged step less the
newest complete checkpoint's. A last launch resumes to the end; its metrics and final loss are
compared with the reference. Prints a table and writes JSON keyed by machine (never run by
pytest; tests/train/test_chaos.py runs the same driver with 3 kills).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: harness, _results, the other kinds

import numpy as np

from bigmem.atomic import temporary_of
from bigmem.checkpoints import PREFIX, CheckpointManager

PHASES = ("start-up", "mid-step", "checkpoint write", "any moment")
POLL_S = 0.0005


@dataclass
class Settings:
    """The run every launch repeats: the tiny preset on ``store``."""

    store: Path
    steps: int = 200
    checkpoint_every: int = 4
    volume: int = 32
    seed: int = 0
    monitor_interval_s: float = 0.2
    augment: str = "nnunet"  # every draw a function of (seed, sample): a resumed run must still match

    def command(self, out: Path, resume: bool) -> list[str]:
        """``bigmem train ...``, the same each time, plus ``--resume`` after the first launch."""
        return [sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(self.store),
                "--volume", str(self.volume), "--steps", str(self.steps), "--checkpoint-every",
                str(self.checkpoint_every), "--seed", str(self.seed), "--monitor-interval",
                str(self.monitor_interval_s), "--augment", self.augment, "--out", str(out),
                *(["--resume"] if resume else [])]


@dataclass
class Timing:
    """The uninterrupted run's timing, which places the kills."""

    first_row_s: float  # launch to the first metrics row (start-up and the first, traced step)
    step_s: float  # median step
    wall_s: float  # launch to exit
    per_step_wall_s: float  # after the first row, wall seconds per step (checkpoints and the end included)


@dataclass
class Kill:
    """One killed launch and what the run directory held after it."""

    number: int
    phase: str
    resume: bool
    at_s: float  # seconds after launch
    exited_first: bool  # the launch ended before the kill came (it finished)
    started: str | None  # the launch's own line: "from ckpt-N", "over", "new", or None (killed before it)
    in_checkpoint_write: bool  # the launch's temporary checkpoint folder was there when it died
    last_logged_step: int
    checkpoint_step: int
    lost_steps: int
    json_files: int
    json_errors: list[str] = field(default_factory=list)
    torn_metrics_lines: int = 0
    misplaced_torn_lines: int = 0  # torn lines before the last: never allowed


def metrics_rows(run: Path) -> tuple[list[dict], list[int]]:
    """The parsed rows of metrics.jsonl and the line numbers that do not parse."""
    rows, torn = [], []
    path = run / "metrics.jsonl"
    if not path.exists():
        return rows, torn
    for number, line in enumerate(path.read_bytes().decode(errors="replace").splitlines()):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            torn.append(number)
    return rows, torn


def last_step(run: Path) -> int:
    rows, _ = metrics_rows(run)
    return max((r["step"] for r in rows), default=0)


def _hidden(path: Path, run: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(run).parts)


def check_run_dir(run: Path) -> dict:
    """What a kill left: JSON files that do not parse, torn metrics lines, the newest checkpoint."""
    files = [p for p in run.rglob("*.json") if p.is_file() and not _hidden(p, run)] if run.exists() else []
    errors = []
    for path in files:
        try:
            json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            errors.append(f"{path.relative_to(run)}: {exc}")
    rows, torn = metrics_rows(run)
    lines = len((run / "metrics.jsonl").read_bytes().splitlines()) if (run / "metrics.jsonl").exists() else 0
    latest = CheckpointManager(run / "checkpoints").latest()
    return {"json_files": len(files), "json_errors": errors, "torn": len(torn),
            "misplaced_torn": sum(1 for n in torn if n != lines - 1),
            "last_logged_step": max((r["step"] for r in rows), default=0),
            "checkpoint_step": int(latest.name.split("-")[1]) if latest else 0}


def started_line(log: Path, run: Path) -> str | None:
    """How the launch began, from its own line (None if it died before printing one)."""
    text = log.read_text(errors="replace") if log.exists() else ""
    if match := re.search(r"Resuming .* from (ckpt-\d+) \(step", text):
        return f"from {match.group(1)}"
    if "starting it over from step 0" in text:
        return "over"
    if "bigmem train: tiny" in text or "No run was started" in text:
        return "new"
    return None


def reference_run(settings: Settings, out: Path, log: Path) -> Timing:
    """The uninterrupted run (its timing places the kills)."""
    started = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(settings.command(out, resume=False), stdout=handle, stderr=subprocess.STDOUT)
    first_row_s = None
    while process.poll() is None:
        if first_row_s is None and last_step(out) > 0:
            first_row_s = time.monotonic() - started
        time.sleep(0.005)
    wall_s = time.monotonic() - started
    if process.returncode != 0:
        raise RuntimeError(f"the reference run failed (exit {process.returncode}): {log.read_text()[-2000:]}")
    rows, _ = metrics_rows(out)
    first_row_s = first_row_s or wall_s
    return Timing(first_row_s, float(np.median([r["step_s"] for r in rows[1:]] or [0.05])), wall_s,
                  (wall_s - first_row_s) / max(1, settings.steps - 1))


def _writing_checkpoint(name: str, pid: int) -> bool:
    """Whether ``name`` is launch ``pid``'s temporary of a checkpoint (``atomic.temporary_name``'s scheme)."""
    owner = temporary_of(name)
    return owner is not None and owner[1] == pid and owner[0].startswith(PREFIX)


def _wait_for_kill(process: subprocess.Popen, phase: str, run: Path, settings: Settings, timing: Timing,
                   rng: np.random.Generator, started: float) -> None:
    """Return at the phase's random moment (or when the launch ends by itself)."""

    def alive_until(condition, deadline_s: float = 600.0) -> bool:
        while process.poll() is None and time.monotonic() - started < deadline_s:
            if condition():
                return True
            time.sleep(POLL_S)
        return False

    if phase == "start-up":
        at = rng.uniform(0.2, timing.first_row_s)
        alive_until(lambda: time.monotonic() - started >= at)
    elif phase == "mid-step":  # inside the interval after this launch's first checkpoint, part of a step later
        every = settings.checkpoint_every
        target = min(settings.steps, (last_step(run) // every + 1) * every + int(rng.integers(1, every)))
        if alive_until(lambda: last_step(run) >= target):
            deadline = time.monotonic() + rng.uniform(0, timing.step_s)
            alive_until(lambda: time.monotonic() >= deadline)
    elif phase == "checkpoint write":
        folder = run / "checkpoints"

        def writing() -> bool:
            try:
                return any(_writing_checkpoint(e.name, process.pid) for e in os.scandir(folder))
            except FileNotFoundError:
                return False

        alive_until(writing)
    else:  # uniform over the time this launch needs: start-up, the steps left (from the newest checkpoint), the end
        latest = CheckpointManager(run / "checkpoints").latest()
        left = settings.steps - (int(latest.name.split("-")[1]) if latest else 0)
        at = rng.uniform(0, timing.first_row_s + left * timing.per_step_wall_s)
        alive_until(lambda: time.monotonic() - started >= at)


def kill_once(number: int, phase: str, settings: Settings, run: Path, logs: Path, timing: Timing,
              rng: np.random.Generator) -> Kill:
    """Launch the command, SIGKILL it in ``phase``, and inspect the run directory."""
    resume = number > 1
    log = logs / f"launch-{number:02d}.log"
    started = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(settings.command(run, resume), stdout=handle, stderr=subprocess.STDOUT)
    _wait_for_kill(process, phase, run, settings, timing, rng, started)
    exited_first = process.poll() is not None
    at_s = time.monotonic() - started
    if not exited_first:
        os.kill(process.pid, signal.SIGKILL)
    process.wait()
    folder = run / "checkpoints"
    in_write = folder.exists() and any(_writing_checkpoint(p.name, process.pid) for p in folder.iterdir())
    state = check_run_dir(run)
    return Kill(number, phase, resume, round(at_s, 3), exited_first, started_line(log, run), in_write,
                state["last_logged_step"], state["checkpoint_step"],
                state["last_logged_step"] - state["checkpoint_step"], state["json_files"], state["json_errors"],
                state["torn"], state["misplaced_torn"])


def chaos(settings: Settings, folder: Path, kills: int, seed: int = 0, phases=PHASES) -> dict:
    """The whole experiment: a reference run, ``kills`` killed launches, a last resume, the comparison.

    Returns:
        ``{"timing", "kills": [Kill as dict], "final": {...}, "reference": {...}}``; ``final``
        has the last launch's exit code and started line, its and the reference's final loss,
        the largest relative difference of the per-step losses, the steps logged, and what
        is left over (temporaries, damaged checkpoints).
    """
    rng = np.random.default_rng(seed)
    logs = folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    reference, run = folder / "reference", folder / "run"
    timing = reference_run(settings, reference, logs / "reference.log")
    done = [kill_once(n, phases[(n - 1) % len(phases)], settings, run, logs, timing, rng)
            for n in range(1, kills + 1)]
    log = logs / "final.log"
    with open(log, "w") as handle:
        final = subprocess.run(settings.command(run, resume=True), stdout=handle, stderr=subprocess.STDOUT)
    ref_rows, _ = metrics_rows(reference)
    rows, torn = metrics_rows(run)
    ref_summary = json.loads((reference / "summary.json").read_text())
    summary = json.loads((run / "summary.json").read_text()) if (run / "summary.json").exists() else {}
    ref_loss = np.array([r["loss"] for r in ref_rows])
    loss = np.array([r["loss"] for r in rows])
    same_steps = [r["step"] for r in rows] == [r["step"] for r in ref_rows]
    leftovers = sorted(str(p.relative_to(run)) for p in run.rglob(".*"))
    return {
        "settings": {**asdict(settings), "store": str(settings.store)},
        "timing": asdict(timing),
        "kills": [asdict(k) for k in done],
        "final": {"exit_code": final.returncode, "started": started_line(log, run),
                  "log_tail": log.read_text(errors="replace")[-600:] if final.returncode else "",
                  "steps": [r["step"] for r in rows], "torn_metrics_lines": len(torn),
                  "loss": summary.get("loss"), "reference_loss": ref_summary["loss"],
                  "final_loss_rel_diff": (abs(summary["loss"] - ref_summary["loss"]) / abs(ref_summary["loss"])
                                          if "loss" in summary else None),
                  "max_step_loss_rel_diff": (float(np.max(np.abs(loss - ref_loss) / np.abs(ref_loss)))
                                             if same_steps else None),
                  "model_keras": (run / "model.keras").exists(), "leftovers": leftovers},
    }


def main(argv: list[str] | None = None) -> int:
    from harness import bench_parser, write_results  # here: tests/train/test_chaos.py imports this file alone
    from rich.console import Console
    from rich.table import Table

    from bigmem.data.synth import write_synthetic_store
    from bigmem.memory.calibration import machine_cpu_model, tensorflow_version

    parser = bench_parser(__doc__, quick={"kills": 4, "steps": 12})  # one kill per phase
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=4)
    parser.add_argument("--volume", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments (the runs use --seed 1)")
    args = parser.parse_args(argv)
    console = Console(soft_wrap=True, width=max(Console().width, 120))  # the table's nine columns
    with tempfile.TemporaryDirectory(prefix="bigmem-bench-chaos-") as folder:
        store = write_synthetic_store(Path(folder) / "phantoms.h5", num_cases=4, volume=16, num_classes=3, seed=0)
        settings = Settings(store, steps=args.steps, checkpoint_every=args.checkpoint_every, volume=args.volume,
                            seed=1)
        started = time.monotonic()
        report = chaos(settings, Path(folder), args.kills, seed=args.seed)
        report["bench_s"] = time.monotonic() - started
    table = Table(title=f"SIGKILL chaos: bigmem train tiny {args.volume}^3, {args.steps} steps, checkpoint every "
                        f"{args.checkpoint_every}")
    for column in ("#", "phase", "killed at s", "started", "in ckpt write", "last logged", "checkpoint", "lost",
                   "JSON ok"):
        table.add_column(column, justify="left" if column in ("phase", "started") else "right")
    for kill in report["kills"]:
        when = "exited" if kill["exited_first"] else f"{kill['at_s']:.2f}"
        table.add_row(str(kill["number"]), kill["phase"], when, kill["started"] or "-",
                      "yes" if kill["in_checkpoint_write"] else "", str(kill["last_logged_step"]),
                      str(kill["checkpoint_step"]), str(kill["lost_steps"]),
                      f"{kill['json_files'] - len(kill['json_errors'])}/{kill['json_files']}")
    console.print(table)
    final = report["final"]
    killed = [k for k in report["kills"] if not k["exited_first"]]
    console.print(f"{len(killed)} kills ({sum(k['in_checkpoint_write'] for k in killed)} during a checkpoint write), "
                  f"{len(report['kills'])} resumes (the last to the end: exit {final['exit_code']}); most steps lost "
                  f"{max((k['lost_steps'] for k in killed), default=0)} (checkpoint every {args.checkpoint_every}); "
                  f"JSON errors {sum(len(k['json_errors']) for k in report['kills'])}; final loss {final['loss']!r} vs "
                  f"uninterrupted {final['reference_loss']!r} (relative difference {final['final_loss_rel_diff']}, "
                  f"largest per step {final['max_step_loss_rel_diff']}); left over: {final['leftovers'] or 'nothing'}")
    report["machine"] = {"cpu": machine_cpu_model(), "tensorflow": tensorflow_version(), "cpus": os.cpu_count()}
    write_results("chaos", report, args.out, console)
    return 0 if final["exit_code"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
