"""``bigmem.api.tune``, ``machine_tuning``, ``export``, ``info``, ``synth`` and ``report`` from Python, without the
command line: what each returns and writes, the errors it names as settings, and that none prints."""

from __future__ import annotations

import contextlib
import io
import json

import h5py
import pytest

from bigmem import api
from bigmem.cli.common import flag_for
from bigmem.errors import ConfigError, DataError, UsageError

EXPORTED_FILES = ["config.json", "model.keras", "plan.json", "preprocessing.json"]


@contextlib.contextmanager
def _tuning_dir(path):
    """This machine's tuning file under ``path``; the kernel choices read afresh before and after."""
    from bigmem.nets import choices, tuning

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tuning.TUNING_DIR_ENV, str(path))
        choices.kernel_choices.cache_clear()
        try:
            yield
        finally:
            choices.kernel_choices.cache_clear()


# ---- synth -------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def synthesised(tmp_path_factory):
    """Three 8^3 phantoms of 4 classes, with every progress call and whatever was printed."""
    out = tmp_path_factory.mktemp("synth") / "p.h5"
    calls, printed = [], io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        result = api.synth(out, cases=3, volume=8, classes=4, seed=7, progress=lambda *call: calls.append(call))
    return out, result, calls, printed.getvalue()


def test_synth_returns_the_store_path(synthesised):
    out, result, _, _ = synthesised
    assert result.path == out


def test_synth_writes_its_cases(synthesised):
    out, _, _, _ = synthesised
    with h5py.File(out) as handle:
        assert sorted(handle["cases"]) == ["synth_0000", "synth_0001", "synth_0002"]


def test_synth_writes_its_classes(synthesised):
    out, _, _, _ = synthesised
    with h5py.File(out) as handle:
        assert handle.attrs["num_classes"] == 4


def test_synth_writes_its_volume(synthesised):
    out, _, _, _ = synthesised
    with h5py.File(out) as handle:
        assert handle["cases/synth_0001/image"].shape == (8, 8, 8, 1)


def test_synth_returns_the_store_size(synthesised):
    out, result, _, _ = synthesised
    assert result.nbytes == out.stat().st_size


def test_synth_returns_what_it_wrote(synthesised):
    _, result, _, _ = synthesised
    assert (result.cases, result.volume, result.classes) == (3, 8, 4)


def test_synth_reports_progress_from_zero(synthesised):
    _, _, calls, _ = synthesised
    assert calls == [(0, 3), (1, 3), (2, 3), (3, 3)]


def test_synth_prints_nothing(synthesised):
    _, _, _, printed = synthesised
    assert printed == ""


def test_synth_prints_nothing_to_the_terminal(tmp_path, capsys):
    api.synth(tmp_path / "p.h5", cases=1, volume=8)
    assert capsys.readouterr() == ("", "")


def test_synth_refuses_an_existing_store(tmp_path):
    out = tmp_path / "p.h5"
    out.write_text("keep me")
    with pytest.raises(DataError):
        api.synth(out, cases=1, volume=8)


def test_synth_keeps_the_existing_store(tmp_path):
    out = tmp_path / "p.h5"
    out.write_text("keep me")
    with pytest.raises(DataError):
        api.synth(out, cases=1, volume=8)
    assert out.read_text() == "keep me"


def test_synth_refusal_names_the_force_setting(tmp_path):
    out = tmp_path / "p.h5"
    out.write_text("keep me")
    with pytest.raises(DataError) as refused:
        api.synth(out, cases=1, volume=8)
    assert str(refused.value) == f"{str(out)!r} exists: pass synth.force to overwrite it."


def test_synth_refusal_renders_as_the_flag(tmp_path):
    out = tmp_path / "p.h5"
    out.write_text("keep me")
    with pytest.raises(DataError) as refused:
        api.synth(out, cases=1, volume=8)
    assert refused.value.render(flag_for) == f"{str(out)!r} exists: pass --force to overwrite it."


def test_synth_force_overwrites(tmp_path):
    out = tmp_path / "p.h5"
    out.write_text("replace me")
    api.synth(out, cases=1, volume=8, force=True)
    assert h5py.is_hdf5(out)


