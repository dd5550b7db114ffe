"""INT8 quantization variants of a shipped model, side by side: agreement with fp32 and accuracy on 1,000 validation
images, batch-32 throughput against fp32 (ONNX Runtime). Prints; asserts nothing.

    python benchmarks/int8_variants.py MODEL DATA VARIANT [VARIANT ...]

MODEL is a folder under models/ (its model.onnx is quantized), DATA the built-in dataset's folder. A VARIANT is
``METHOD[@PERCENTILE][:NODE,NODE...]``: the calibration method (minmax, percentile, entropy), the percentile for
``percentile`` (default 99.999), and Conv/MatMul nodes to leave in float, e.g. ``minmax:node_Conv_254``.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from pathlib import Path

import onnx

from capserve.configs import ModelConfig
from capserve.export.calibration import read_calibration
from capserve.export.gate import score
from capserve.export.quantize import Quantizer, runtime_for
from capserve.hardware import cpu_info

ROOT = Path(__file__).resolve().parents[1]


def speed(runtime, x, reps: int = 5) -> float:
    """Median img/s at batch 32, in a worker thread (torch/ORT collapse in an oversubscribed main thread)."""
    out = {}

    def work() -> None:
        runtime.predict(x[:32])
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runtime.predict(x[:32])
            times.append(time.perf_counter() - t0)
        out["ips"] = 32 / statistics.median(times)

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return out["ips"]


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    name, data, variants = sys.argv[1], sys.argv[2], sys.argv[3:]
    model = ROOT / "models" / name
    config = ModelConfig.from_dict(json.loads((model / "config.json").read_text())["config"])
    cal = read_calibration(data, config, 512, 1000)
    fp32_proto = onnx.load(str(model / "model.onnx"))
    fp32 = runtime_for(fp32_proto)
    for variant in variants:
        method, _, nodes = variant.partition(":")
        method, _, percentile = method.partition("@")
        t0 = time.perf_counter()
        with Quantizer(fp32_proto, cal.images, "onnxruntime", method, float(percentile or 99.999)) as q:
            int8 = runtime_for(q.build([n for n in nodes.split(",") if n]))
        took = time.perf_counter() - t0
        r = score(fp32, int8, cal.held_out, cal.targets, cal.split, 0.97)
        ratio = speed(int8, cal.held_out) / speed(fp32, cal.held_out)
        print(
            f"{name} {variant:<40} agreement {r.check.agreement:.4f} {r.metric} fp32 {r.fp32_accuracy:.2%} "
            f"int8 {r.int8_accuracy:.2%} b32 x{ratio:.2f} quantized in {took:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
