"""``bigmem plan`` (training and ``--inference``): the candidates, plan.json, exit codes."""

from __future__ import annotations

import json

import pytest

from helpers import run_cli


def test_plan_writes_every_candidate(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--budget", "4GiB", "--model", "small", "--batch-size", 1,
                                 "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["fits"]
    assert plan["budget_bytes"] == 4 * 2**30
    assert plan["budget_source"] == "--budget"
    assert plan["predicted_peak_bytes"] <= 4 * 2**30
    assert set(plan["chosen"]) >= {"volume", "batch_size", "precision", "recompute"}
    assert len(plan["candidates"]) > 10
    assert all({"volume", "batch_size", "precision", "recompute", "predicted_peak_bytes", "fits"} <= set(c)
               for c in plan["candidates"])
    assert f"chosen: --volume {plan['chosen']['volume']} --batch-size 1" in stdout


@pytest.mark.parametrize("flag", ["--memory-budget", "--budget"])
def test_plan_budget_flag_and_its_alias(tmp_path, capsys, flag):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", flag, "2GiB", "--model", "tiny", "--volume", 16, "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert (plan["budget_bytes"], plan["budget_source"]) == (2 * 2**30, flag)
    code, _, err = run_cli(["plan", flag, "lots", "--out", out], capsys)
    assert code == 2
    assert f"Invalid {flag} 'lots'" in err


def test_plan_nothing_fits_exits_3(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--budget", "10MiB", "--model", "small", "--out", out], capsys)
    assert code == 3
    assert err.startswith("bigmem plan: error: Nothing fits 10.00 MiB (--budget): the closest candidate, 8^3 x "
                          "batch 1 ")
    assert json.loads(out.read_text())["fits"] is False


def test_plan_bad_budget(capsys, tmp_path):
    code, _, err = run_cli(["plan", "--budget", "lots", "--out", tmp_path / "p.json"], capsys)
    assert code == 2
    assert err.strip() == ("bigmem plan: error: Invalid --budget 'lots': expected a size such as 512GiB, 1.5TiB, "
                           "200MB or 1048576.")


@pytest.mark.parametrize("precision,native,precisions,warned", [
    ("auto", "1", {"fp32", "bf16"}, False), ("auto", "0", {"fp32"}, False), ("fp32", "1", {"fp32"}, False),
    ("bf16", "0", {"fp32", "bf16"}, True)])
def test_plan_precision_and_predicted_step_time(tmp_path, capsys, monkeypatch, precision, native, precisions, warned):
    monkeypatch.setenv("BIGMEM_NATIVE_BF16", native)
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--budget", "2GiB", "--model", "small", "--batch-size", 1,
                                 "--precision", precision, "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert {c["precision"] for c in plan["candidates"]} == precisions
    assert all(c["predicted_step_s"] > 0 and c["step_rate_source"] for c in plan["candidates"])
    assert plan["chosen"]["predicted_step_s"] > 0
    assert f"step time: {plan['chosen']['predicted_step_s']:.3g} s predicted" in stdout
    assert ("bf16 is emulated" in stdout) == warned


def test_plan_inference_finds_the_largest_volume(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--inference", "--model", "small", "--budget", "2GiB", "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["kind"] == "inference"
    assert plan["fits"]
    assert plan["budget_source"] == "--budget"
    chosen = plan["chosen"]
    assert chosen["batch_size"] == 1
    assert chosen["precision"] == "fp32"
    assert chosen["recompute"] == "none"
    assert chosen["spatial_shape"] == [chosen["volume"]] * 3
    assert chosen["volume"] % 8 == 0
    assert plan["predicted_peak_bytes"] <= 2 * 2**30
    above = [c for c in plan["candidates"] if c["volume"] == chosen["volume"] + 8]
    assert above
    assert not above[0]["fits"]
    assert above[0]["predicted_peak_bytes"] > 2 * 2**30
    assert f"largest whole volume: {chosen['volume']}^3" in stdout
    assert "small inference (fp32, one whole volume) within 2.00 GiB (--budget)" in stdout


def test_plan_inference_fixed_volume_exits_3_naming_what_fits(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--inference", "--model", "small", "--budget", "2GiB", "--out", out], capsys)
    largest = json.loads(out.read_text())["chosen"]
    fixed = tmp_path / "fixed.json"
    code, stdout, err = run_cli(["plan", "--inference", "--model", "small", "--budget", "2GiB",
                                 "--volume", largest["volume"] + 64, "--out", fixed], capsys)
    assert code == 3
    assert err.startswith("bigmem plan: error: Predicted peak ")
    assert (f"for small at {largest['volume'] + 64}^3 (inference, fp32) exceeds the memory budget 2.00 GiB "
            f"(--budget): the largest whole volume that fits is {largest['volume']}^3 (est. ") in err
    assert "; segment it in sliding windows, or predict with --ignore-plan to try anyway." in err
    plan = json.loads(fixed.read_text())  # written before the refusal, as bigmem plan does
    assert plan["kind"] == "inference"
    assert not plan["fits"]
    assert plan["chosen"]["volume"] == largest["volume"] + 64
    assert f"{largest['volume'] + 64}^3 does not fit" in stdout


def test_plan_inference_nothing_fits_exits_3(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--inference", "--model", "small", "--budget", "10MiB", "--out", out], capsys)
    assert code == 3
    assert err.startswith("bigmem plan: error: Nothing fits 10.00 MiB (--budget): the smallest whole volume, 8^3 "
                          "(inference, fp32), needs ")
    assert json.loads(out.read_text())["fits"] is False


def test_plan_inference_takes_the_precision_and_refuses_a_batch(tmp_path, capsys):
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--inference", "--model", "small", "--budget", "2GiB", "--precision", "bf16",
                            "--out", out], capsys)
    assert code == 0, err
    assert json.loads(out.read_text())["chosen"]["precision"] == "bf16"
    code, _, err = run_cli(["plan", "--inference", "--model", "small", "--batch-size", 2, "--out", out], capsys)
    assert code == 2
    assert err.strip() == "bigmem plan: error: --inference segments one volume at a time: --batch-size does not apply."


def _fake_topology(monkeypatch, root):
    """Make ``bigmem plan`` read the nodes of the fake sysfs tree at ``root``."""
    from bigmem.numa.topology import NUMATopology

    read = NUMATopology.from_sysfs.__func__
    monkeypatch.setattr(NUMATopology, "from_sysfs", classmethod(lambda cls, _root="/": read(cls, root)))


def test_plan_shows_both_layouts_on_several_nodes(tmp_path, capsys, monkeypatch):
    from helpers import make_sysfs

    # Node 1's 2 GiB free: interleaved, 2 x 2 GiB holds anything the 4 GiB budget admits; a whole
    # worker on node 1 does not (the largest volume within 4 GiB needs more than 2).
    _fake_topology(monkeypatch, make_sysfs(tmp_path / "sysfs", [("0-1", 8, 5), ("2-3", 8, 2)], [[10, 21], [21, 10]]))
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--budget", "4GiB", "--model", "small", "--batch-size", 1, "--out", out],
                                capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    layouts = plan["layouts"]
    peak = plan["predicted_peak_bytes"]
    assert 2 * 2**30 < peak <= 4 * 2**30
    assert layouts["recommended"] == "interleave"
    assert layouts["interleave"]["fits"]
    assert layouts["interleave"]["predicted_peak_bytes"] == peak
    assert not layouts["per_node"]["fits"]
    assert layouts["per_node"]["num_processes"] == 2
    assert layouts["per_node"]["reason"].endswith("on its own node; node 1 has 2.00 GiB free")
    assert "layouts on 2 NUMA nodes" in stdout
    assert "interleave *" in stdout
    assert "per-node: each worker needs" in stdout
    assert "layout: interleave (bigmem train --numa interleave)" in stdout
    assert ("why: per-node keeps each worker's memory traffic on its own node; interleave sends (N-1)/N = 1/2 of "
            "one process's accesses to other nodes, but it is the only layout for a job whose batch of 1 needs more "
            "than one node's memory. Neither layout's throughput was measured here.") in stdout
    code, stdout, err = run_cli(["plan", "--budget", "4GiB", "--model", "small", "--batch-size", 1, "--json",
                                 "--out", tmp_path / "again.json"], capsys)
    assert code == 0, err
    assert json.loads(stdout)["layouts"] == layouts


def test_plan_on_one_node_has_no_layouts(tmp_path, capsys, monkeypatch):
    from helpers import make_sysfs

    _fake_topology(monkeypatch, make_sysfs(tmp_path / "sysfs", [("0-1", 8, 6)], [[10]]))
    out = tmp_path / "plan.json"
    code, stdout, err = run_cli(["plan", "--budget", "2GiB", "--model", "tiny", "--volume", 16, "--out", out], capsys)
    assert code == 0, err
    assert "layouts" not in json.loads(out.read_text())
    assert "layout" not in stdout


def test_without_a_budget_several_nodes_size_the_search_by_what_interleave_holds(tmp_path, capsys, monkeypatch):
    from helpers import make_sysfs

    # 5 + 2 GiB free: MemAvailable-sized, the search could choose 6 GiB, which neither layout holds.
    _fake_topology(monkeypatch, make_sysfs(tmp_path / "sysfs", [("0-1", 8, 5), ("2-3", 8, 2)], [[10, 21], [21, 10]]))
    monkeypatch.setattr("bigmem.memory.budget.available_memory_bytes", lambda: 7 * 2**30)
    out = tmp_path / "plan.json"
    code, _, err = run_cli(["plan", "--model", "small", "--batch-size", 1, "--out", out], capsys)
    assert code == 0, err
    plan = json.loads(out.read_text())
    assert plan["budget_source"] == "2 interleaved node(s) x the smallest free 2.00 GiB"
    assert plan["budget_bytes"] == 4 * 2**30
    assert plan["layouts"]["interleave"]["fits"]


@pytest.mark.parametrize("columns", [80, 200])
@pytest.mark.parametrize("inference", [False, True], ids=["training", "inference"])
def test_plan_tables_show_the_whole_shape(tmp_path, capsys, monkeypatch, columns, inference):
    monkeypatch.setenv("COLUMNS", str(columns))
    argv = ["plan", "--budget", "16GiB", "--model", "tiny", "--shape", "200,240,192", "--out", tmp_path / "plan.json"]
    code, stdout, err = run_cli(argv + ["--inference"] * inference, capsys)
    assert code == 0, err
    rows = [line for line in stdout.splitlines() if line.startswith("│")]  # the table's body
    assert any("200x240x192" in row for row in rows)
    assert not any("…" in row for row in rows)


@pytest.mark.parametrize("columns", [80, 200])
def test_plan_case_table_shows_whole_shapes(columns):
    from rich.console import Console

    from bigmem.cli.plan import _print_cases
    from bigmem.config.presets import resolve_config
    from bigmem.memory.records import CaseRow

    rows = [CaseRow(f"case_{i}", list(shape), [200, 240, 192], 2**34, True)
            for i, shape in enumerate([(197, 239, 190), (198, 237, 191), (199, 238, 189), (200, 240, 192)])]
    console = Console(width=columns, record=True)
    _print_cases(console, rows, resolve_config("tiny", {}))
    rows = [line for line in console.export_text().splitlines() if line.startswith("│")]
    assert any("200x240x192" in row for row in rows)
    assert any("197x239x190" in row for row in rows)
    assert not any("…" in row for row in rows)


@pytest.mark.parametrize("flags, message", [
    (["--shape", "50,50,50"], "Invalid --shape 50,50,50: axes 1, 2 and 3 (50, 50, 50) are not multiples of 8 (the "
                              "network downsamples 3 times). Try --shape 48,48,48 or 56,56,56."),
    (["--volume", "50"], "Invalid --volume 50: expected a multiple of 8 (the network downsamples 3 times). Try "
                         "--volume 48 or 56."),
])
def test_a_bad_shape_is_named_by_the_flag_given(tmp_path, capsys, flags, message):
    code, _, err = run_cli(["plan", "--model", "small", *flags, "--out", tmp_path / "plan.json"], capsys)
    assert code == 2
    assert err.strip() == f"bigmem plan: error: {message}"