@pytest.mark.parametrize("arguments, message", [
    ({"cases": 0}, "Invalid synth.cases 0: expected a positive integer."),
    ({"volume": 2}, "Invalid synth.volume 2: expected an integer >= 4."),
    ({"classes": 1}, "Invalid synth.classes 1: expected 2..255 (background + foreground classes)."),
])
def test_synth_names_a_bad_argument(tmp_path, arguments, message):
    with pytest.raises(UsageError) as refused:
        api.synth(tmp_path / "x.h5", **arguments)
    assert str(refused.value) == message


def test_synth_writes_nothing_for_a_bad_argument(tmp_path):
    with pytest.raises(UsageError):
        api.synth(tmp_path / "x.h5", cases=0)
    assert not (tmp_path / "x.h5").exists()


# ---- export and report: a two-step run of the tiny network --------------------------------------------------------

@pytest.fixture(scope="module")
def trained(tmp_path_factory, tiny_store):
    """A finished two-step run of the tiny network on the tiny store, trained through the API."""
    run = tmp_path_factory.mktemp("trained") / "run"
    config = api.resolve_config("tiny", {"data": {"store": str(tiny_store)}, "train": {"steps": 2, "val_every": 0}})
    api.train(config, run)
    return run


def test_train_prints_nothing_unless_given_a_console(tiny_store, tmp_path, capsys):
    config = api.resolve_config("tiny", {"data": {"store": str(tiny_store)}, "train": {"steps": 1, "val_every": 0}})
    api.train(config, tmp_path / "run")
    assert capsys.readouterr().out == ""


def test_train_says_its_lines_on_the_console_it_is_given(tiny_store, tmp_path):
    import io

    from rich.console import Console

    config = api.resolve_config("tiny", {"data": {"store": str(tiny_store)}, "train": {"steps": 1, "val_every": 0}})
    console = Console(file=io.StringIO(), soft_wrap=True)
    api.train(config, tmp_path / "run", console=console)
    assert "Done: step 1, loss" in console.file.getvalue()


def test_export_returns_the_folder(trained, tmp_path):
    assert api.export(trained, tmp_path / "model").path == tmp_path / "model"


def test_export_lists_what_predict_needs(trained, tmp_path):
    assert api.export(trained, tmp_path / "model").files == EXPORTED_FILES


def test_export_writes_those_files(trained, tmp_path):
    api.export(trained, tmp_path / "model")
    assert sorted(p.name for p in (tmp_path / "model").iterdir()) == EXPORTED_FILES


def test_export_counts_the_bytes_written(trained, tmp_path):
    result = api.export(trained, tmp_path / "model")
    assert result.nbytes == sum(p.stat().st_size for p in (tmp_path / "model").rglob("*") if p.is_file())


def test_export_prints_nothing(trained, tmp_path, capsys):
    api.export(trained, tmp_path / "model")
    assert capsys.readouterr() == ("", "")


def test_export_refusal_names_the_force_setting(trained, tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(DataError) as refused:
        api.export(trained, tmp_path / "model")
    assert "{export.force}" in refused.value.template


def test_export_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError):
        api.export(tmp_path / "empty", tmp_path / "model")


@pytest.fixture(scope="module")
def reported(trained, tmp_path_factory):
    """The run's report in a folder of its own, with whatever was printed."""
    out, printed = tmp_path_factory.mktemp("report") / "report", io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        result = api.report(trained, out)
    return out, result, printed.getvalue()


def test_report_returns_the_folder(reported):
    out, result, _ = reported
    assert result.folder == out


def test_report_writes_report_json(reported):
    out, _, _ = reported
    assert (out / "report.json").is_file()


def test_report_writes_report_md(reported):
    out, _, _ = reported
    assert (out / "report.md").is_file()


def test_report_returns_report_json_s_runs(reported):
    out, result, _ = reported
    assert list(result.runs) == json.loads((out / "report.json").read_text())["runs"]


def test_report_summarises_one_run(reported):
    _, result, _ = reported
    assert len(result.runs) == 1


def test_report_counts_the_run_s_steps(reported):
    _, result, _ = reported
    assert result.runs[0]["steps"] == 2


def test_report_writes_each_plot(reported):
    out, result, _ = reported
    assert all((out / name).is_file() for name in result.plots.values())


def test_report_draws_plots(reported):
    _, result, _ = reported
    assert result.plots


def test_report_prints_nothing(reported):
    _, _, printed = reported
    assert printed == ""


def test_report_defaults_to_the_run_s_report_folder(trained):
    assert api.report(str(trained)).folder == trained / "report"


def test_report_refuses_a_missing_run(tmp_path):
    with pytest.raises(DataError):
        api.report(tmp_path / "no-such-run")


