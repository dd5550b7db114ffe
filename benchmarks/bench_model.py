"""Latency, throughput, peak memory and achieved GFLOP/s of whole models against their backbone alone.

Usage:
    python benchmarks/bench_model.py                      # cifar10-resnet, batch 64 and 1, T = 1, 2, 3
    python benchmarks/bench_model.py --model cifar10-simple --model cifar100-resnet --batch 64 --repeats 5
    python benchmarks/bench_model.py --batch 64 --iterations 2 3 --peak 250 5 --peak 64 5 --onnx-peak 32 3

What is measured, all in one run so that the ratios compare like with like on a shared machine:
    backbone   the CNN alone, ``model.backbone(x)``
    capsules   everything after the backbone (primary capsules, routing, logits): the model is run with its
               backbone replaced by a lookup of the backbone's precomputed output
    whole      ``model(x, iterations=T)``
Each is timed ``--repeats`` times, interleaved round by round (so a burst of load from other processes hits
every configuration alike), under ``torch.inference_mode()``; the medians are reported, and the ratio
whole/backbone is also given from the fastest rounds ("min"), the better estimate when other processes share
the cores.

The big attention steps run through the compiled fused kernel (``capserve.routing.fused.fused_block``) where it applies;
its compile happens in the warm-up round, and the last line of each model's table says whether it ran. For the
eager passes alone: ``CAPSERVE_FUSED_ROUTING=0 python benchmarks/bench_model.py …``.

Capsule GFLOP are counted analytically as the useful multiply-adds of the maths (×2): the primary conv,
B·P·N·J·r·X·Y for every vote product or uniform pass (r pose rows of X values mapped to Y values, for each of
N children × J parents at P positions), B·P·N·J·D each for the agreement and the weighted sum, and the logit
head; LayerNorm, softmax and the zeros of block-diagonal weights are not counted. The machine's reference is a
2048³ fp32 matmul timed in the same run.

Peak memory is the RSS high-water mark (``VmHWM``, else ``ru_maxrss``) of a fresh subprocess that builds the
model and runs two forward passes of one (batch, T) configuration; "base" is the same
process's high-water mark just before the first forward pass (interpreter, torch, weights, input).
``--peak B T`` adds such rows without timing (e.g. batch 250 at T = 5); ``--onnx-peak B T`` exports the model
with T unrolled (``capserve.export.onnx``, in this process) and measures fresh subprocesses that open the file with
capserve's ONNX Runtime wrapper (CPU) and run it twice on a batch of B ("base": after importing it, before the
session): whole batches with its memory arena on and off, and the chunks its default memory budget chooses; a
further subprocess times the three interleaved (median ms per batch of B).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

from capserve.hardware import cpu_info
from capserve.routing.fused import compiled_kernels


def matmul_gflops(size: int = 2048, repeats: int = 5) -> float:
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * size**3 / statistics.median(times) / 1e9


def capsule_flops(model, batch: int, iterations: int) -> float:
    """Useful floating-point operations after the backbone (see the module docstring)."""
    c = model.config
    side = c.spatial_sizes[0]
    # primary capsules: a conv from the backbone's channels to I·D channels
    flops = 2 * batch * side**2 * c.backbone_channels * c.primary_types * c.pose_dim * c.primary_kernel**2
    steps = []  # per layer: (P, N, J, r, X, Y, D)
    sizes = (*c.spatial_sizes, *[0] * len(model.capsules))
    for i, layer in enumerate(model.capsules):
        N, J, X, Y = layer.weight.shape
        r = c.pose_dim // X
        P = 1 if layer.kind == "fc" else sizes[i + 1] ** 2
        steps.append((P, N, J, r, X, Y, r * Y))
    L = len(steps)
    for i, (P, N, J, r, X, Y, D) in enumerate(steps):
        vote = 2 * batch * P * N * J * r * X * Y
        if c.routing == "sequential":
            routed = iterations - 1
        else:  # concurrent: layer i's update at iteration t reaches the output only if t <= T - (L - 1 - i)
            routed = sum(1 for t in range(2, iterations + 1) if t <= iterations - (L - 1 - i))
        flops += vote + routed * (vote + 2 * (2 * batch * P * N * J * D))  # uniform pass, then votes + 2 reads
    flops += 2 * batch * c.num_classes * c.pose_dim  # shared Linear(D, 1)
    return flops


class _Lookup(nn.Module):
    """Stands in for the backbone: returns its precomputed output."""

    def __init__(self, features: torch.Tensor):
        super().__init__()
        self.features = features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features


def time_configurations(name: str, batch: int, iterations: list[int], repeats: int) -> dict:
    import capserve

    torch.manual_seed(0)
    model = capserve.create_model(name).eval()
    capsules = capserve.create_model(name).eval()
    capsules.load_state_dict(model.state_dict())
    size = model.config.image_size
    x = torch.randn(batch, model.config.in_channels, size, size)
    with torch.inference_mode():
        capsules.backbone = _Lookup(model.backbone(x))
        runs = {("backbone", 0): lambda: model.backbone(x)}
        for T in iterations:
            runs["capsules", T] = lambda T=T: capsules(x, iterations=T)
            runs["whole", T] = lambda T=T: model(x, iterations=T)
        for run in runs.values():  # warm-up
            run()
        times: dict = {key: [] for key in runs}
        for _ in range(repeats):
            for key, run in runs.items():
                start = time.perf_counter()
                run()
                times[key].append(time.perf_counter() - start)
    return {key: (statistics.median(t), min(t)) for key, t in times.items()}


def peak_rss_mb(name: str, batch: int, iterations: int | None, threads: int) -> tuple[float, float]:
    """(base, peak) RSS high-water marks in MB of a fresh process running one configuration (iterations None: a
    model without routing, a baseline CNN)."""
    command = [sys.executable, __file__, "--child", name, str(batch), str(iterations), str(threads)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    data = json.loads(result.stdout.strip().splitlines()[-1])
    return data["base"], data["peak"]


def _high_water_mb() -> float:
    """This process's peak RSS. Linux keeps ``ru_maxrss`` across fork + exec (a child would report its parent's
    peak), so read the address space's own ``VmHWM`` where there is one."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1024 * 1024 if sys.platform == "darwin" else 1024)


