"""``bigmem plan --data`` configures an experiment; ``bigmem train --plan`` / ``--model auto`` trains it."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli
from data.test_experiment import kits_like


@pytest.fixture(scope="module")
def kits_store(tmp_path_factory):
    return kits_like(tmp_path_factory.mktemp("kits") / "kits.h5")


@pytest.fixture(scope="module")
def planned(kits_store, tmp_path_factory):
    """``bigmem plan --data`` of the KiTS-like store, in its own folder: (exit code, stdout, plan.json)."""
    from bigmem.cli.main import main

    out = tmp_path_factory.mktemp("plan") / "plan.json"
    code = main(["plan", "--data", str(kits_store), "--memory-budget", "8GiB", "--out", str(out)])
    return code, out


def test_plan_data_writes_the_experiment_beside_plan_json(planned):
    code, out = planned
    assert code == 0
    experiment = json.loads(out.read_text())["experiment"]
    assert experiment["preset"] == str(out.parent / "experiment.toml")
    assert (out.parent / "experiment.toml").is_file()
    assert experiment["strides"] == [[1, 1, 1], [1, 2, 2], [2, 2, 2], [1, 2, 2]]
    assert experiment["resampling"] is None


def test_plan_data_caps_the_batch_by_the_dataset(planned):
    # 3 cases of 10, 12 and 15 x 32 x 32: a batch steps at 16 x 32 x 32, so 5% of the dataset is far under one
    # sample and the cap is nnU-Net's floor of 2; 8 GiB alone would take many more.
    plan = json.loads(planned[1].read_text())
    assert plan["batch_cap"]["cap"] == 2
    assert plan["batch_cap"]["uncapped"] > 2
    assert plan["chosen"]["batch_size"] == 2


def test_plan_data_with_a_preset_caps_the_batch_too(kits_store, tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--data", kits_store, "--model", "tiny", "--memory-budget", "8GiB",
                                 "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["chosen"]["batch_size"] == 2
    assert plan["experiment"] is None
    assert "batch: 2, capped by the dataset (memory alone allows " in stdout


def test_train_plan_trains_the_configured_network(planned, kits_store, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--plan", planned[1], "--data", kits_store, "--steps", 1, "--out", run,
                            "--monitor-interval", 0, "--no-tune"], capsys)
    assert code == 0, err
    config = json.loads((run / "config.json").read_text())
    assert config["model"]["name"] == "experiment"
    assert config["model"]["kernel_sizes"][0] == [1, 3, 3]
    assert config["train"]["batch_size"] == 2


def test_train_model_auto_configures_from_the_store(kits_store, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = run_cli(["train", "--model", "auto", "--data", kits_store, "--steps", 1, "--out", run,
                            "--monitor-interval", 0, "--no-tune"], capsys)
    assert code == 0, err
    model = json.loads((run / "config.json").read_text())["model"]
    assert (model["name"], model["strides"][1]) == ("auto", [1, 2, 2])


@pytest.mark.parametrize("argv,message", [
    (["train", "--model", "auto", "--steps", 1], "--model auto configures the network from a store's cases: give "
                                                 "--data."),
    (["plan", "--model", "auto"], "--model auto configures the network from a store's cases: give --data."),
    (["train", "--plan", "{plan}", "--model", "small"], "The plan {plan} names the network to train: leave out "
                                                        "--model small."),
    (["train", "--plan", "{tmp}/none.toml"], "Cannot read the plan {tmp}/none.toml: no such file; expected the "
                                             "experiment.toml (or plan.json) bigmem plan --data wrote."),
])
def test_plan_and_auto_refuse_what_they_cannot_use(argv, message, planned, tmp_path, capsys):
    fill = {"plan": str(planned[1]), "tmp": str(tmp_path)}
    code, _, err = run_cli([str(a).format(**fill) for a in argv], capsys)
    assert code in (1, 2)
    assert message.format(**fill) in err


def test_train_plan_of_a_preset_plan_names_the_model_to_give(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "tiny", "--volume", 16, "--memory-budget", "2GiB", "--out", out],
                           capsys)
    assert code == 0, err
    code, _, err = run_cli(["train", "--plan", out], capsys)
    assert code == 2
    assert f"The plan {out} was planned for a preset, not configured from a store" in err
