"""``capserve predict`` against the runtime's own batch throughput, and its peak memory as the folder grows.

    python benchmarks/bench_predict.py --data data/   # 10,000 CIFAR-10 test PNGs
    python benchmarks/bench_predict.py --data data/ --images 2000 --model models/multimnist

Writes the first ``--images`` CIFAR-10 test pictures as PNG files (into ``--work``, a temporary folder by default),
then, in one process per figure so that each peak resident size is its own:

- ``runtime``: the runtime ``capserve predict`` opens (``Predictor(MODEL).runtime.predict``) on already decoded and
  normalised batches of ``--batch-size``, the best it can do (no file reading or decoding);
- ``predict``: ``capserve predict MODEL FOLDER --out rows.csv`` end to end (listing, reading, decoding in threads,
  answering, writing), on the whole folder and on a tenth of it, with the peak resident size of each run.

It prints images/s, the ratio predict / runtime, and the two peaks (flat memory: the same peak for 10× the images).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from capserve.hardware import cpu_info

REPO = Path(__file__).resolve().parents[1]

RUNTIME = """
import sys, time, numpy as np
from capserve.data.preprocess import normalize_images
from capserve.predict import Predictor
runtime = Predictor(sys.argv[1]).runtime  # the very runtime capserve predict opens
n, b = int(sys.argv[2]), int(sys.argv[3])
x = normalize_images(np.random.default_rng(0).integers(0, 256, (b, *runtime.metadata.input_shape), dtype=np.uint8),
                     runtime.metadata)
runtime.predict(x)
t = time.perf_counter()
for _ in range(max(1, n // b)):
    runtime.predict(x)
print(max(1, n // b) * b / (time.perf_counter() - t))
"""


def write_pngs(data: Path, folder: Path, n: int) -> None:
    from PIL import Image

    from capserve.data.builtin import load_cifar10

    if folder.is_dir() and len(list(folder.glob("*.png"))) == n:
        return
    folder.mkdir(parents=True, exist_ok=True)
    test = load_cifar10(data / "cifar10", train=False)
    for i in range(n):
        image = test.images[i % len(test)].permute(1, 2, 0).numpy()
        Image.fromarray(image).save(folder / f"{i:05d}.png")


# runs ``capserve.cli`` with the arguments after it, then reports its own peak resident size (KiB) on stderr
PEAK = (
    "import atexit, resource, runpy, sys; atexit.register(lambda: print('PEAK', resource.getrusage("
    "resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)); sys.argv = sys.argv[1:]; "
    "runpy.run_module('capserve.cli', run_name='__main__')"
)


def predict_run(args: list[str]) -> tuple[float, float, float]:
    """``capserve predict ARGS`` in a child process: wall seconds, the images/s of its own summary (from the first
    path read to the last row written: start-up excluded) and its peak resident size in MiB."""
    t = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", PEAK, "capserve", "predict", *args], capture_output=True, text=True, check=True, cwd=REPO
    )
    wall = time.perf_counter() - t
    peak = next(int(line.split()[1]) for line in done.stderr.splitlines() if line.startswith("PEAK "))
    summary = next(line for line in done.stderr.splitlines() if line.startswith("capserve predict: "))
    rate = float(summary.split(" images/s")[0].rsplit(" ", 1)[1])
    return wall, rate, peak / 1024


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data", help="the folder with the CIFAR-10 files (default: %(default)s)")
    p.add_argument("--model", default=str(REPO / "models" / "cifar10"))
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--work", help="where the PNGs go (default: a temporary folder)")
    a = p.parse_args()
    work = Path(a.work or tempfile.mkdtemp(prefix="bench_predict_"))
    small, large = work / "tenth", work / "all"
    write_pngs(Path(a.data), large, a.images)
    write_pngs(Path(a.data), small, max(1, a.images // 10))
    runtime_rate = float(
        subprocess.run(
            [sys.executable, "-c", RUNTIME, a.model, str(a.images), str(a.batch_size)],
            capture_output=True,
            text=True,
            check=True,
            cwd=REPO,
        ).stdout
    )
    results = {"model": a.model, "images": a.images, "batch_size": a.batch_size, "runtime_images_per_s": runtime_rate}
    for name, folder in (("tenth", small), ("all", large)):
        rows = work / f"rows-{name}.csv"
        rows.unlink(missing_ok=True)
        wall, rate, peak = predict_run([a.model, str(folder), "--out", str(rows), "--batch-size", str(a.batch_size)])
        n = len(list(folder.glob("*.png")))
        results[name] = {
            "images": n,
            "wall_s": round(wall, 1),
            "images_per_s": round(n / wall, 1),
            "streaming_images_per_s": rate,
            "peak_rss_mib": round(peak, 1),
        }
    results["predict_vs_runtime"] = round(results["all"]["images_per_s"] / runtime_rate, 3)
    results["streaming_vs_runtime"] = round(results["all"]["streaming_images_per_s"] / runtime_rate, 3)
    print(json.dumps(results, indent=1))
    print(
        f"runtime {runtime_rate:.1f} img/s; capserve predict {results['all']['images_per_s']} img/s on "
        f"{results['all']['images']} PNGs ({results['predict_vs_runtime']:.2f}× the runtime, start-up included; "
        f"{results['streaming_vs_runtime']:.2f}× from the first image on); "
        f"peak RSS {results['tenth']['peak_rss_mib']} MiB for {results['tenth']['images']} images, "
        f"{results['all']['peak_rss_mib']} MiB for {results['all']['images']}"
    )


if __name__ == "__main__":
    main()
