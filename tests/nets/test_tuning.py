"""This machine's tuning: its key, its cache file, the fallback to the shipped tables, and that layers take it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from bigmem.nets import choices, tuning


@pytest.fixture
def tuning_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "tuning"))
    choices.kernel_choices.cache_clear()
    yield tmp_path / "tuning"
    choices.kernel_choices.cache_clear()


def _write(planewise=None, offsets=None, key=None) -> tuning.Tuning:
    here = dataclasses.asdict(key or tuning.key_here())
    made = tuning.Tuning(key=here, planewise=planewise or {}, conv_gflops_per_core={"fp32": 50.0},
                         overhead_offset_bytes=offsets or {},
                         tuned=[{"model": "tiny", "shape": [16, 16, 16], "precision": "fp32", "seconds": 3.0}], rows=[])
    tuning.save_tuning(made)
    return made


def test_the_key_names_this_cpu_its_tensorflow_and_its_threads():
    from bigmem.cpu import cpu_description
    from bigmem.tfenv import tensorflow_version

    key = tuning.key_here(threads=7)
    assert key.cpu == cpu_description()["model"]
    assert key.tensorflow == tensorflow_version()
    assert key.threads == 7


def test_a_capped_onednn_is_another_key(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "SSE41")
    capped = tuning.key_here(threads=2)
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert capped.isa_class == "baseline"
    assert capped.slug() != tuning.key_here(threads=2).slug()


def test_another_thread_count_is_another_file():
    assert tuning.key_here(threads=2).slug() != tuning.key_here(threads=64).slug()


def test_onednn_off_is_read_from_the_variable():
    assert tuning.onednn_state({"TF_ENABLE_ONEDNN_OPTS": "0"}) == "off"
    assert tuning.onednn_state({}) == "on"


def test_without_a_tuning_the_shipped_choices_are_in_force(tuning_dir):
    name, taken = choices.kernel_choices()
    assert taken == choices.CHOICES.get(name, choices.CHOICES["baseline"])


def test_a_tuning_decides_the_counts_it_timed_and_keeps_the_shipped_range_elsewhere(tuning_dir):
    name = choices.kernel_choices()[0]
    shipped = choices.CHOICES.get(name, choices.CHOICES["baseline"])
    choices.kernel_choices.cache_clear()
    _write({"fp32/1/3": True, "fp32/1/8": False})
    taken = choices.kernel_choices()[1]
    assert taken.takes_planewise("fp32", 1, 3) is True
    assert taken.takes_planewise("fp32", 1, 8) is False
    assert taken.takes_planewise("bf16", 2, 32) == shipped.takes_planewise("bf16", 2, 32)
    assert taken.source.startswith("tuned on this machine (tiny 16x16x16 fp32")


def test_a_tuning_of_another_machine_is_not_read(tuning_dir):
    other = dataclasses.replace(tuning.key_here(), cpu="Some Other CPU")
    made = _write({"fp32/1/3": True}, key=other)
    path = tuning.tuning_path()  # this machine's name, holding another key (a digest clash stands in)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(made)))
    choices.kernel_choices.cache_clear()
    assert choices.kernel_choices()[1].exact == {}


def test_a_correctness_choice_is_never_tuned_away():
    shipped = choices.CHOICES["amx"]
    made = tuning.Tuning(key={}, planewise={"bf16/1/8": False}, conv_gflops_per_core={}, overhead_offset_bytes={},
                         tuned=[], rows=[])
    assert shipped.tuned(made).takes_planewise("bf16", 1, 8) is True


def test_timings_of_one_count_from_several_passes_are_summed():
    from bigmem.tune import planewise_from

    row = {"precision": "fp32", "stride": 1, "input_shape": [1, 8, 8, 8, 16], "count": 1}
    rows = [{**row, "weight_grad_planewise_s": 1.0, "weight_grad_3d_s": 2.0},
            {**row, "weight_grad_planewise_s": 5.0, "weight_grad_3d_s": 3.0},
            {**row, "input_shape": [1, 8, 8, 8, 1], "weight_grad_planewise_s": None, "weight_grad_3d_s": 1.0}]
    assert planewise_from(rows) == {"fp32/1/16": False}


def test_a_close_race_keeps_the_shipped_choice():
    from bigmem.tune import planewise_from

    row = {"precision": "fp32", "stride": 2, "input_shape": [1, 8, 8, 8, 32], "count": 1}
    assert planewise_from([{**row, "weight_grad_planewise_s": 0.98, "weight_grad_3d_s": 1.0}]) == {}
    assert planewise_from([{**row, "weight_grad_planewise_s": 0.90, "weight_grad_3d_s": 1.0}]) == {"fp32/2/32": True}


def test_an_unreadable_or_older_file_is_no_tuning(tuning_dir):
    path = tuning.tuning_path()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    assert tuning.load_tuning() is None
    path.write_text(json.dumps({"version": tuning.TUNING_VERSION - 1}))
    assert tuning.load_tuning() is None


def test_the_rule_takes_consecutive_wins_only():
    won, lost = (1.0, 2.0), (3.0, 2.0)
    seconds = {("fp32", 1, 8): won, ("fp32", 1, 16): won, ("fp32", 1, 32): lost,
               ("fp32", 2, 8): won, ("fp32", 2, 16): lost, ("fp32", 2, 32): won}
    assert choices.planewise_ranges(seconds) == {("fp32", 1): (8, 16)}


def _paths(channels: int) -> list[str]:
    import tensorflow as tf

    from bigmem.nets.conv import Conv3D, observe_convolutions

    layer = Conv3D(4, 3, padding="same")
    with observe_convolutions() as calls:
        layer(tf.zeros((1, 8, 8, 8, channels)))
    return [call.path for call in calls]


def test_the_layers_take_the_tuned_choice(tuning_dir):
    _write({"fp32/1/8": True, "fp32/1/16": False})
    assert _paths(8) == ["planewise"]
    assert _paths(16) == ["3d"]


def test_a_tuned_loss_turns_the_planewise_gradient_off(tuning_dir):
    _write({"fp32/1/8": False})
    assert _paths(8) == ["3d"]


@pytest.mark.parametrize("table_cpu, fraction", [("AMD EPYC 9654", 0.0), ("AMD EPYC", 0.02)],
                         ids=("the-tables-cpu", "a-masked-name"))
def test_the_tuned_fixed_term_moves_the_shipped_table(tuning_dir, monkeypatch, table_cpu, fraction):
    """Moved by the measured term; the slope keeps a 2% margin unless the table is known to be this CPU's."""
    from bigmem.memory import calibration

    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "avx512_bf16")
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: table_cpu)
    monkeypatch.setitem(calibration.SHIPPED_CPUS, ("avx512_bf16", "small", "fp32", "none"), table_cpu)
    shipped = calibration.shipped_calibration("small", "fp32", "none", isa="avx512_bf16")
    _write(offsets={tuning.overhead_key("small", "fp32", "none", shipped.table_digest()): 100 * 2**20})
    moved = calibration.calibration_for("small", "fp32", "none", path=tuning_dir / "no-calibrations.json")
    assert [y for _, y in moved.knots] == [y + 100 * 2**20 for _, y in shipped.knots]
    assert moved.margin_bytes == 0
    assert "fixed term measured by bigmem tune (+100.00 MiB)" in moved.source
    assert moved.margin_fraction == fraction


