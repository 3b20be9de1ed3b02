"""Which build of the CPU kernels a CPU gets (kernels.choose_isa), from fake /proc/cpuinfo files: no build needed."""

from __future__ import annotations

import pytest

from services.inference.device import kernels

ZEN3_FLAGS = "fpu sse2 avx avx2 fma f16c bmi2"
CPUINFO_CASES = [
    ("avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni " + ZEN3_FLAGS, "avx512"),  # Zen 4, Sapphire Rapids
    ("avx512f avx512bw avx512vl avx512dq avx512_vnni " + ZEN3_FLAGS, "avx2"),  # Ice Lake: no avx512_bf16
    ("avx512f avx512bw avx512vl avx512dq avx512_bf16 " + ZEN3_FLAGS, "avx2"),  # no such CPU: VNNI came before BF16
    ("avx512f avx512bw avx512vl avx512dq " + ZEN3_FLAGS, "avx2"),  # Skylake-X: no avx512_bf16
    (ZEN3_FLAGS, "avx2"),  # Zen 2/3
    ("fpu sse2 avx avx2 fma", None),  # no f16c
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
    cpuinfo.write_text(f"flags\t\t: avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni {ZEN3_FLAGS}\n")
    assert kernels.choose_isa(cpuinfo, wanted="avx2")[0] is kernels.AVX2
    cpuinfo.write_text(f"flags\t\t: {ZEN3_FLAGS}\n")
    assert kernels.choose_isa(cpuinfo, wanted="avx512") == (
        None,
        "this CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_bf16, avx512_vnni (avx512)",
    )
    assert "no kernel build is named 'sse'" in kernels.choose_isa(cpuinfo, wanted="sse")[1]


def test_the_two_builds_differ_only_in_isa():
    assert kernels.AVX2.extension_name != kernels.AVX512.extension_name
    assert kernels.AVX2.build_dir != kernels.AVX512.build_dir
    assert "-DZQ_AVX2" in kernels.AVX2.compile_flags and "-DZQ_AVX2" not in kernels.AVX512.compile_flags
    assert not any("native" in flag for isa in kernels.ISAS for flag in isa.compile_flags)


def test_every_build_the_cpu_runs_is_offered_best_first(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"flags\t\t: avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni {ZEN3_FLAGS}\n")
    assert kernels.runnable_isas(cpuinfo) == ((kernels.AVX512, kernels.AVX2), None)
    assert kernels.runnable_isas(cpuinfo, wanted="avx2") == ((kernels.AVX2,), None)
    cpuinfo.write_text("flags\t\t: fpu sse2 avx\n")
    isas, reason = kernels.runnable_isas(cpuinfo)
    assert isas == () and "(avx512)" in reason and "(avx2)" in reason


def test_a_build_that_fails_falls_back_to_the_next_the_cpu_runs():
    # an image compiled on an AVX2 machine, run on an AVX-512 one: no compiler for AVX-512, the AVX2 build is there
    tried = []

    def build(isa):
        tried.append(isa.name)
        if isa is kernels.AVX512:
            raise RuntimeError("Ninja is required to load C++ extensions")
        return f"/opt/_build/{isa.name}/lib.so"

    assert kernels.first_built(((kernels.AVX512, kernels.AVX2), None), build) == (
        kernels.AVX2,
        "/opt/_build/avx2/lib.so",
    )
    assert tried == ["avx512", "avx2"]


def test_when_every_build_fails_the_reason_names_each():
    def build(isa):
        raise OSError(f"no compiler for {isa.name}")

    isa, reason = kernels.first_built(((kernels.AVX512, kernels.AVX2), None), build)
    assert isa is None
    assert "avx512 CPU kernels failed: no compiler for avx512" in reason and "no compiler for avx2" in reason
    assert kernels.first_built(((), "this CPU lacks avx2 (avx2)"), build) == (None, "this CPU lacks avx2 (avx2)")
