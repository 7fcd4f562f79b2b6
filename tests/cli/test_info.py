"""``bigmem info``: the machine as JSON and as a table, with and without TensorFlow."""

from __future__ import annotations

import json

from helpers import run_cli


def test_info_json_without_tensorflow(capsys):
    code, out, _ = run_cli(["info", "--json", "--no-tensorflow"], capsys)
    assert code == 0
    info = json.loads(out)
    assert info["cpu"]["logical_cpus"] >= 1
    assert set(info["cpu"]["isa"]) >= {"avx512f", "avx512_bf16", "amx_bf16"}
    assert info["numa"]["nodes"][0]["node"] == 0
    assert info["numa"]["nodes"][0]["cpus"]
    assert info["numa"]["libnuma"] == "available"
    assert info["memory"]["total_bytes"] > 0
    assert "tensorflow" not in info


def test_info_reports_tensorflow_and_onednn(capsys):
    code, out, _ = run_cli(["info", "--json"], capsys)
    assert code == 0
    tf_info = json.loads(out)["tensorflow"]
    assert int(tf_info["tensorflow"].split(".")[1]) >= 16 or int(tf_info["tensorflow"].split(".")[0]) > 2
    assert tf_info["keras"].startswith("3.")
    assert isinstance(tf_info["onednn_enabled"], bool)


def test_info_table(capsys):
    code, out, _ = run_cli(["info", "--no-tensorflow"], capsys)
    assert code == 0
    assert "NUMA nodes" in out
    assert "avx512f" in out


def test_info_says_which_networks_plan_on_a_borrowed_fixed_term(capsys, tmp_path, monkeypatch):
    """Untuned on an unseen CPU every network borrows; once a network's term is measured, info says so."""
    import dataclasses

    from bigmem.config import resolve_config
    from bigmem.memory import calibration
    from bigmem.nets import tuning
    from bigmem.tune import fixed_memory_key

    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path / "tuning"))
    monkeypatch.setattr(calibration, "machine_cpu_model", lambda: "a CPU no table was measured on")
    code, out, _ = run_cli(["info", "--json", "--no-tensorflow"], capsys)
    assert code == 0
    terms = json.loads(out)["memory_terms"]
    assert set(terms) == {"intelai-brats", "kits19", "resenc-m", "small"}
    assert terms["small"].startswith("borrowed from ")
    assert terms["small"].endswith(" until its first run measures it")
    tuning.save_tuning(tuning.Tuning(key=dataclasses.asdict(tuning.key_here()), planewise={}, conv_gflops_per_core={},
                                     overhead_offset_bytes={fixed_memory_key(resolve_config("small")): 63 * 2**20},
                                     tuned=[], rows=[]))
    code, out, _ = run_cli(["info", "--json", "--no-tensorflow"], capsys)
    assert json.loads(out)["memory_terms"]["small"] == "measured here (+63.00 MiB)"
