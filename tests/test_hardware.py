"""The processor description every benchmark prints and every measured choice records (``capserve.hardware``)."""

from __future__ import annotations

import ast
from pathlib import Path

from capserve.hardware import CpuInfo, cpu_info, parse_cpuinfo

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8
"""
EPYC_AVX2 = """processor\t: 0
model name\t: AMD EPYC 7B12
flags\t\t: fpu sse2 avx avx2 fma
"""
GRAVITON = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics asimddp i8mm bf16
"""


def test_the_kernels_flags_name_the_features_that_decide_speed():
    model, flags = parse_cpuinfo(XEON)
    assert model == "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz"
    assert flags == {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8"}
    assert parse_cpuinfo(EPYC_AVX2) == ("AMD EPYC 7B12", frozenset({"avx2", "fma"}))
    assert parse_cpuinfo(GRAVITON)[1] == {"asimddp", "i8mm", "bf16"}


def test_int8_dot_products_need_vnni_amx_or_the_arm_dot_product():
    def info(text: str) -> CpuInfo:
        return CpuInfo("cpu", "x86_64", 2, parse_cpuinfo(text)[1])

    assert info(XEON).int8_dot_products
    assert not info(EPYC_AVX2).int8_dot_products
    assert info(GRAVITON).int8_dot_products
    assert CpuInfo("cpu", "x86_64", 2, frozenset({"avx2", "avx_vnni"})).int8_dot_products
    assert CpuInfo("AMD EPYC 9B14", "x86_64", 2, frozenset({"avx2", "avx512f", "avx512_vnni"})).int8_dot_products


def test_the_description_names_model_cores_and_features():
    line = CpuInfo("AMD EPYC 7B12", "x86_64", 2, parse_cpuinfo(EPYC_AVX2)[1]).describe()
    assert line == "AMD EPYC 7B12 (x86_64, 2 cores; AVX2, FMA)"
    assert "no listed features" in CpuInfo("cpu", "riscv64", 1).describe()


def test_this_machine_is_described_and_features_can_be_stood_in_for():
    here = cpu_info()
    assert here.cores >= 1 and here.model and here.architecture
    assert cpu_info(features={"avx2"}).features == {"avx2"}


def test_every_benchmark_prints_the_cpu_it_ran_on_first():
    """A figure without its CPU cannot be compared: each benchmark's ``main`` starts by printing ``describe()``."""
    scripts = sorted((Path(__file__).parents[1] / "benchmarks").glob("*.py"))
    mains = {}
    for script in scripts:
        tree = ast.parse(script.read_text())
        mains[script] = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main"), None)
    assert {s.name for s, main in mains.items() if main} >= {"bench_http.py", "bench_int8.py", "int8_variants.py"}
    for script, main in mains.items():
        if main is None:  # a module the benchmarks share, not one to run
            continue
        first = ast.unparse(main.body[0])
        assert first.startswith("print(") and "cpu_info().describe()" in first, f"{script.name}: {first}"


def test_a_cgroup_limit_caps_the_cores_whatever_this_machines_count(tmp_path, monkeypatch):
    """A 1.5-CPU container on an 8-core node gets 2 cores' threads, a 4-CPU one on a 2-core machine keeps its 2:
    the smaller of affinity and quota, rounded up, on any machine the suite runs on."""
    import capserve.hardware as hardware

    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs (cgroup v2: quota, then period)
    assert hardware.available_cores(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert hardware.available_cores(tmp_path) == 8
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    (tmp_path / "cpu.max").write_text("400000 100000\n")  # 4 CPUs allowed, 2 to run on
    assert hardware.available_cores(tmp_path) == 2
