"""``bigmem train --resume``: the same command continues a run, a finished one is left alone, a run
that failed before its first checkpoint starts over, a damaged checkpoint is skipped."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bigmem.rundir import read_jsonl
from helpers import copy_store, run_cli


def command(out: Path, store: Path, *extra) -> list:
    return ["train", "--model", "tiny", "--data", store, "--volume", 16, "--seed", 1, "--out", out, *extra]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder``: its bytes and modification time."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def forget_after(run: Path, step: int) -> None:
    """Make ``run`` look killed right after its checkpoint at ``step`` (later ones, summary and model gone)."""
    for ckpt in (run / "checkpoints").glob("ckpt-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    for name in ("summary.json", "model.keras"):
        (run / name).unlink(missing_ok=True)


def losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_jsonl(run / "metrics.jsonl")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_store) -> Path:
    """An uninterrupted 6-step run (checkpoints at 2, 4, 6): the trajectory a resume must follow."""
    out = tmp_path_factory.mktemp("straight") / "run"
    from bigmem.cli.main import main

    assert main([str(a) for a in command(out, tiny_store, "--steps", 6, "--checkpoint-every", 2)]) == 0
    return out


@pytest.fixture
def finished(tmp_path, straight) -> Path:
    out = tmp_path / "run"
    shutil.copytree(straight, out)
    return out


@pytest.mark.parametrize("extra, message", [
    ([], "finished at step 6 of 6"),
    (["--steps", 6], "finished at step 6 of 6"),
    (["--steps", 2], "is at step 6 (ckpt-00000006), past the 2 steps asked for"),
    (["--time-budget", 100], "finished at step 6 of 6"),
])
def test_a_resume_with_nothing_to_do_says_so_and_changes_nothing(finished, tiny_store, capsys, extra, message):
    before = snapshot(finished)
    code, stdout, err = run_cli(["train", "--out", finished, "--resume", *extra], capsys)
    assert (code, err) == (0, "")
    assert stdout.strip() == (f"Nothing to do: {finished} {message}; nothing was changed. To train longer, resume "
                              "asking for more than 6 steps.")
    assert snapshot(finished) == before
    code, stdout, err = run_cli(command(finished, tiny_store, "--steps", 6, "--resume"), capsys)  # the same command
    assert (code, err) == (0, "")
    assert stdout.startswith("Nothing to do:")
    assert snapshot(finished) == before


def test_the_same_command_plus_resume_continues_the_run(finished, straight, tiny_store, capsys):
    forget_after(finished, 4)
    code, stdout, err = run_cli(command(finished, tiny_store, "--steps", 6, "--checkpoint-every", 2, "--resume"),
                                capsys)
    assert code == 0, err
    assert "Resuming" in stdout
    assert "from ckpt-00000004 (step 4 of 6)" in stdout
    assert [r["step"] for r in read_jsonl(finished / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert losses(finished) == pytest.approx(losses(straight), rel=1e-4, abs=1e-5)
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["loss"] == pytest.approx(losses(straight)[-1], rel=1e-4)


def test_settings_that_may_change_on_resume(finished, tiny_store, capsys):
    code, stdout, err = run_cli(command(finished, tiny_store, "--resume", "--steps", 8, "--num-workers", 1,
                                        "--time-budget", 300, "--monitor-interval", 0, "--checkpoint-every", 4),
                                capsys)
    assert code == 0, err
    config = json.loads((finished / "config.json").read_text())
    assert config["total_steps"] == 8
    assert config["data"]["num_workers"] == 1
    assert config["train"]["checkpoint_every"] == 4
    assert config["train"]["seed"] == 1
    assert [r["step"] for r in read_jsonl(finished / "metrics.jsonl")] == list(range(1, 9))


def test_a_store_spelled_another_way_is_the_same_store(finished, tiny_store, capsys, monkeypatch):
    monkeypatch.chdir(tiny_store.parent)
    code, stdout, err = run_cli(command(finished, Path(".") / tiny_store.name, "--resume"), capsys)
    assert (code, err) == (0, "")
    assert stdout.startswith("Nothing to do:")


def test_a_run_started_with_a_relative_store_resumes_from_another_folder(tmp_path, tiny_store, capsys, monkeypatch):
    (tmp_path / "data").mkdir()
    copy_store(tiny_store, tmp_path / "data" / "s.h5")
    monkeypatch.chdir(tmp_path / "data")
    code, _, err = run_cli(command(tmp_path / "run", Path("s.h5"), "--steps", 2), capsys)
    assert code == 0, err
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["data"]["store"]
    assert saved == str(tmp_path / "data" / "s.h5")  # absolute: it names the file from anywhere
    monkeypatch.chdir(tmp_path)  # the same store spelled from here, then not given at all
    code, stdout, err = run_cli(command(tmp_path / "run", Path("data") / "s.h5", "--steps", 3, "--resume"), capsys)
    assert (code, err) == (0, "")
    assert "from ckpt-00000002 (step 2 of 3)" in stdout
    code, stdout, err = run_cli(["train", "--out", tmp_path / "run", "--steps", 4, "--resume"], capsys)
    assert (code, err) == (0, "")
    assert "from ckpt-00000003 (step 3 of 4)" in stdout


def test_flags_that_differ_from_the_saved_run_are_refused_each_named(finished, tiny_store, tmp_path, capsys):
    before = snapshot(finished)
    other = copy_store(tiny_store, tmp_path / "other.h5")
    code, _, err = run_cli(["train", "--model", "small", "--data", other, "--volume", 32, "--lr", "0.01",
                            "--seed", 1, "--precision", "bf16", "--steps", 9, "--out", finished, "--resume"], capsys)
    assert code == 2
    assert err.strip() == (
        f"bigmem train: error: Cannot resume {str(finished)!r} with settings that differ from the saved run: "
        f"--model small (saved: tiny); --shape 32,32,32 (saved: 16,16,16); --data {other} (saved: {tiny_store}); "
        "--precision bf16 (saved: fp32); --lr 0.01 (saved: 0.003). Only --steps, --epochs, --time-budget, "
        "--monitor-interval, --checkpoint-every, --val-every, --num-workers, --prefetch, --cold-cache, "
        "--memory-budget, --numa, --cpus, --threads may change when resuming: repeat the saved values (or leave "
        "those flags out), or start a new run with another --out.")
    assert snapshot(finished) == before


def _quiet():
    import io

    from rich.console import Console

    return Console(file=io.StringIO(), soft_wrap=True)


def test_a_python_resume_with_changed_settings_is_refused_as_the_command_line_refuses(finished, tiny_store, capsys):
    from bigmem.cli.common import flag_for
    from bigmem.config import resolve_config
    from bigmem.errors import EXIT_USAGE, ConfigError
    from bigmem.train.trainer import train

    forget_after(finished, 4)  # steps are left to run: the refusal is the settings' alone
    before = snapshot(finished)
    code, _, err = run_cli(command(finished, tiny_store, "--steps", 6, "--lr", "0.01", "--resume"), capsys)
    config = resolve_config("tiny", {"data": {"store": str(tiny_store), "shape": [16, 16, 16]},
                                     "train": {"seed": 1, "steps": 6, "checkpoint_every": 2, "lr": 0.01}})
    with pytest.raises(ConfigError) as refused:
        train(config, finished, resume=True, console=_quiet())
    assert code == refused.value.exit_code == EXIT_USAGE
    assert err.strip() == f"bigmem train: error: {refused.value.render(flag_for)}"  # the same message
    assert str(refused.value).startswith(f"Cannot resume {str(finished)!r} with settings that differ from the saved "
                                         "run: train.lr 0.01 (saved: 0.003). Only train.steps, train.epochs, ")
    assert snapshot(finished) == before
    # the saved settings, with only what may change changed: the run continues where it stopped
    result = train(config.updated({"train": {"lr": 0.003, "time_budget_s": 300}}), finished, resume=True,
                   console=_quiet())
    assert (result.start_step, result.final_step) == (4, 6)


def test_a_python_resume_of_a_synthetic_run_compares_the_store_it_stands_for(tmp_path):
    from bigmem.config import resolve_config
    from bigmem.errors import ConfigError
    from bigmem.train.trainer import train

    run = tmp_path / "run"
    assert train(resolve_config("tiny", {"train": {"steps": 2}}), run, console=_quiet()).final_step == 2
    result = train(resolve_config("tiny", {"train": {"steps": 3}}), run, resume=True, console=_quiet())
    assert (result.start_step, result.final_step) == (2, 3)
    # every field is compared, named in the config's order
    with pytest.raises(ConfigError, match=r"saved run: model\.base_filters 8 \(saved: 4\); train\.seed 5 "
                                          r"\(saved: 0\)\. Only train\.steps, "):
        train(resolve_config("tiny", {"model": {"base_filters": 8}, "train": {"seed": 5}}), run, resume=True,
              console=_quiet())


def test_the_saved_model_named_again_is_accepted(finished, capsys):
    code, stdout, err = run_cli(["train", "--model", "tiny", "--out", finished, "--resume"], capsys)
    assert (code, err) == (0, "")
    assert stdout.startswith("Nothing to do:")


def _poison_the_third_sample(handle) -> None:
    """A label past the classes in the case the third step reads (seed 1, batch 1)."""
    from bigmem.data.pipeline import case_for_sample

    case = sorted(handle["cases"])[case_for_sample(2, len(handle["cases"]), 1)]
    labels = handle[f"cases/{case}/label"]
    values = labels[...]
    values[0, 0, 0] = 9
    labels[...] = values


def test_a_run_that_failed_before_its_first_checkpoint_leaves_nothing_and_reruns(
        tmp_path, tiny_store, corrupt_store, capsys, straight):
    """A case refused as it is read, before any checkpoint: the run directory goes, and the same command reruns."""
    store = corrupt_store(_poison_the_third_sample)
    out = tmp_path / "run"
    argv = command(out, store, "--steps", 6, "--checkpoint-every", 6)
    code, _, err = run_cli(argv, capsys)
    assert code == 1
    assert "label value 9 >= number of classes 3" in err
    assert not out.exists()
    copy_store(tiny_store, store)  # the store, fixed in place
    code, _, err = run_cli(argv, capsys)
    assert code == 0, err
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert losses(out) == pytest.approx(losses(straight), rel=1e-4, abs=1e-5)


def test_a_run_with_a_checkpoint_is_never_started_over(finished, tiny_store, capsys):
    forget_after(finished, 4)
    before = snapshot(finished)
    code, _, err = run_cli(command(finished, tiny_store, "--steps", 6), capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Run directory {str(finished)!r} already holds a run: pass "
                           "--resume to continue it, or choose another --out.")
    assert snapshot(finished) == before


def test_resume_where_no_run_was_started(tmp_path, tiny_store, capsys):
    out = tmp_path / "run"
    code, _, err = run_cli(["train", "--out", out, "--resume"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Cannot resume {str(out)!r}: no config.json there (is it a bigmem "
                           "run directory?). To start a run there, give its flags (--model ...) or leave out --resume.")
    assert not out.exists()
    # the whole command plus --resume starts it (after a kill during start-up, before config.json)
    code, stdout, err = run_cli(command(out, tiny_store, "--steps", 2, "--resume"), capsys)
    assert code == 0, err
    assert f"No run was started in {out} yet: starting it." in stdout
    assert json.loads((out / "summary.json").read_text())["steps"] == 2


def test_a_run_killed_at_its_last_checkpoint_is_finished_by_resume(finished, straight, capsys):
    forget_after(finished, 6)  # killed after the last checkpoint, while writing model.keras
    (finished / ".model.tmp-99999.keras").write_bytes(b"half a model")
    (finished / ".numa.tmp-99999-3.json").write_text('{"requested": ')
    (finished / ".config.json.x1y2z3.tmp").write_text("{")
    code, stdout, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 0, err
    assert "from ckpt-00000006 (step 6 of 6)" in stdout
    assert not list(finished.glob(".*"))  # the killed run's temporaries are gone
    summary = json.loads((finished / "summary.json").read_text())
    assert summary["steps"] == 6
    assert summary["loss"] == pytest.approx(losses(straight)[-1], rel=1e-6)
    assert (finished / "model.keras").exists()
    assert [r["step"] for r in read_jsonl(finished / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_a_stale_summary_does_not_make_an_extended_run_finished(finished, capsys):
    """Extended from 6 to 8 steps and killed after its checkpoint at 8: summary.json still says 6."""
    assert run_cli(["train", "--out", finished, "--resume", "--steps", 8, "--checkpoint-every", 2], capsys)[0] == 0
    summary = json.loads((finished / "summary.json").read_text())
    (finished / "summary.json").write_text(json.dumps({**summary, "steps": 6}))
    code, stdout, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 0, err
    assert "from ckpt-00000008 (step 8 of 8)" in stdout
    assert json.loads((finished / "summary.json").read_text())["steps"] == 8


def test_a_damaged_newest_checkpoint_is_skipped_and_kept_aside(finished, straight, capsys):
    forget_after(finished, 6)
    checkpoints = finished / "checkpoints"
    (checkpoints / "ckpt-00000006" / "state.json").write_text("")  # zeroed by a power loss, say
    variables = checkpoints / "ckpt-00000004" / "variables.h5"
    size = variables.stat().st_size
    variables.write_bytes(variables.read_bytes()[:1000])  # truncated
    code, stdout, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 0, err
    lines = stdout.splitlines()
    assert lines[lines.index(next(line for line in lines if line.startswith("Skipped"))):][:3] == [
        f"Skipped checkpoint ckpt-00000006: state.json: Expecting value: line 1 column 1 (char 0); kept aside as "
        f"{checkpoints / '.damaged-ckpt-00000006'}.",
        "Skipped checkpoint ckpt-00000004: variables.h5: Unable to synchronously open file (truncated file: eof = "
        f"1000, sblock->base_addr = 0, stored_eof = {size}); kept aside as "
        f"{checkpoints / '.damaged-ckpt-00000004'}.",
        f"Resuming {finished} from ckpt-00000002 (step 2 of 6).",
    ]
    assert losses(finished) == pytest.approx(losses(straight), rel=1e-4, abs=1e-5)
    assert sorted(p.name for p in checkpoints.iterdir()) == [".damaged-ckpt-00000004", ".damaged-ckpt-00000006",
                                                              "ckpt-00000002", "ckpt-00000004", "ckpt-00000006"]


def test_no_checkpoint_loads(finished, capsys):
    forget_after(finished, 6)
    checkpoints = finished / "checkpoints"
    for ckpt in checkpoints.glob("ckpt-*"):
        (ckpt / "state.json").write_text("{")
    code, _, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 1
    assert err.strip() == (
        f"bigmem train: error: No checkpoint in {checkpoints} loads: ckpt-00000006: state.json: Expecting property "
        "name enclosed in double quotes: line 1 column 2 (char 1) (kept aside as .damaged-ckpt-00000006); "
        "ckpt-00000004: state.json: Expecting property name enclosed in double quotes: line 1 column 2 (char 1) "
        "(kept aside as .damaged-ckpt-00000004); ckpt-00000002: state.json: Expecting property name enclosed in "
        "double quotes: line 1 column 2 (char 1) (kept aside as .damaged-ckpt-00000002). Start a new run with "
        "another --out.")
    # the run is not silently started over: the damaged checkpoints are still there, aside
    code, _, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 1
    assert err.strip() == (
        f"bigmem train: error: Cannot resume {str(finished)!r}: it has no complete checkpoint (looked in "
        f"{checkpoints}) but holds checkpoints/.damaged-ckpt-00000002, checkpoints/.damaged-ckpt-00000004, "
        "checkpoints/.damaged-ckpt-00000006. Start a new run with another --out.")


def test_a_torn_config_is_named(finished, capsys):
    (finished / "config.json").write_text('{"model": {"name": "ti')
    code, _, err = run_cli(["train", "--out", finished, "--resume"], capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Cannot resume {str(finished)!r}: its config.json cannot be read "
                           "(Unterminated string starting at: line 1 column 20 (char 19)).")


def test_a_run_directory_in_use_is_refused(finished, tiny_store, capsys):
    from bigmem.train.trainer import exclusive_run_dir

    forget_after(finished, 4)
    before = snapshot(finished)
    with exclusive_run_dir(finished):  # as another process running it holds it
        code, _, err = run_cli(command(finished, tiny_store, "--steps", 6, "--resume"), capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Run directory {str(finished)!r} is in use by another bigmem train "
                           "process: wait for it to end, or choose another --out.")
    assert snapshot(finished) == before


def test_the_run_directory_is_made_only_once_the_job_is_prepared(tmp_path, tiny_store, capsys, monkeypatch):
    """Every refusal, and the tuning pass, happen in prepare_job: the directory does not exist during it."""
    import bigmem.train.trainer as trainer

    out, existed = tmp_path / "new" / "run", []
    real = trainer.prepare_job

    def watched(*args, **kwargs):
        existed.append(out.exists() or out.parent.exists())
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "prepare_job", watched)
    code, _, err = run_cli(command(out, tiny_store), capsys)
    assert code == 0, err
    assert existed == [False]
    assert (out / "summary.json").exists()


def test_a_refused_run_leaves_no_folder_behind(tmp_path, tiny_store, capsys):
    out = tmp_path / "new" / "run"
    code, _, err = run_cli(command(out, tiny_store, "--memory-budget", "1KiB"), capsys)
    assert code == 3, err
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("not a folder")
    code, _, err = run_cli(command(tmp_path / "file", tiny_store), capsys)
    assert code == 1
    assert err.strip() == (f"bigmem train: error: Run directory {str(tmp_path / 'file')!r} is a file, not a folder: "
                           "choose another --out.")


def test_a_python_resume_asking_for_the_default_keeps_what_the_run_resolved(tmp_path):
    """train(config, resume=True) with data.augment 'auto' goes on with the chain the run resolved and saved."""
    import json

    from bigmem.config import resolve_config
    from bigmem.rundir import RunDir
    from bigmem.train.resume import check_resumed_config

    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    saved = resolve_config("tiny").updated({"data": {"augment": "light", "store": str(tmp_path / "x.h5")},
                                            "model": {"region_outputs": False}}).to_dict()
    run.config.write_text(json.dumps(saved))
    wanted = resolve_config("tiny").updated({"data": {"store": str(tmp_path / "x.h5")}})
    assert wanted.data.augment.value == "auto"
    resumed = check_resumed_config(run, wanted)
    assert resumed.data.augment.value == "light"
    assert resumed.model.region_outputs is False
