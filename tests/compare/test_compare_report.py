"""compare's typed report: compare.json's format kept, older reports read, means and conclusion from the numbers."""

from __future__ import annotations

import copy
import json
import math

import pytest

from bigmem.compare.report import ClassScore, CompareReport, HeldOut, PathResult, SeedRun, TrainingRun, conclude


def _old_run(name: str, steps: int, dice: float, mode: str) -> dict:
    scores = {"1": {"dice": 0.0072, "hd95_mm": 10.6771}, "2": {"dice": 0.046, "hd95_mm": None}}
    return {"seed": 0, "run_dir": f"cmp/{name}/seed-0", "steps": steps, "train_s": 1.0526, "step_s": 0.0099,
            "voxels_per_s": 412108.3, "peak_host_bytes": 672260096, "final_train_dice": 0.027,
            "curve": [{"step": 1, "time_s": 1.0223, "train_dice": 0.026},
                      {"step": 2, "time_s": 1.0363, "train_dice": 0.063, "val_dice": 0.0265}],
            "train_flops": 159842304, "samples_per_s": 100.6,
            "held_out": {"mode": mode, "dice": dice, "hd95_mm": 9.9753, "per_class": scores,
                         "inference_s_per_case": 0.3988, "inference_peak_bytes": 820715520,
                         "predictions": f"cmp/{name}/seed-0-predictions"}}


def _old_path(run: dict, **planner) -> dict:
    held_out = run["held_out"]
    return {"runs": [run], "dice": held_out["dice"], "dice_std": None, "dice_range": 0.0,
            "per_class": held_out["per_class"], "hd95_mm": held_out["hd95_mm"], "steps": float(run["steps"]),
            "train_s": 1.0526, "step_s": 0.0099, "voxels_per_s": 412108.3, "samples_per_s": 100.6,
            "train_flops": 159842304.0, "peak_host_bytes": 672260096.0, "inference_mode": held_out["mode"],
            "inference_s_per_case": 0.3988, **planner}


# compare.json as compare wrote it before the report had types (a real run's, trimmed and rounded).
OLD = {
    "simulated": True, "replicas": 2, "gpu_memory_bytes": 1074040050,
    "gpu_memory_stand_in": "a scaled stand-in: 1.00 GiB, in which the planner's patch is 8^3 of volumes of edge 16, "
                           "as 80.00 GiB holds 320^3 of a 512^3 kits19 volume (batch 1)",
    "model": "tiny", "volume": 16, "shape": [16, 16, 16], "native_shapes": False, "patch_size": [8, 8, 8],
    "batch": {"cpu_bigmem": 1, "data_parallel": 2}, "held_out_cases": ["synth_0003"],
    "budget": "equal training FLOPs (4 steps on whole volumes, the same FLOPs on patches)", "seeds": 1,
    "paths": {"cpu_bigmem": _old_path(_old_run("cpu_bigmem", 4, 0.0266, "whole"), max_whole_volume=568,
                                      max_whole_volume_mode="bf16, recompute stages"),
              "data_parallel": _old_path(_old_run("data_parallel", 16, 0.0499, "sliding 8^3, overlap 0.5"),
                                         max_whole_volume=8)},
    "conclusion": {"higher": "data_parallel", "difference": 0.0499 - 0.0266, "spread": None, "exceeds_spread": None,
                   "text": "GPU data parallel on patches reached the higher held-out Dice within equal training FLOPs "
                           "(4 steps on whole volumes, the same FLOPs on patches): 0.050 against 0.027 (+0.023); "
                           "one seed, so the seed-to-seed spread is unknown (--seeds 3 measures it)."},
}


def test_a_report_written_before_the_types_reads_and_writes_back_unchanged():
    report = CompareReport.from_dict(json.loads(json.dumps(OLD)))
    assert json.dumps(report.to_dict()) == json.dumps(OLD)  # the same keys, in the same order, the same values
    cpu, dp = report.paths["cpu_bigmem"], report.paths["data_parallel"]
    assert (cpu.max_whole_volume_mode, dp.max_whole_volume_mode) == ("bf16, recompute stages", None)
    assert cpu.runs[0].training.curve[1].val_dice == 0.0265
    assert cpu.runs[0].training.curve[0].val_dice is None
    assert cpu.per_class["2"] == ClassScore(0.046, None)
    assert report.conclusion.higher == "data_parallel"


