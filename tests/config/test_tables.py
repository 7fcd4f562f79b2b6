"""The shipped measured tables: each file loads, holds today's values, and says where every entry came from."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bigmem.config import tables
from bigmem.errors import DataError

ROOT = Path(__file__).resolve().parents[2]


def _entry(**values) -> dict:
    return {"isa_class": "avx2", "machine": {"cpu": "Test CPU", "isa_class": "avx2", "tensorflow": "2.21.0"},
            "summary": "test", "date": "2026-12-02", "command": "python bench.py", "results": [], "notes": ["n"],
            **values}


@pytest.mark.parametrize("name", tables.NAMES)
def test_every_entry_says_where_it_came_from(name):
    entries = tables.load(name)
    assert entries, name
    for key, entry in entries.items():
        assert all(field in entry for field in tables.PROVENANCE_FIELDS), key
        assert entry["notes"], key
        assert all(isinstance(note, str) and note for note in entry["notes"]), key
        assert str(entry["date"]).startswith("2026-"), key
        for path in entry["results"]:  # the results files are in the repository, by their machine-keyed names
            assert path.startswith("benchmarks/results/"), path
            assert "-vm-" not in path, path
            assert (ROOT / path).is_file(), path
        if entry["command"] is None:  # decided on paper, or a hand script: the notes say which
            assert not any(p.endswith(".json") for p in entry["results"]), key
        else:
            assert {"cpu", "isa_class", "tensorflow"} <= set(entry["machine"]), key


def test_training_memory_holds_the_measured_knots():
    entries = tables.load("training_memory")
    assert set(entries) == {"avx512_bf16-amd-epyc", "amx-intel-xeon", "avx2-amd-epyc",
                            "amx-intel-xeon-family-6-model-207"}
    amd = entries["avx512_bf16-amd-epyc"]
    assert (amd["isa_class"], amd["machine"]["cpu"], amd["machine"]["tensorflow"]) == ("avx512_bf16", "AMD EPYC",
                                                                                        "2.21.0")
    assert amd["batch_size"] == 1
    assert len(amd["tables"]) == 12
    small = next(t for t in amd["tables"] if (t["preset"], t["precision"], t["recompute"]) == ("small", "fp32", "none"))
    assert {"volume": 128, "counted_activation_bytes": 1_571_291_136, "overhead_bytes": 2_057_447_760} in small["knots"]
    brats = next(t for t in amd["tables"] if (t["preset"], t["precision"], t["recompute"]) == ("intelai-brats", "fp32",
                                                                                                 "none"))
    assert brats["knots"][-1] == {"volume": 256, "counted_activation_bytes": 30_452_744_192,
                                  "overhead_bytes": 24_054_063_584}  # the lower bound of a run killed at 22.80 GiB
    assert any("22.80" in note for note in amd["notes"])
    amx = entries["amx-intel-xeon"]
    kits = next(t for t in amx["tables"] if (t["preset"], t["precision"], t["recompute"]) == ("kits19", "bf16", "none"))
    assert [k["volume"] for k in kits["knots"]] == [32, 64, 96, 128, 160, 192, 224]
    assert kits["knots"][-1]["overhead_bytes"] == 13_616_797_020
    assert "memory_model-amx-intel-xeon-20261201-144530.json" in amx["results"][0]
    avx2 = entries["avx2-amd-epyc"]  # resenc-m only
    assert {(t["preset"], t["precision"], t["recompute"]) for t in avx2["tables"]} == {
        ("resenc-m", "fp32", "none"), ("resenc-m", "fp32", "stages")}
    resenc = next(t for t in avx2["tables"] if t["recompute"] == "none")
    assert [k["volume"] for k in resenc["knots"]] == [32, 64, 96, 128]
    assert resenc["knots"][-1]["overhead_bytes"] == 8_052_341_232


def test_the_modules_read_the_tables():
    from bigmem.memory.calibration import DEFAULTS_BATCH_SIZE, SHIPPED, SHIPPED_MACHINES
    from bigmem.speed import MEASURED_RATES, RATE_SOURCES
    from bigmem.nets.choices import CHOICES

    assert SHIPPED[("avx512_bf16", "small", "fp32", "none")][3] == (128, 1_571_291_136, 2_057_447_760)
    assert SHIPPED[("amx", "small", "bf16", "stages")][-1] == (400, 21_264_000_000, 14_986_606_928)
    assert len([key for key in SHIPPED if key[3] != "inference"]) == 28  # 12 per class, and resenc-m on avx2 and amx
    assert SHIPPED_MACHINES[("amx", "small", "bf16", "stages")] == "Intel Xeon 2 vCPU amx, TF 2.21.0, 2026-12-01"
    assert {e["batch_size"] for e in tables.load("training_memory").values()} == {DEFAULTS_BATCH_SIZE}
    assert SHIPPED[("avx512_bf16", "kits19", "fp32", "inference")][-1] == (256, 11_341_398_016, 14_192_655_476)
    assert SHIPPED[("avx512_bf16", "small", "bf16", "inference")] == ((32, 3_473_408, 646_633_044),
                                                                    (64, 27_787_264, 690_161_236),
                                                                    (128, 222_298_112, 968_562_260))
    assert MEASURED_RATES == {("avx512_bf16", "fp32"): {8: 99.0, 32: 211.0},
                              ("avx512_bf16", "bf16"): {8: 91.0, 32: 350.0},
                              ("amx", "fp32"): {8: 44.5, 32: 109.5}, ("amx", "bf16"): {8: 61.5, 32: 288.5},
                              ("avx2", "fp32"): {8: 13.4}, ("avx2", "bf16"): {8: 0.65}}
    assert RATE_SOURCES["amx"] == "amx: measured (bench_train, Intel Xeon with AMX, TF 2.21.0)"
    assert CHOICES["avx2"].planewise == {("fp32", 1): (8, 32), ("fp32", 2): (8, 64)}
    assert CHOICES["amx"].planewise == {("bf16", 1): (1, 4096), ("bf16", 2): (1, 4096), ("fp32", 2): (64, 64)}
    assert CHOICES["amx"].planewise_others == frozenset({"bf16"})
    assert CHOICES["baseline"].planewise == {}
    assert "kernel_choices-avx512_bf16-amd-epyc-20261130-195005.json" in CHOICES["avx512"].source


def test_every_step_rate_entry_has_both_precisions():
    for key, entry in tables.load("step_rates").items():  # speed.step_rate looks up fp32 and bf16 for every class
        assert {r["precision"] for r in entry["rates"]} == {"fp32", "bf16"}, key


def test_every_inference_entry_is_one_model():
    for key, entry in tables.load("inference_memory").items():
        assert key == f"{key.split('/')[0]}/{entry['preset']}"
        assert {t["preset"] for t in entry["tables"]} == {entry["preset"]}, key


def test_write_entry_replaces_one_entry_and_keeps_the_others(tmp_path):
    tables.write_entry("step_rates", "avx2-test-cpu", _entry(rates=[]), directory=tmp_path)
    tables.write_entry("step_rates", "amx-other", _entry(isa_class="amx", rates=[]), directory=tmp_path)
    path = tables.write_entry("step_rates", "avx2-test-cpu", _entry(date="2026-12-03", rates=[1]),
                              directory=tmp_path)
    assert path == tmp_path / "step_rates.json"
    entries = tables.load("step_rates", directory=tmp_path)
    assert list(entries) == ["avx2-test-cpu", "amx-other"]
    assert entries["avx2-test-cpu"]["rates"] == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["step_rates.json"]  # atomically: no temporary left beside it


def test_an_entry_without_its_provenance_is_refused(tmp_path):
    entry = _entry()
    del entry["command"]
    with pytest.raises(DataError, match=r"'step_rates', entry 'k': no command \(every entry says"):
        tables.write_entry("step_rates", "k", entry, directory=tmp_path)
    with pytest.raises(DataError, match=r"entry 'k': no machine.tensorflow"):
        tables.write_entry("step_rates", "k", _entry(machine={"cpu": "x", "isa_class": "avx2"}), directory=tmp_path)
    with pytest.raises(DataError, match="'results' and 'notes' must be lists, got str and list"):
        tables.write_entry("step_rates", "k", _entry(results="a.json"), directory=tmp_path)
    assert not (tmp_path / "step_rates.json").exists()
    # decided on paper: no command, so no machine needed
    tables.write_entry("kernel_choices", "baseline", _entry(machine=None, command=None), directory=tmp_path)
    assert tables.load("kernel_choices", directory=tmp_path)["baseline"]["machine"] is None


def test_a_broken_table_is_named_and_not_written_to(tmp_path):
    (tmp_path / "step_rates.json").write_text("{not json")
    with pytest.raises(DataError, match=r"Cannot read the measured table .*step_rates.json"):
        tables.load("step_rates", directory=tmp_path)
    with pytest.raises(DataError, match="Cannot read the measured table"):
        tables.write_entry("step_rates", "k", _entry(), directory=tmp_path)
    assert (tmp_path / "step_rates.json").read_text() == "{not json"
    with pytest.raises(ValueError, match=r"Unknown measured table 'step_rate': expected one of .* "
                                         r"Did you mean 'step_rates'\?"):
        tables.load("step_rate")


def test_serving_takes_the_newest_entry_of_a_class():
    entries = {"old": _entry(date="2026-11-30/2026-12-01", summary="old"), "amx": _entry(isa_class="amx"),
               "new": _entry(date="2026-12-01", summary="new"), "older": _entry(date="2026-11-01", summary="older")}
    served = tables.serving(entries, "isa_class")
    assert list(served) == [("avx2",), ("amx",)]
    assert served[("avx2",)]["summary"] == "new"  # equal date: the later


def test_the_shipped_files_are_as_write_entry_writes_them():
    """A generator's --write-table rewrites a whole file: the shipped ones are in its format, so its diff is the
    entry it replaced."""
    for name in tables.NAMES:
        path = tables.table_path(name)
        assert path.read_text() == json.dumps(json.loads(path.read_text()), indent=2) + "\n", name
