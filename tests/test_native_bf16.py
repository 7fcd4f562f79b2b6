"""native_bf16: one decision from the CPU's ISA class (or AVX-NE-CONVERT), overridable."""

import pytest

from bigmem.sysinfo import native_bf16


@pytest.mark.parametrize("flags,native", [
    ("fpu avx2 fma", False), ("avx2 avx512f avx512bw", False), ("avx2 avx512f avx512_bf16", True),
    ("avx2 avx512f amx_tile amx_bf16", True), ("avx2 avx_vnni avx_ne_convert", True)])
def test_from_the_cpu_flags(tmp_path, monkeypatch, flags, native):
    monkeypatch.delenv("BIGMEM_NATIVE_BF16", raising=False)
    (tmp_path / "cpuinfo").write_text(f"model name\t: Test CPU\nflags\t\t: {flags}\n")
    assert native_bf16(tmp_path) is native
    monkeypatch.setenv("BIGMEM_NATIVE_BF16", "0" if native else "1")
    assert native_bf16(tmp_path) is (not native)
