"""A short training with the monitor, then ``bigmem report`` on it (and on two runs, and a running one)."""

from __future__ import annotations

import csv
import json
import shutil
import struct

import psutil
import pytest

from bigmem.monitor.report import PLOTS
from helpers import run_cli

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _monitor_rows(run_dir):
    with open(run_dir / "monitor.csv", newline="") as handle:
        return list(csv.DictReader(handle))


def _png_size(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_store):
    """Two short runs of the tiny preset, monitored every 0.1 s; b validates a held-out case every 4 steps."""
    from bigmem.cli.main import main

    runs = []
    for name, seed, extra in (("a", 0, []), ("b", 1, ["--holdout", "1", "--val-every", "4"])):
        out = tmp_path_factory.mktemp("runs") / name
        code = main(["train", "--model", "tiny", "--data", str(tiny_store), "--steps", "8", "--seed", str(seed),
                     "--monitor-interval", "0.1", "--out", str(out), *extra])
        assert code == 0
        runs.append(out)
    return runs


def test_monitor_csv_and_report(trained, capsys):
    run = trained[0]
    rows = _monitor_rows(run)
    assert len(rows) >= 3
    for column in ("time_s", "cpu_percent", "rss_bytes", "page_cache_bytes", "disk_read_bytes_per_s",
                   "disk_write_bytes_per_s", "node0_used_bytes"):
        assert column in rows[0]
    assert all(int(r["rss_bytes"]) > 0 for r in rows)
    assert all(0.0 <= float(r["cpu_percent"]) <= 100.0 * psutil.cpu_count() for r in rows)
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= m["input_wait_s"] <= m["step_s"] for m in metrics)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["input_stall_share"] == pytest.approx(summary["input_wait_s"] / summary["step_time_s"])
    assert 0.0 <= summary["input_stall_share"] < 1.0

    code, out, err = run_cli(["report", run], capsys)
    assert code == 0, err
    folder = run / "report"
    for name in PLOTS:
        width, height = _png_size(folder / f"{name}.png")
        assert width >= 400
        assert height >= 200
    report = json.loads((folder / "report.json").read_text())
    (only,) = report["runs"]
    assert only["peak_rss_bytes"] == max(int(r["peak_rss_bytes"]) for r in rows)
    assert only["peak_rss_bytes"] >= max(int(r["rss_bytes"]) for r in rows)
    assert only["steps"] == 8
    assert only["state"] == "finished"
    assert only["input_stall_share"] == pytest.approx(sum(m["input_wait_s"] for m in metrics)
                                                     / sum(m["step_s"] for m in metrics))
    plan = json.loads((run / "plan.json").read_text())
    assert only["predicted_peak_bytes"] == plan["predicted_peak_bytes"]
    markdown = (folder / "report.md").read_text()
    assert "input stall share" in markdown
    assert "peak / plan" in markdown
    assert "![memory](memory.png)" in markdown
    assert only["disk_device"] == json.loads((run / "monitor.json").read_text())["disk_device"]
    assert f"{run}: finished, 8 steps" in out


def test_two_runs_side_by_side(trained, tmp_path, capsys):
    out = tmp_path / "both"
    code, _, err = run_cli(["report", *trained, "--out", out], capsys)
    assert code == 0, err
    report = json.loads((out / "report.json").read_text())
    assert [r["run_dir"] for r in report["runs"]] == [str(p) for p in trained]
    header = (out / "report.md").read_text().splitlines()[2]
    assert header == "| | a | b |"
    a, b = report["runs"]
    validated = [json.loads(line) for line in (trained[1] / "metrics.jsonl").read_text().splitlines()]
    validated = [r["val_dice"] for r in validated if "val_dice" in r]
    assert len(validated) == 2
    assert a["last_val_dice"] is None
    assert (b["last_val_dice"], b["best_val_dice"]) == (validated[-1], max(validated))
    assert f"| validation Dice last / best | - / - | {validated[-1]:.3f} / {max(validated):.3f} |" in (
        out / "report.md").read_text()


def test_a_running_run_with_a_torn_row(trained, tmp_path, capsys):
    running = tmp_path / "running"
    shutil.copytree(trained[0], running)
    (running / "summary.json").unlink()
    with open(running / "monitor.csv", "a") as handle:
        handle.write("99.0,12")  # a row being written
    code, _, err = run_cli(["report", running], capsys)
    assert code == 0, err
    (summary,) = json.loads((running / "report" / "report.json").read_text())["runs"]
    assert summary["state"] == "running or stopped"
    assert summary["monitor_samples"] == len(_monitor_rows(trained[0]))


def test_bad_run_directories(tmp_path, capsys):
    code, _, err = run_cli(["report", tmp_path / "nope"], capsys)
    assert code == 1
    assert "no such directory" in err
    assert len(err.strip().splitlines()) == 1
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(["report", tmp_path / "empty"], capsys)
    assert code == 1
    assert "neither metrics.jsonl nor monitor.csv" in err
    code, _, err = run_cli(["report", tmp_path, tmp_path, tmp_path], capsys)
    assert code == 2
    assert "one or two RUN_DIRs" in err


def test_monitor_interval_flag(tiny_store, tmp_path, capsys):
    code, _, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 1,
                            "--monitor-interval", "-1", "--out", tmp_path / "r"], capsys)
    assert code == 2
    assert "Invalid --monitor-interval -1" in err
    code, _, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 2,
                            "--monitor-interval", "0", "--out", tmp_path / "off"], capsys)
    assert code == 0, err
    assert not (tmp_path / "off" / "monitor.csv").exists()
