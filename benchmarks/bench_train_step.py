"""A training step on this CPU: what deterministic kernels cost it, and what ``--amp auto`` measures and chooses.

    python benchmarks/bench_train_step.py [--rounds 7] [--steps 5] [--batch-size 32]

Builds the model and recipe a user's own images get (``capserve train --data FOLDER`` on a folder of random 32×32
pictures of three labels, made in a temporary folder). Then:

1. times training steps (forward, loss, backward, optimizer) on one batch with ``torch.use_deterministic_algorithms``
   on and off (``capserve.train.amp.deterministic_kernels``), in interleaved rounds (on, off, on, off, ...) so that
   the load of a shared machine falls on both alike;
2. runs ``--amp auto``'s own measurement (``capserve.train.amp.step_seconds``: fp32, bf16, bf16 + channels-last),
   whether or not this CPU has native bf16, with the seconds it took, and says what ``--amp auto`` chooses here.

Prints the CPU, the threads, and each figure.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from capserve.hardware import cpu_info
from capserve.train.amp import CANDIDATES, bf16_support, choose, step_seconds
from capserve.train.config import TrainConfig
from capserve.train.distributed import Dist
from capserve.train.loop import augment, set_up, train_step


def random_folder(root: Path, labels: int = 3, per_label: int = 64) -> Path:
    rng = np.random.default_rng(0)
    for label in range(labels):
        (root / f"label{label}").mkdir(parents=True)
        for i in range(per_label):
            Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(root / f"label{label}" / f"{i}.png")
    return root


def main() -> None:
    print(f"CPU: {cpu_info().describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=5, help="training steps per setting in each round")
    p.add_argument("--batch-size", type=int, default=32)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = random_folder(Path(tmp) / "images")
        cfg = TrainConfig(model="cifar10-conv", data=str(data), out=str(Path(tmp) / "run"), epochs=1, device="cpu")
        cfg.batch_size = args.batch_size
        cfg.amp = "off"  # the deterministic comparison in fp32, on any CPU
        run = set_up(cfg, None, Dist(), torch.device("cpu"))
        epoch = run.data.epoch(0, run.cfg.seed, run.device)
        x, y = augment(run, epoch.images[: args.batch_size], 0, 0), epoch.targets[: args.batch_size]
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for deterministic in (True, False):
                torch.use_deterministic_algorithms(deterministic)
                train_step(run, x, y, 0.5)  # warm
                started = time.perf_counter()
                for _ in range(args.steps):
                    train_step(run, x, y, 0.5)
                times[deterministic].append((time.perf_counter() - started) / args.steps * 1000)
        torch.use_deterministic_algorithms(False)
        on, off = statistics.median(times[True]), statistics.median(times[False])
        print(f"batch {args.batch_size}, {args.rounds} rounds of {args.steps} steps each")
        print(f"deterministic kernels: {on:.1f} ms/step; default kernels: {off:.1f} ms/step; ratio {on / off:.3f}")
        native, why = bf16_support(torch.device("cpu"))
        started = time.perf_counter()
        seconds = step_seconds(run.model.config, args.batch_size, torch.device("cpu"), list(CANDIDATES))
        took = time.perf_counter() - started
        figures = ", ".join(f"{c.label()} {1000 * s:.1f} ms" for c, s in seconds.items())
        print(f"--amp auto's measurement ({took:.1f} s): {figures}")
        chosen = choose(seconds).label() if native else "fp32, nothing measured"
        print(f"bf16 here: {why}; --amp auto chooses {chosen}")


if __name__ == "__main__":
    main()
