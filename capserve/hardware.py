"""The processor this process runs on: its model and the instruction sets that decide capserve's speed.

Every measured choice (INT8 against fp32, bf16, workers) and every benchmark figure depends on these: u8s8 int8
kernels saturate without VNNI, bf16 is emulated without AVX-512 BF16 or AMX, and two AVX2 cores behave unlike two
AVX-512 ones. ``cpu_info()`` reads them from the kernel (``/proc/cpuinfo``), independent of any library's dispatch,
and ``CpuInfo.describe()`` is the one line that benchmarks print and artifacts record.
"""

from __future__ import annotations

import math
import os
import platform
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FEATURES", "CpuInfo", "available_cores", "cpu_info"]

# The flags that matter to capserve, as the Linux kernel names them, with the name a reader knows them by.
FEATURES = {
    "avx2": "AVX2",
    "fma": "FMA",
    "avx512f": "AVX-512",
    "avx512_vnni": "AVX-512 VNNI",
    "avx_vnni": "AVX-VNNI",
    "avx512_bf16": "AVX-512 BF16",
    "amx_bf16": "AMX-BF16",
    "amx_int8": "AMX-INT8",
    "asimddp": "Arm dot product",
    "i8mm": "Arm I8MM",
    "bf16": "Arm BF16",
}
INT8_DOT_PRODUCTS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8", "asimddp", "i8mm"})
CPUINFO = Path("/proc/cpuinfo")


@dataclass(frozen=True)
class CpuInfo:
    """A processor's model name, architecture, usable cores and the ``FEATURES`` it has (kernel flag names)."""

    model: str
    architecture: str
    cores: int
    features: frozenset[str] = field(default_factory=frozenset)

    @property
    def int8_dot_products(self) -> bool:
        """Hardware int8 dot products (VNNI, AMX-INT8, Arm's dot product): without them x86's u8s8 kernels
        multiply in 16 bits and can saturate, and int8 is rarely faster than fp32."""
        return bool(self.features & INT8_DOT_PRODUCTS)

    def describe(self) -> str:
        """One line: model, architecture, cores and the relevant features present, e.g. ``AMD EPYC (x86_64, 2
        cores; AVX2, FMA, AVX-512, AVX-512 VNNI, AVX-512 BF16)``."""
        names = [label for flag, label in FEATURES.items() if flag in self.features]
        return f"{self.model} ({self.architecture}, {self.cores} cores; {', '.join(names) or 'no listed features'})"

    def to_dict(self) -> dict[str, object]:
        return {"model": self.model, "architecture": self.architecture, "features": sorted(self.features)}


CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cores(cgroup: Path = CGROUP_ROOT) -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a container's CPU limit,
    e.g. a Kubernetes ``resources.limits.cpu``), which affinity does not show: a 2-CPU pod on a 64-core node
    would otherwise start 64 threads per session and be throttled."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = _cgroup_quota(cgroup)
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def _cgroup_quota(root: Path) -> float | None:
    """CPUs allowed by the cgroup CPU quota (v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``), None when unlimited."""
    try:
        text = (root / "cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """The model name and the ``FEATURES`` flags from ``/proc/cpuinfo`` text (x86 ``flags``, Arm ``Features``)."""
    model, flags = "", set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip().lower()
        if key in ("model name", "hardware", "cpu model") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(value.split())
    return model, frozenset(flags & FEATURES.keys())


def cpu_info(features: Iterable[str] | None = None) -> CpuInfo:
    """This machine's processor. ``features`` overrides the detected flags (tests stand in for other CPUs)."""
    try:
        model, found = parse_cpuinfo(CPUINFO.read_text())
    except OSError:
        model, found = "", frozenset()
    if features is not None:
        found = frozenset(features)
    return CpuInfo(model or platform.processor() or "unknown CPU", platform.machine(), available_cores(), found)