def test_older_reports_read_as_cubes():
    older = copy.deepcopy(OLD)
    del older["shape"], older["native_shapes"]
    older["patch_size"] = 8  # an edge: reports from before patches took the dataset's aspect
    report = CompareReport.from_dict(older)
    assert (report.shape, report.native_shapes, report.patch_size) == ((16, 16, 16), False, (8, 8, 8))


def test_a_built_report_round_trips_through_json(make_report):
    report = make_report([0.90, 0.91, 0.92], [0.80, 0.82, 0.81])
    text = json.dumps(report.to_dict())
    assert CompareReport.from_dict(json.loads(text)) == report
    assert json.loads(text)["conclusion"] == report.conclusion.to_dict()
    run = report.paths["cpu_bigmem"].runs[1]
    assert SeedRun.from_dict(run.to_dict()) == run
    assert TrainingRun.from_dict(run.to_dict()) == run.training
    assert list(run.to_dict()) == list(OLD["paths"]["cpu_bigmem"]["runs"][0])  # a run's keys, flat, in order


def test_a_path_over_seeds_is_their_means_and_spread(make_report):
    path = make_report([0.90, 0.92, 0.97], [0.8])
    cpu = path.paths["cpu_bigmem"]
    assert cpu.dice == pytest.approx(0.93)
    assert cpu.dice_range == pytest.approx(0.07)
    assert cpu.dice_std == pytest.approx(math.sqrt(((0.03**2) + (0.01**2) + (0.04**2)) / 2))
    assert path.paths["data_parallel"].dice_std is None  # one seed: no standard deviation
    assert cpu.per_class["1"] == ClassScore(pytest.approx(0.93), pytest.approx(10.0))
    assert cpu.per_class["2"] == ClassScore(None, None)  # no seed scored it
    assert (cpu.train_s, cpu.steps, cpu.train_flops) == (pytest.approx(2.0), 4.0, 16e7)


def test_a_class_score_some_seeds_leave_undefined_is_the_mean_of_the_others():
    def run(seed, hd95):
        held_out = HeldOut("whole", 0.5, hd95, {"1": ClassScore(0.5, hd95)}, 0.1, 1, "p")
        return SeedRun(seed, TrainingRun("r", 2, 1.0, 0.5, 1.0, 1, 0.5, ()), 1.0, 1.0, held_out)

    path = PathResult.over_seeds([run(0, 4.0), run(1, float("nan")), run(2, None), run(3, 6.0)], max_whole_volume=8)
    assert path.per_class["1"].hd95_mm == 5.0
    assert path.hd95_mm == 5.0


def test_the_conclusion_is_computed_from_the_numbers(make_report):
    one = make_report([0.9], [0.8]).conclusion
    assert (one.higher, one.difference, one.spread, one.exceeds_spread) == ("cpu_bigmem", pytest.approx(0.1), None,
                                                                            None)
    assert one.text == ("Whole volumes in RAM (bigmem) reached the higher held-out Dice within equal training time "
                        "(120 s of training each): 0.900 against 0.800 (+0.100); one seed, so the seed-to-seed "
                        "spread is unknown (--seeds 3 measures it).")
    clear = make_report([0.90, 0.91, 0.92], [0.80, 0.82, 0.81]).conclusion
    assert clear.exceeds_spread is True
    assert clear.spread == pytest.approx(0.02)
    assert clear.text.endswith("(+0.100), more than the spread over 3 seeds (0.020).")
    noise = make_report([0.80, 0.90, 0.85], [0.86, 0.84, 0.88]).conclusion
    assert (noise.higher, noise.exceeds_spread) == ("data_parallel", False)
    assert noise.text.startswith("GPU data parallel on patches reached the higher held-out Dice")
    assert noise.text.endswith("no more than the spread over 3 seeds (0.100): the difference is not established.")
    tie = make_report([0.5], [0.5])
    assert conclude(tie.paths, 1, tie.budget).higher == "cpu_bigmem"  # a tie goes to the whole-volume path