def _child(name: str, batch: int, iterations: int | None, threads: int) -> None:
    import capserve

    torch.set_num_threads(threads)
    model = capserve.create_model(name).eval()
    size = model.config.image_size
    x = torch.randn(batch, model.config.in_channels, size, size)
    base = _high_water_mb()
    with torch.inference_mode():
        for _ in range(2):
            model(x, iterations=iterations)
    peak = _high_water_mb()
    print(json.dumps({"base": base, "peak": peak}))


# ONNX Runtime variants measured per --onnx-peak row: (label, memory budget in MB or None for whole batches, arena)
ONNX_VARIANTS = (("whole batch", None, True), ("whole, no arena", None, False), ("chunks", "default", True))


def export_for_peak(name: str, iterations: int, folder: str) -> str:
    import capserve
    from capserve.export.onnx import export_onnx

    torch.manual_seed(0)
    model = capserve.create_model(name).eval()
    return str(export_onnx(model, f"{folder}/model.onnx", iterations))


def onnx_peak_rss_mb(path: str, batch: int, threads: int, budget, arena: bool) -> dict:
    """Base and peak RSS high-water marks (MB) of a fresh process running capserve's ONNX Runtime wrapper twice."""
    command = [sys.executable, __file__, "--onnx-child", path, str(batch), str(threads), str(budget), str(arena)]
    result = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def _onnx_runtime(path: str, threads: int, budget: str, arena: bool):
    from capserve.runtime.onnx_backend import MEMORY_BUDGET_MB, OnnxRuntime

    mb = {"None": None, "default": MEMORY_BUDGET_MB}.get(budget, budget)
    return OnnxRuntime(path, threads=threads, memory_arena=arena, memory_budget_mb=None if mb is None else float(mb))