@pytest.mark.parametrize("name", ["small/fp32/none", "small/fp32/none@00000000"])
def test_an_offset_measured_against_another_table_is_not_applied(tuning_dir, name):
    from bigmem.memory.calibration import calibration_for, machine_isa_class, shipped_calibration

    shipped = shipped_calibration("small", "fp32", "none", isa=machine_isa_class())
    _write(offsets={name: 100 * 2**20})  # an older file's key, or a table shipped before this one
    found = calibration_for("small", "fp32", "none", path=tuning_dir / "no-calibrations.json")
    assert found.knots == shipped.knots


def test_the_pass_times_every_convolution_and_writes_the_file(tuning_dir):
    from bigmem.config import resolve_config
    from bigmem.tune import network_convolutions, tune

    config = resolve_config("tiny", {"train": {"batch_size": 1}})
    calls = network_convolutions(config, (16, 16, 16))
    made = tune(config, (16, 16, 16), measure_memory=False)
    assert len(made.rows) == len(calls)
    assert sum(row["count"] for row in made.rows) == sum(count for _, count in calls)
    assert made.tuned[-1]["partial"] is False
    assert tuning.load_tuning().rows == made.rows


def test_the_pass_stops_at_its_budget(tuning_dir):
    from bigmem.config import resolve_config
    from bigmem.tune import tune

    made = tune(resolve_config("tiny", {"train": {"batch_size": 1}}), (16, 16, 16), budget_s=0.0,
                measure_memory=False)
    assert made.tuned[-1]["partial"] is True


