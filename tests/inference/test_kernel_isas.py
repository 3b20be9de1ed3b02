"""Which build of the CPU kernels a CPU gets (kernels.choose_isa), from fake /proc/cpuinfo files: no build needed."""
from __future__ import annotations

import pytest

from services.inference import kernels


ZEN3_FLAGS = "fpu sse2 avx avx2 fma f16c bmi2"
CPUINFO_CASES = [
    ("avx512f avx512bw avx512vl avx512dq avx512_bf16 " + ZEN3_FLAGS, "avx512"),   # Zen 4, Sapphire Rapids
    ("avx512f avx512bw avx512vl avx512dq " + ZEN3_FLAGS, "avx2"),                # Skylake-X: no avx512_bf16
    (ZEN3_FLAGS, "avx2"),                                                        # Zen 2/3
    ("fpu sse2 avx avx2 fma", None),                                             # no f16c
    ("fpu sse2 avx", None),
]


@pytest.mark.parametrize("flags,expected", CPUINFO_CASES)
def test_load_takes_the_best_isa_the_cpu_runs(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    isa, reason = kernels.choose_isa(cpuinfo)
    assert (isa.name if isa else None) == expected
    assert (reason is None) == (expected is not None)
    if expected is None:
        assert "avx512_bf16" in reason and "(avx2)" in reason


def test_an_isa_can_be_asked_for_by_name(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"flags\t\t: avx512f avx512bw avx512vl avx512dq avx512_bf16 {ZEN3_FLAGS}\n")
    assert kernels.choose_isa(cpuinfo, wanted="avx2")[0] is kernels.AVX2
    cpuinfo.write_text(f"flags\t\t: {ZEN3_FLAGS}\n")
    assert kernels.choose_isa(cpuinfo, wanted="avx512") == (None, "this CPU lacks avx512f, avx512bw, avx512vl, "
                                                                   "avx512dq, avx512_bf16 (avx512)")
    assert "no kernel build is named 'sse'" in kernels.choose_isa(cpuinfo, wanted="sse")[1]


def test_the_two_builds_differ_only_in_isa():
    assert kernels.AVX2.extension_name != kernels.AVX512.extension_name
    assert kernels.AVX2.build_dir != kernels.AVX512.build_dir
    assert "-DZQ_AVX2" in kernels.AVX2.compile_flags and "-DZQ_AVX2" not in kernels.AVX512.compile_flags
    assert not any("native" in flag for isa in kernels.ISAS for flag in isa.compile_flags)