def _onnx_child(path: str, batch: int, threads: int, budget: str, arena: bool) -> None:
    import numpy as np

    import capserve.runtime.onnx_backend  # noqa: F401  (torch and onnxruntime loaded before "base")

    base = _high_water_mb()
    runtime = _onnx_runtime(path, threads, budget, arena)
    x = np.random.default_rng(0).standard_normal((batch, *runtime.metadata.input_shape), dtype=np.float32)
    for _ in range(2):
        runtime.predict(x)
    print(json.dumps({"base": base, "peak": _high_water_mb(), "chunk": runtime.chunk_size}))


def _onnx_timing_child(path: str, batch: int, threads: int, repeats: int) -> None:
    """Median ms per batch of every variant, interleaved round by round in this one process."""
    import numpy as np

    runtimes = {label: _onnx_runtime(path, threads, str(budget), arena) for label, budget, arena in ONNX_VARIANTS}
    x = np.random.default_rng(0).standard_normal((batch, *runtimes["chunks"].metadata.input_shape), dtype=np.float32)
    times: dict = {label: [] for label in runtimes}
    for runtime in runtimes.values():
        runtime.predict(x)  # warm-up
    for _ in range(repeats):
        for label, runtime in runtimes.items():
            start = time.perf_counter()
            runtime.predict(x)
            times[label].append(time.perf_counter() - start)
    print(json.dumps({label: statistics.median(t) * 1e3 for label, t in times.items()}))


def print_peak_rows(
    name: str, eager: list[tuple[int, int]], onnx: list[tuple[int, int]], threads: int, repeats: int
) -> None:
    """Peak-memory rows alone (each a fresh subprocess), eager PyTorch and ONNX Runtime (capserve's wrapper: whole
    batches with and without its memory arena, and chunks from its default memory budget), with ONNX Runtime's
    median ms per batch, the variants interleaved in one process."""
    import tempfile

    print(
        f"{'model':<18}{'runtime':<34}{'B':>5}{'T':>3}{'base MB':>9}{'peak MB':>9}{'peak - base':>13}{'ms/batch':>10}"
    )
    for batch, T in eager:
        base, peak = peak_rss_mb(name, batch, T, threads)
        print(f"{name:<18}{'torch eager':<34}{batch:>5}{T:>3}{base:>9.0f}{peak:>9.0f}{peak - base:>13.0f}")
    for batch, T in onnx:
        with tempfile.TemporaryDirectory() as folder:
            path = export_for_peak(name, T, folder)
            command = [sys.executable, __file__, "--onnx-timing", path, str(batch), str(threads), str(repeats)]
            result = subprocess.run(command, capture_output=True, text=True, check=True)
            ms = json.loads(result.stdout.strip().splitlines()[-1])
            for label, budget, arena in ONNX_VARIANTS:
                data = onnx_peak_rss_mb(path, batch, threads, budget, arena)
                if data["chunk"] is not None and data["chunk"] < batch:
                    label = f"{label} of {data['chunk']}"
                base, peak = data["base"], data["peak"]
                runtime = f"onnxruntime, {label}"
                print(
                    f"{name:<18}{runtime:<34}{batch:>5}{T:>3}{base:>9.0f}{peak:>9.0f}{peak - base:>13.0f}"
                    f"{ms[label.split(' of ')[0]]:>10.0f}"
                )


