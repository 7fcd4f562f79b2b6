"""The pre-flight memory check of ``bigmem train`` and the recompute savers' equivalence."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bigmem.rundir import read_jsonl
from helpers import run_cli


def test_refuses_what_does_not_fit(tmp_path, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "small", "--volume", 128, "--memory-budget", "1GiB",
                            "--out", out], capsys)
    assert code == 3
    assert err.startswith("bigmem train: error: Predicted peak ")
    assert "for small at 128^3 x batch 2 (fp32) exceeds the memory budget 1.00 GiB (--memory-budget): " in err
    assert err.strip().endswith("; or pass --force to try anyway.")
    assert not out.exists()


def test_volume_512_refuses_with_required_and_available(tmp_path):
    result = subprocess.run([sys.executable, "-m", "bigmem", "train", "--volume", "512", "--out",
                             str(tmp_path / "run")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3
    assert "Predicted peak " in result.stderr and "(MemAvailable)" in result.stderr
    assert "Traceback" not in result.stderr


def test_force_trains_anyway_and_plan_json_says_so(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, stdout, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 1, "--memory-budget",
                                 "1MiB", "--force", "--out", out], capsys)
    assert code == 0, err
    assert "over budget, forced" in stdout
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] is False and plan["forced"] is True and plan["budget_bytes"] == 2**20
    assert plan["predicted_peak_bytes"] == sum(plan["components"].values())


def test_plan_json_in_every_run(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    assert run_cli(["train", "--model", "tiny", "--data", tiny_store, "--steps", 1, "--out", out], capsys)[0] == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["fits"] is True and plan["budget_source"] == "MemAvailable"
    chosen = {k: plan["chosen"][k] for k in ("volume", "batch_size", "precision", "recompute", "recompute_stages",
                                             "partitioned_stages")}
    assert chosen == {"volume": 16, "batch_size": 1, "precision": "fp32", "recompute": "none",
                      "recompute_stages": [], "partitioned_stages": []}
    # plan.json is bigmem plan's schema (Plan.to_dict): the chosen candidate's breakdown and step time too.
    assert plan["chosen"]["components"] == plan["components"] and plan["chosen"]["step_rate_source"]
    assert plan["candidates"] == [plan["closest"]] and plan["best_per_mode"] == [plan["closest"]]


@pytest.mark.parametrize("mode", ["stages", "auto"])
def test_recompute_gives_the_same_training(tmp_path, tiny_store, capsys, mode):
    base = ["train", "--model", "tiny", "--data", tiny_store, "--steps", 3, "--seed", 4]
    assert run_cli([*base, "--out", tmp_path / "plain"], capsys)[0] == 0
    extra = ["--recompute", mode] + (["--memory-budget", "1MiB", "--force"] if mode == "auto" else [])
    code, _, err = run_cli([*base, *extra, "--out", tmp_path / mode], capsys)
    assert code == 0, err
    plan = json.loads((tmp_path / mode / "plan.json").read_text())
    # stages: every stage; auto with a budget nothing fits: it ends up recomputing every stage too.
    assert sorted(plan["chosen"]["recompute_stages"]) == ["dec0", "dec1", "enc0", "enc1", "enc2"]
    plain = read_jsonl(tmp_path / "plain" / "metrics.jsonl")
    again = read_jsonl(tmp_path / mode / "metrics.jsonl")
    for a, b in zip(plain, again):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-5)


def test_bf16_without_native_support_says_it_is_emulated(tmp_path, tiny_store, capsys, monkeypatch):
    from helpers import run_cli

    for native, warned in (("0", True), ("1", False)):
        monkeypatch.setenv("BIGMEM_NATIVE_BF16", native)
        code, out, err = run_cli(["train", "--model", "tiny", "--data", tiny_store, "--out", tmp_path / native,
                                  "--steps", 1, "--precision", "bf16", "--monitor-interval", 0], capsys)
        assert code == 0, err
        assert ("bf16 is emulated, about 20x slower than fp32" in out) == warned
