"""The CPU model bigmem keys tables and tunings on: the name, and the x86 family and model where the name is masked."""

import pytest

from bigmem.cpu import cpu_description, model_name


def test_a_masked_name_gets_its_family_and_model():
    assert model_name("Intel(R) Xeon(R) Processor", "6", "207") == "Intel(R) Xeon(R) Processor (family 6 model 207)"


def test_a_name_with_a_model_number_stays_as_it_is():
    assert model_name("Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "6", "143") == (
        "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz")


@pytest.mark.parametrize("family, model", [("", ""), ("6", ""), ("", "207")])
def test_without_family_and_model_the_name_stays(family, model):
    assert model_name("AMD EPYC", family, model) == "AMD EPYC"


def test_cpu_description_reads_family_and_model_from_cpuinfo(tmp_path, monkeypatch):
    monkeypatch.delenv("BIGMEM_ISA_CLASS", raising=False)
    (tmp_path / "cpuinfo").write_text("processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
                                      "flags\t\t: avx2\n\nprocessor\t: 1\ncpu family\t: 26\nmodel\t\t: 2\n")
    assert cpu_description(tmp_path)["model"] == "AMD EPYC (family 26 model 2)"


def test_two_generations_behind_one_masked_name_are_two_models():
    assert model_name("Intel(R) Xeon(R) Processor", "6", "143") != model_name("Intel(R) Xeon(R) Processor", "6", "207")