def fused_kernel_state() -> str:
    """Whether the big routing steps ran fused in this process (timed above after their warm-up call compiled)."""
    if os.environ.get("CAPSERVE_FUSED_ROUTING", "1") == "0":
        return "off (CAPSERVE_FUSED_ROUTING=0)"
    kernels = compiled_kernels()
    if kernels is None:
        return "off (torch.compile failed here; see the warning above)"
    if not kernels:
        return "not used (no step big enough, see FUSED_MIN_VOTES)"
    return f"on, compiled for {kernels} block shape(s)"


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", action="append", help="model name (repeatable); default cifar10-resnet")
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 1])
    parser.add_argument("--iterations", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=0, help="timed rounds (default: 7 for batch ≥ 8, else 30)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS subprocesses")
    parser.add_argument(
        "--peak",
        nargs=2,
        type=int,
        action="append",
        default=[],
        metavar=("B", "T"),
        help="also measure eager peak memory at batch B and T iterations, untimed (repeatable)",
    )
    parser.add_argument(
        "--onnx-peak",
        nargs=2,
        type=int,
        action="append",
        default=[],
        metavar=("B", "T"),
        help="also measure ONNX Runtime's peak memory at batch B for an export at T (repeatable)",
    )
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    parser.add_argument("--onnx-child", nargs=5, help=argparse.SUPPRESS)
    parser.add_argument("--onnx-timing", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, batch, iterations, threads = args.child
        _child(name, int(batch), None if iterations == "None" else int(iterations), int(threads))
        return
    if args.onnx_child:
        path, batch, threads, budget, arena = args.onnx_child
        _onnx_child(path, int(batch), int(threads), budget, arena == "True")
        return
    if args.onnx_timing:
        path, batch, threads, repeats = args.onnx_timing
        _onnx_timing_child(path, int(batch), int(threads), int(repeats))
        return

    import capserve

    torch.set_num_threads(args.threads)
    models = args.model or ["cifar10-resnet"]
    for name in models:
        if name not in capserve.list_models():
            parser.error(f"unknown model {name!r}; choose from {', '.join(capserve.list_models())}")
        if not capserve.get_config(name).has_routing:
            parser.error(f"{name} is a CNN without capsules to time apart: use benchmarks/bench_routing.py")
    gflops_machine = matmul_gflops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, capserve from {capserve.__file__}")
    print(f"machine: 2048x2048 fp32 matmul {gflops_machine:.0f} GFLOP/s")
    header = (
        f"{'model':<18}{'B':>4}{'T':>3}{'backbone ms':>13}{'capsules ms':>13}{'whole ms':>10}"
        f"{'whole/bb':>10}{'(min)':>7}{'img/s':>9}{'caps GFLOP':>12}{'caps GFLOP/s':>14}{'base MB':>9}{'peak MB':>9}"
    )
    for name in models:
        print(header)
        ratios = {}
        for batch in args.batch:
            repeats = args.repeats or (7 if batch >= 8 else 30)
            t = time_configurations(name, batch, args.iterations, repeats)
            model = capserve.create_model(name)
            for T in args.iterations:
                base, peak = (float("nan"),) * 2 if args.no_memory else peak_rss_mb(name, batch, T, args.threads)
                gflop = capsule_flops(model, batch, T) / 1e9
                (whole, whole_min), (backbone, backbone_min) = t["whole", T], t["backbone", 0]
                caps = t["capsules", T][0]
                ratios[batch, T] = whole / backbone
                print(
                    f"{name:<18}{batch:>4}{T:>3}{backbone * 1e3:>13.1f}{caps * 1e3:>13.1f}{whole * 1e3:>10.1f}"
                    f"{whole / backbone:>10.2f}{whole_min / backbone_min:>7.2f}{batch / whole:>9.1f}"
                    f"{gflop:>12.2f}{gflop / caps:>14.1f}{base:>9.0f}{peak:>9.0f}"
                )
        print(f"(GFLOP/s of the capsule part beside the machine's matmul: {gflops_machine:.0f} GFLOP/s)")
        print(f"fused attention kernel (capserve.routing.fused.fused_block): {fused_kernel_state()}")
        for (batch, T), ratio in ratios.items():
            if T == 3 and batch >= 8:
                goal = "target: at most 1.5, stretch 1.2"
                print(f"{name}: whole / backbone at batch {batch}, T = 3: {ratio:.2f} ({goal})")
        if args.peak or args.onnx_peak:
            peaks, onnx_peaks = [tuple(p) for p in args.peak], [tuple(p) for p in args.onnx_peak]
            print_peak_rows(name, peaks, onnx_peaks, args.threads, args.repeats or 5)


if __name__ == "__main__":
    main()
