"""``bigmem train`` end to end on tiny presets: run directory, resume, signals, bad input."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import keras
import numpy as np
import pytest

from bigmem.rundir import read_jsonl
from helpers import run_cli

METRIC_FIELDS = {"step", "loss", "dice", "lr", "voxels_per_s", "rss_bytes", "input_wait_s", "step_s", "shape"}


def tiny_train(out: Path, store: Path, *extra) -> list:
    return ["train", "--model", "tiny", "--data", store, "--out", out, *extra]


def test_run_directory_contract(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(tiny_train(out, tiny_store, "--steps", 4, "--seed", 3), capsys)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == [
        "checkpoints", "config.json", "metrics.jsonl", "model.keras", "monitor.csv", "monitor.json", "numa.json",
        "plan.json", "preprocessing.json", "summary.json", "sysinfo.json", "tensorboard"]
    config = json.loads((out / "config.json").read_text())
    assert config["model"]["name"] == "tiny"
    assert config["train"]["seed"] == 3
    assert config["data"]["store"] == str(tiny_store)
    assert config["total_steps"] == 4
    sysinfo = json.loads((out / "sysinfo.json").read_text())
    assert sysinfo["tensorflow"]["keras"].startswith("3.")
    assert sysinfo["numa"]["nodes"]
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for row in rows:
        assert set(row) == METRIC_FIELDS
        assert np.isfinite(row["loss"])
        assert 0.0 <= row["dice"] <= 1.0
        assert row["voxels_per_s"] > 0
        assert row["rss_bytes"] > 50 * 2**20
        assert row["lr"] > 0
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["ckpt-00000002", "ckpt-00000004"]
    model = keras.models.load_model(out / "model.keras")
    assert model.count_params() == 10_135
    assert "Done: step 4" in stdout
    assert not [p for p in out.rglob(".*")]  # no temporaries


def test_training_reduces_the_loss(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(tiny_train(out, tiny_store, "--steps", 40, "--lr", "1e-2", "--checkpoint-every", 40),
                           capsys)
    assert code == 0, err
    losses = [r["loss"] for r in read_jsonl(out / "metrics.jsonl")]
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_resume_continues_the_same_trajectory(tmp_path, tiny_store, capsys):
    import shutil

    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ["--steps", 6, "--checkpoint-every", 3, "--seed", 1]
    assert run_cli(tiny_train(straight, tiny_store, *common), capsys)[0] == 0
    # The same run in another folder (a run directory names no folder of its own, so a copy is that run:
    # training it again would give the same files, as the comparison below relies on anyway) ...
    shutil.copytree(straight, split)
    # ... and there everything after step 3 forgotten, as if the run had died there.
    for path in (split / "checkpoints" / "ckpt-00000006", split / "model.keras"):
        os.system(f"rm -rf '{path}'")
    rows = read_jsonl(split / "metrics.jsonl")
    (split / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:4]) + '{"step": 5, "lo')
    code, stdout, err = run_cli(["train", "--out", split, "--resume"], capsys)
    assert code == 0, err
    assert "from ckpt-00000003 (step 3 of 6)" in stdout
    a, b = read_jsonl(straight / "metrics.jsonl"), read_jsonl(split / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(a, b):
        assert rb["lr"] == pytest.approx(ra["lr"], rel=1e-6)
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-4, abs=1e-5)


def test_resume_can_extend_a_finished_run(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    assert run_cli(tiny_train(out, tiny_store, "--steps", 2), capsys)[0] == 0
    code, stdout, err = run_cli(["train", "--out", out, "--resume", "--steps", 4], capsys)
    assert code == 0, err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4]
    assert json.loads((out / "config.json").read_text())["total_steps"] == 4


def test_bf16_precision(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(tiny_train(out, tiny_store, "--steps", 2, "--precision", "bf16"), capsys)
    assert code == 0, err
    assert keras.models.load_model(out / "model.keras").dtype_policy.name == "mixed_bfloat16"


def test_sgd_and_worker_processes(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(tiny_train(out, tiny_store, "--steps", 2, "--optimizer", "sgd", "--num-workers", 1),
                           capsys)
    assert code == 0, err
    assert json.loads((out / "config.json").read_text())["train"]["optimizer"] == "sgd"


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_store, capsys, monkeypatch):
    from bigmem.distribute.execution import SingleProcess

    real = SingleProcess.make_step

    def poisoned(self, model, optimizer, **functions):
        step = real(self, model, optimizer, **functions)

        def wrapped(images, labels):
            loss, dice = step(images, labels)
            return (loss * np.nan if int(optimizer.iterations.numpy()) >= 3 else loss), dice

        return wrapped

    monkeypatch.setattr(SingleProcess, "make_step", poisoned)
    out = tmp_path / "run"
    code, _, err = run_cli(tiny_train(out, tiny_store, "--steps", 6), capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Loss is nan at step 3: training stopped; the newest good checkpoint "
                           f"is {out / 'checkpoints' / 'ckpt-00000002'}. Try a lower --lr or --precision fp32.")
    assert not (out / "model.keras").exists()
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("argv_tail, code, message", [
    (["--model", "smal"], 2, "Unknown preset 'smal' (--model): expected one of intelai-brats, kits19, resenc-m, small, "
                             "tiny or a path to a .toml file. Did you mean 'small'?"),
    (["--model", "tiny", "--volume", "18"], 2, "Invalid --volume 18: expected a multiple of 4 (the network "
                                               "downsamples 2 times). Try --volume 16 or 20."),
    (["--model", "tiny", "--shape", "50,50,50"], 2, "Invalid --shape 50,50,50: axes 1, 2 and 3 (50, 50, 50) are not "
                                                    "multiples of 4 (the network downsamples 2 times). Try --shape "
                                                    "48,48,48 or 52,52,52."),
    (["--data", "missing.h5"], 1, "Cannot open store 'missing.h5' (--data): no such file."),
    (["--resume"], 2, "--resume needs --out RUN_DIR: the run to continue."),
])
def test_flag_errors(tmp_path, capsys, monkeypatch, argv_tail, code, message):
    monkeypatch.chdir(tmp_path)
    got, _, err = run_cli(["train", *argv_tail], capsys)
    assert got == code
    assert err.strip() == f"bigmem train: error: {message}"
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()


def test_existing_run_needs_resume(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    assert run_cli(tiny_train(out, tiny_store, "--steps", 1), capsys)[0] == 0
    code, _, err = run_cli(tiny_train(out, tiny_store, "--steps", 1), capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Run directory {str(out)!r} already holds a run: pass --resume to "
                           "continue it, or choose another --out.")


def test_bad_case_is_named_and_nothing_is_half_written(tmp_path, corrupt_store, capsys):
    from helpers import poison_labels

    out = tmp_path / "run"
    code, _, err = run_cli(tiny_train(out, corrupt_store(poison_labels(5, (3, 3, 3))), "--steps", 2), capsys)
    assert code == 1
    assert err.startswith("bigmem train: error: Case 'synth_000")
    assert "label value 5 >= number of classes 3" in err
    assert "Traceback" not in err
    assert not out.exists()


def _poison_image(handle) -> None:
    """A mutate() for corrupt_store: one NaN voxel in every case's image, its recorded count left at 0."""
    for case in handle["cases"]:
        data = handle[f"cases/{case}/image"]
        values = data[...]
        values.flat[0] = np.nan
        data[...] = values