def test_the_tuned_rate_is_the_plans_step_rate(tuning_dir):
    from bigmem.speed import STEP_SHARE_OF_CEILING, tuned_step_rate

    assert tuned_step_rate("fp32", 8, True) is None
    made = _write()
    made.conv_gflops_per_core = {"fp32/8": 40.0, "bf16/8": 20.0}
    tuning.save_tuning(made)
    assert tuned_step_rate("fp32", 8, True).gflops_per_core == pytest.approx(40.0 * STEP_SHARE_OF_CEILING)
    assert tuned_step_rate("bf16", 8, True).gflops_per_core == pytest.approx(20.0 * STEP_SHARE_OF_CEILING)
    assert tuned_step_rate("bf16", 8, False) is None  # emulated bf16 is never tuned


def test_an_unseen_cpu_of_a_measured_class_is_bounded_until_tuned(tuning_dir, monkeypatch):
    """The avx512_bf16 table came from an AMD EPYC; a Xeon of that class gets the fixed margin until it tunes."""
    from bigmem.memory import calibration

    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "avx512_bf16")
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: "Intel(R) Xeon(R) Gold 6348H CPU")
    unseen = calibration.calibration_for("kits19", "fp32", "none", path=tuning_dir / "none.json")
    assert (unseen.margin_fraction, unseen.margin_bytes) == (0.0, calibration.UNMEASURED_MARGIN_BYTES)
    assert "measured on AMD EPYC, not this CPU (Intel(R) Xeon(R) Gold 6348H CPU)" in unseen.source


def test_the_cpu_a_table_was_measured_on_gets_no_margin(tuning_dir, monkeypatch):
    """A table is known to be this CPU's only under a name with a model number: a hypervisor's "AMD EPYC"
    covers several generations, and keeps the fixed margin until tune measures the term."""
    from bigmem.memory import calibration

    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "avx512_bf16")
    monkeypatch.setitem(calibration.SHIPPED_CPUS, ("avx512_bf16", "kits19", "fp32", "none"), "AMD EPYC 9654")
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: "AMD EPYC 9654")
    assert not calibration.calibration_for("kits19", "fp32", "none", path=tuning_dir / "none.json").has_margin


def test_a_masked_cpu_name_is_not_known_to_be_the_tables_cpu(tuning_dir, monkeypatch):
    from bigmem.memory import calibration

    monkeypatch.setattr(calibration, "machine_isa_class", lambda: "avx512_bf16")
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: "AMD EPYC")
    masked = calibration.calibration_for("kits19", "fp32", "none", path=tuning_dir / "none.json")
    assert masked.margin_bytes == calibration.UNMEASURED_MARGIN_BYTES
    assert "one a hypervisor gives to several CPU generations" in masked.source


def test_the_traced_convolutions_are_the_steps_own_flops():
    """Each conv counted once: their FLOPs add up to UNet3D.train_flops (building calls layers more than once)."""
    from bigmem.config import resolve_config
    from bigmem.nets.unet3d import UNet3D
    from bigmem.tune import TimedConv, network_convolutions

    config = resolve_config("tiny", {"train": {"batch_size": 2}})
    calls = network_convolutions(config, (16, 16, 32))
    flops = sum(TimedConv(c.kind, c.input_shape, c.kernel, c.stride, c.precision, n, 0, 0, 0, None).flops
                for c, n in calls)
    assert flops == UNet3D(config.model).build_for().train_flops((16, 16, 32), batch_size=2)


