"""compare's renderers: the table's rows, compare.md and compare.png, from a report."""

from __future__ import annotations

import dataclasses

import pytest
from rich.console import Console

from bigmem.compare.render import console_table, markdown, plot, rows


def test_the_rows_state_each_quantity_for_both_paths(make_report):
    table = rows(make_report([0.9], [0.8]))
    assert table == [
        ("training input", "whole 16^3 volumes, batch 1", "8^3 patches, global batch 2"),
        ("held-out Dice", "0.900", "0.800"),
        ("  class 1: Dice / HD95", "0.900 / 9.0 mm", "0.800 / 9.0 mm"),
        ("  class 2: Dice / HD95", "n/a / n/a", "n/a / n/a"),  # scored by no case
        ("inference", "whole, 0.40 s/case", "sliding 8^3, overlap 0.5, 0.40 s/case"),
        ("training time / steps", "1 s / 4", "1 s / 16"),
        ("training FLOPs", "0.16 GFLOP", "0.64 GFLOP"),
        ("voxels/s, time per step", "0.40 M, 0.010 s", "0.40 M, 0.010 s"),
        ("peak host memory", "640.00 MiB", "640.00 MiB"),
        ("largest whole volume (planner)", "568^3 (bf16, recompute stages)", "8^3 per GPU (1.00 GiB)"),
    ]


def test_seeds_show_the_spread_and_native_shapes_their_largest(make_report):
    report = make_report([0.90, 0.91, 0.92], [0.80, 0.82, 0.81])
    assert rows(report)[1] == ("held-out Dice (mean ± sd, 3 seeds)", "0.910 ± 0.010", "0.810 ± 0.010")
    native = dataclasses.replace(report, native_shapes=True, shape=(16, 32, 24), patch_size=(8, 16, 8))
    assert rows(native)[0] == ("training input", "whole volumes at their own shapes (up to 16x32x24), batch 1",
                               "8x16x8 patches, global batch 2")
    nothing = dataclasses.replace(report.paths["data_parallel"], max_whole_volume=None)
    assert rows(dataclasses.replace(report, paths={**report.paths, "data_parallel": nothing}))[-1][2] == "none fits"


def test_markdown_says_what_was_compared_and_concludes(make_report):
    report = make_report([0.9], [0.8])
    text = markdown(report)
    assert text.startswith("# bigmem compare: tiny\n\nData-parallel path: 2 logical CPU devices — SIMULATED ON CPU, "
                           "not a GPU result. GPU memory: 1.00 GiB. Budget: equal training time (120 s of training "
                           "each). Held-out cases: synth_0003.\n")
    assert "| class 2: Dice / HD95 | n/a / n/a | n/a / n/a |" in text
    assert text.endswith(f"\n**Conclusion:** {report.conclusion.text}\n")
    real = markdown(make_report([0.9], [0.8], simulated=False, stand_in="a scaled stand-in: 1.00 GiB"))
    assert "Data-parallel path: 2 GPUs. GPU memory: a scaled stand-in: 1.00 GiB." in real
    assert "SIMULATED" not in real


def test_the_printed_table_is_titled_simulated_when_it_was(make_report):
    console = Console(record=True, width=200)
    console.print(console_table(make_report([0.9], [0.8])))
    text = console.export_text()
    assert "bigmem compare — data-parallel path SIMULATED ON CPU" in text
    assert "data parallel on patches (2 simulated replicas)" in text
    assert "568^3 (bf16, recompute stages)" in text
    console.print(console_table(make_report([0.9], [0.8], simulated=False)))
    assert "data parallel on patches (2 GPUs)" in console.export_text()


@pytest.mark.parametrize("width", [60, 80])
def test_a_narrow_terminal_folds_the_table_instead_of_cutting_it(make_report, width):
    console = Console(record=True, width=width)
    console.print(console_table(make_report([0.9], [0.8])))
    text = console.export_text()
    assert "…" not in text
    assert "568^3" in text


def test_the_plot_is_a_png(make_report, tmp_path):
    plot(make_report([0.90, 0.91], [0.80, 0.82]), tmp_path / "compare.png")
    assert (tmp_path / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["compare.png"]  # written atomically: no temporary left