@pytest.mark.parametrize("poison, flags, code, message", [
    ("label", [], 1, "label value 5 >= number of classes 3"),
    ("nan", [], 1, "image has 1 non-finite values (NaN/Inf)"),
    (None, ["--memory-budget", "1MiB"], 3, "exceeds the memory budget 1.00 MiB (--memory-budget)"),
    (None, ["--memory-budget", "1000TiB"], 3, "is more than this machine's memory"),
    (None, ["--memory-budget", "lots"], 2, "Invalid --memory-budget 'lots'"),
], ids=["bad-label", "nan-voxel", "does-not-fit", "budget-above-machine", "bad-budget"])
def test_a_refused_run_leaves_no_run_directory(tmp_path, tiny_store, corrupt_store, capsys, poison, flags, code,
                                               message):
    from helpers import poison_labels

    poisons = {"label": poison_labels(5, (3, 3, 3)), "nan": _poison_image}
    store = corrupt_store(poisons[poison]) if poison else tiny_store
    out = tmp_path / "runs" / "run"
    got, _, err = run_cli(tiny_train(out, store, "--steps", 2, *flags), capsys)
    assert got == code
    assert message in err
    assert len(err.strip().splitlines()) == 1
    assert not out.exists()
    assert not (tmp_path / "runs").exists()


def test_a_refused_run_keeps_the_folder_the_user_had(tmp_path, corrupt_store, capsys):
    from helpers import poison_labels

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    code, _, err = run_cli(tiny_train(out, corrupt_store(poison_labels(5, (3, 3, 3))), "--steps", 2), capsys)
    assert code == 1
    assert "label value 5 >= number of classes 3" in err
    assert (out / "notes.txt").read_text() == "mine"


def _start(out: Path, store: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bigmem", "train", "--model", "tiny", "--data", str(store), "--volume", "32",
           "--steps", str(steps), "--checkpoint-every", "5", "--out", str(out)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_checkpoint(process: subprocess.Popen, out: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not list((out / "checkpoints").glob("ckpt-*")):
        if process.poll() is not None:
            pytest.fail(f"training ended before its first checkpoint: {process.communicate()}")
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("no checkpoint appeared")
        time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_then_resume_continues_from_the_checkpoint(tmp_path, tiny_store):
    out = tmp_path / "run"
    process = _start(out, tiny_store, steps=400)
    _wait_for_checkpoint(process, out)
    process.send_signal(signal.SIGKILL)
    process.wait()
    from bigmem.checkpoints import CheckpointManager

    latest = CheckpointManager(out / "checkpoints").latest()
    assert latest is not None
    saved_step = int(latest.name.split("-")[1])
    assert saved_step < 400
    final = saved_step + 5  # one more checkpoint interval: the steps after the kill are trained, none twice
    resumed = subprocess.run([sys.executable, "-m", "bigmem", "train", "--out", str(out), "--resume", "--steps",
                              str(final)], capture_output=True, text=True)
    assert resumed.returncode == 0, resumed.stderr
    assert f"from {latest.name} (step {saved_step} of" in resumed.stdout
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl")]
    assert steps == list(range(1, final + 1))
    assert (out / "model.keras").exists()


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint_and_exits(tmp_path, tiny_store):
    out = tmp_path / "run"
    process = _start(out, tiny_store, steps=100000)
    _wait_for_checkpoint(process, out)
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM, stderr
    assert "Stopped by signal 15 at step" in stdout
    stopped_at = int(stdout.split("Stopped by signal 15 at step ")[1].split(";")[0])
    from bigmem.checkpoints import CheckpointManager

    assert CheckpointManager(out / "checkpoints").latest().name == f"ckpt-{stopped_at:08d}"
    assert read_jsonl(out / "metrics.jsonl")[-1]["step"] == stopped_at
    assert not (out / "model.keras").exists()