# ---- info --------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def machine():
    """``api.info`` without TensorFlow, with whatever it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        described = api.info(tensorflow=False)
    return described, printed.getvalue()


def test_info_counts_the_cpus(machine):
    described, _ = machine
    assert described["cpu"]["logical_cpus"] >= 1


def test_info_describes_the_memory(machine):
    described, _ = machine
    assert described["memory"]["total_bytes"] > 0


def test_info_lists_the_numa_nodes(machine):
    described, _ = machine
    assert described["numa"]["nodes"][0]["node"] == 0


def test_info_without_tensorflow_leaves_it_out(machine):
    described, _ = machine
    assert "tensorflow" not in described


def test_info_says_where_each_network_s_fixed_term_comes_from(machine):
    described, _ = machine
    assert set(described["memory_terms"]) == {"intelai-brats", "kits19", "resenc-m", "small"}


def test_info_is_json(machine):
    described, _ = machine
    assert json.loads(json.dumps(described)) == described


def test_info_prints_nothing(machine):
    _, printed = machine
    assert printed == ""


# ---- tune: the precisions, the lines said, the errors (the pass itself replaced) --------------------------------

def _fake_pass(calls: list, *, partial: bool = False):
    """A stand-in for ``bigmem.tune.tune`` that records its call and reports one pass (nothing is timed)."""
    from bigmem.nets.tuning import Tuning

    def run(config, shape, *, budget_s, measure_memory, progress):
        calls.append((config.train.precision.value, tuple(shape), budget_s, measure_memory))
        progress("done", 1.0)
        record = {"model": config.model.name, "shape": list(shape), "precision": config.train.precision.value,
                  "batch_size": config.train.batch_size, "seconds": 1.4, "partial": partial, "convolutions": 9,
                  "timed": 5 if partial else 9}
        return Tuning(key={}, planewise={}, conv_gflops_per_core={}, overhead_offset_bytes={}, tuned=[record], rows=[])

    return run


@pytest.fixture
def fake_tune(monkeypatch):
    """The tuning pass replaced by ``_fake_pass``; the list its calls go to."""
    import bigmem.tune

    calls = []
    monkeypatch.setattr(bigmem.tune, "tune", _fake_pass(calls))
    return calls


def test_tune_times_fp32_and_bf16_where_bf16_is_native(fake_tune, monkeypatch):
    from bigmem.sysinfo import NATIVE_BF16_VARIABLE

    monkeypatch.setenv(NATIVE_BF16_VARIABLE, "1")
    api.tune(api.resolve_config("tiny"), (16, 16, 16))
    assert [call[0] for call in fake_tune] == ["fp32", "bf16"]


def test_tune_times_fp32_only_where_bf16_is_emulated(fake_tune, monkeypatch):
    from bigmem.sysinfo import NATIVE_BF16_VARIABLE

    monkeypatch.setenv(NATIVE_BF16_VARIABLE, "0")
    api.tune(api.resolve_config("tiny"), (16, 16, 16))
    assert [call[0] for call in fake_tune] == ["fp32"]


def test_default_precisions_without_native_bf16(monkeypatch):
    from bigmem.sysinfo import NATIVE_BF16_VARIABLE
    from bigmem.tune import default_precisions

    monkeypatch.setenv(NATIVE_BF16_VARIABLE, "0")
    assert default_precisions() == ["fp32"]


def test_tune_times_the_precisions_given(fake_tune):
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["bf16"])
    assert [call[0] for call in fake_tune] == ["bf16"]


def test_tune_defaults_to_the_reference_cube(fake_tune):
    config = api.resolve_config("tiny")
    api.tune(config, precisions=["fp32"])
    assert fake_tune[0][1] == (config.data.reference_volume,) * 3


def test_tune_defaults_to_the_config_s_shape(fake_tune):
    api.tune(api.resolve_config("tiny", {"data": {"shape": [16, 32, 32]}}), precisions=["fp32"])
    assert fake_tune[0][1] == (16, 32, 32)


def test_tune_passes_the_seconds_on(fake_tune):
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], seconds=3.5)
    assert fake_tune[0][2] == 3.5


def test_tune_passes_measure_memory_on(fake_tune):
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], measure_memory=False)
    assert fake_tune[0][3] is False


def test_tune_says_a_line_before_and_after_each_pass(fake_tune):
    said = []
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32", "bf16"], say=said.append)
    assert len(said) == 4


def test_tune_says_what_it_tunes(fake_tune):
    said = []
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], say=said.append)
    assert said[0].startswith("tuning tiny at 16x16x16, batch ")


def test_tune_says_what_it_timed(fake_tune):
    said = []
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], say=said.append)
    assert said[1] == "  9 of 9 convolutions timed in 1 s"


def test_tune_says_when_it_ran_out_of_time(monkeypatch):
    import bigmem.tune

    monkeypatch.setattr(bigmem.tune, "tune", _fake_pass([], partial=True))
    said = []
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], say=said.append)
    assert said[1] == "  5 of 9 convolutions timed in 1 s (out of time: the rest keep the shipped choice)"


def test_tune_starts_each_pass_s_progress_at_zero(fake_tune):
    progressed = []
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"],
             progress=lambda what, done: progressed.append((what, done)))
    assert progressed == [("", 0.0), ("done", 1.0)]


def test_tune_returns_each_pass_s_record(fake_tune):
    result = api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32", "bf16"])
    assert [record["precision"] for record in result.passes] == ["fp32", "bf16"]


def test_tune_prints_nothing(fake_tune, capsys):
    api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"])
    assert capsys.readouterr() == ("", "")


def test_tune_names_bad_seconds_as_the_setting():
    with pytest.raises(UsageError) as refused:
        api.tune(api.resolve_config("tiny"), seconds=0)
    assert str(refused.value) == "Invalid tune.seconds 0: expected a positive, finite number."


def test_tune_bad_seconds_render_as_the_flag():
    with pytest.raises(UsageError) as refused:
        api.tune(api.resolve_config("tiny"), seconds=0)
    assert refused.value.render(flag_for) == "Invalid --seconds 0: expected a positive, finite number."


def test_tune_refuses_a_shape_the_network_cannot_take():
    with pytest.raises(ConfigError) as refused:
        api.tune(api.resolve_config("tiny"), (50, 50, 50))
    assert refused.value.field == "tune.shape"


# ---- tune: one real, short pass of the tiny network --------------------------------------------------------------

@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    """A two-second fp32 pass of the tiny network at 16^3 (no memory step) into a tuning folder of its own: the
    result, the lines said, the progress calls and whatever was printed."""
    from bigmem.nets.tuning import tuning_path

    said, progressed, printed = [], [], io.StringIO()
    with _tuning_dir(tmp_path_factory.mktemp("tuning")):
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            result = api.tune(api.resolve_config("tiny"), (16, 16, 16), precisions=["fp32"], seconds=2,
                              measure_memory=False, say=said.append,
                              progress=lambda what, done: progressed.append((what, done)))
        path = tuning_path()
    return result, said, progressed, printed.getvalue(), path


def test_a_real_pass_writes_this_machines_file(tuned):
    result, _, _, _, _ = tuned
    assert result.path.is_file()


def test_a_real_pass_returns_the_file_it_wrote(tuned):
    result, _, _, _, path = tuned
    assert result.path == path


def test_a_real_pass_records_its_pass(tuned):
    result, _, _, _, _ = tuned
    assert result.passes[0]["model"] == "tiny"


def test_a_real_pass_times_convolutions(tuned):
    result, _, _, _, _ = tuned
    assert result.passes[0]["timed"] >= 1


def test_a_real_pass_says_what_it_timed(tuned):
    _, said, _, _, _ = tuned
    assert "convolutions timed" in said[-1]


def test_a_real_pass_ends_its_progress_done(tuned):
    _, _, progressed, _, _ = tuned
    assert progressed[-1] == ("done", 1.0)


def test_a_real_pass_prints_nothing(tuned):
    _, _, _, printed, _ = tuned
    assert printed == ""


def test_machine_tuning_reads_the_pass(tuned):
    result, _, _, _, path = tuned
    with _tuning_dir(path.parent):
        assert api.machine_tuning().tuning.tuned == result.tuning.tuned


def test_machine_tuning_without_a_file_is_none(tmp_path):
    with _tuning_dir(tmp_path):
        assert api.machine_tuning().tuning is None


def test_machine_tuning_names_the_file_it_would_read(tmp_path):
    with _tuning_dir(tmp_path):
        assert api.machine_tuning().path.parent == tmp_path


def test_machine_tuning_prints_nothing(tmp_path, capsys):
    with _tuning_dir(tmp_path):
        api.machine_tuning()
    assert capsys.readouterr() == ("", "")
