"""native_bf16: one decision from the CPU's ISA class (or AVX-NE-CONVERT), overridable."""

import pytest

from bigmem.sysinfo import native_bf16


@pytest.mark.parametrize("flags,native", [
    ("fpu avx2 fma", False), ("avx2 avx512f avx512bw", False), ("avx2 avx512f avx512_bf16", True),
    ("avx2 avx512f amx_tile amx_bf16", True), ("avx2 avx_vnni avx_ne_convert", True)])
def test_from_the_cpu_flags(tmp_path, monkeypatch, flags, native):
    monkeypatch.delenv("BIGMEM_NATIVE_BF16", raising=False)
    monkeypatch.delenv("BIGMEM_ISA_CLASS", raising=False)  # the flags below decide, not a forced class
    (tmp_path / "cpuinfo").write_text(f"model name\t: Test CPU\nflags\t\t: {flags}\n")
    assert native_bf16(tmp_path) is native
    monkeypatch.setenv("BIGMEM_NATIVE_BF16", "0" if native else "1")
    assert native_bf16(tmp_path) is (not native)


@pytest.mark.parametrize("forced, native", [("avx2", False), ("avx512", False), ("avx512_bf16", True), ("amx", True)])
def test_a_forced_class_decides_over_the_flags(tmp_path, monkeypatch, forced, native):
    from bigmem.cpu import cpu_description, isa_class

    monkeypatch.delenv("BIGMEM_NATIVE_BF16", raising=False)
    monkeypatch.setenv("BIGMEM_ISA_CLASS", forced)
    flags = "avx2 fma avx512f avx512_bf16 avx_ne_convert"
    (tmp_path / "cpuinfo").write_text(f"model name\t: Test CPU\nflags\t\t: {flags}\n")
    assert isa_class(cpu_description(tmp_path)["isa"]) == forced
    assert native_bf16(tmp_path) is native


def test_a_forced_class_that_is_none_is_refused(monkeypatch):
    from bigmem.cpu import cpu_description
    from bigmem.errors import UsageError

    monkeypatch.setenv("BIGMEM_ISA_CLASS", "avx1024")
    with pytest.raises(UsageError, match=r"^Invalid BIGMEM_ISA_CLASS='avx1024': expected one of amx, avx512_bf16, "
                                         r"avx512, avx2, or unset it"):
        cpu_description()