@pytest.mark.parametrize("preset, shape", [("tiny", (16, 16, 32)), ("small", (48, 32, 64)), ("kits19", (64, 64, 32))])
def test_the_scaled_trace_is_the_trace_at_the_shape_itself(preset, shape):
    """The calls found at the small traced shape, scaled, are the calls a trace at ``shape`` records."""
    from collections import Counter

    from bigmem.config import resolve_config
    from bigmem.tune import convolutions_at, network_convolutions

    config = resolve_config(preset, {"train": {"batch_size": 1}})

    def key(call):
        return call.kind, call.input_shape, call.kernel, call.stride, call.precision

    direct = Counter(key(call) for call in convolutions_at(config, shape))
    assert Counter({key(call): count for call, count in network_convolutions(config, shape)}) == direct


def test_the_network_is_traced_at_a_bounded_shape_whatever_the_volume(monkeypatch):
    """A 1280^3 job traces the network at its size contract (16^3 for kits19), not at 1280^3."""
    import bigmem.tune
    from bigmem.config import resolve_config

    traced = []
    real = bigmem.tune.convolutions_at
    monkeypatch.setattr(bigmem.tune, "convolutions_at", lambda config, shape: traced.append(tuple(shape)) or
                        real(config, shape))
    config = resolve_config("kits19", {"train": {"batch_size": 1}})
    calls = bigmem.tune.network_convolutions(config, (1280, 1280, 1280))
    assert traced == [config.model.divisors]
    assert max(call.input_shape[1] for call, _ in calls) == 1280


def test_a_pass_stopped_part_way_leaves_nothing_and_the_next_one_tunes(tuning_dir, monkeypatch):
    """Ctrl-C after the first convolution is timed: no file, no temporary beside it; the next pass writes one."""
    import bigmem.tune
    from bigmem.config import resolve_config

    config = resolve_config("tiny", {"train": {"batch_size": 1}})
    real, timed = bigmem.tune.time_convolution, []

    def interrupted(call, count, **options):
        if timed:
            raise KeyboardInterrupt
        timed.append(call)
        return real(call, count, **options)

    monkeypatch.setattr(bigmem.tune, "time_convolution", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bigmem.tune.tune(config, (16, 16, 16), measure_memory=False)
    assert not tuning_dir.exists() or list(tuning_dir.iterdir()) == []
    monkeypatch.setattr(bigmem.tune, "time_convolution", real)
    assert tuning.load_tuning() is None
    bigmem.tune.tune(config, (16, 16, 16), measure_memory=False)
    assert tuning.load_tuning().tuned[-1]["model"] == "tiny"


@pytest.mark.parametrize("input_shape, kernel, stride", [
    ((1, 1280, 1280, 1280, 1), (3, 3, 3, 1, 32), 1),  # one plane of the output: 52 M elements
    ((1, 1280, 1280, 1280, 32), (3, 3, 3, 32, 32), 2),
    ((2, 512, 512, 512, 32), (3, 3, 3, 32, 32), 1),
    ((1, 96, 96, 96, 32), (3, 3, 3, 32, 64), 1)])
def test_a_timed_convolution_holds_a_bounded_tensor_at_any_volume(input_shape, kernel, stride):
    from bigmem.nets.conv import ConvCall
    from bigmem.tune import MAX_TIMED_ELEMENTS, timed_shape

    call = ConvCall("conv", input_shape, kernel, stride, "fp32", "3d")
    d, h, w = timed_shape(call)
    channels = max(input_shape[-1], kernel[-1]) * input_shape[0]
    assert d * h * w * channels <= MAX_TIMED_ELEMENTS
    assert (d % (2 * stride), h % (2 * stride), w % (2 * stride)) == (0, 0, 0)  # whole strides: exact output shapes


def test_a_small_convolution_is_timed_whole():
    from bigmem.nets.conv import ConvCall
    from bigmem.tune import timed_shape

    assert timed_shape(ConvCall("conv", (1, 16, 16, 16, 8), (3, 3, 3, 8, 8), 1, "fp32", "3d")) == (16, 16, 16)
