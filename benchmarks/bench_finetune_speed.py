"""Where the time of a fine-tune goes: training images/s of the ``--init`` model's architecture at its own input size
and at 64×64, with the whole network training and with ``--freeze backbone`` (no backward pass through it).

    python benchmarks/bench_finetune_speed.py --init models/cifar10 --sizes 32,64 --repeats 3

Each variant runs ``--steps`` SGD steps at batch ``--batch-size`` on random images (after one warm-up step); the
variants are interleaved ``--repeats`` times in one process and the median images/s of each is printed, with the
backbone's share of a forward pass. Timings on a shared machine are noisy: quote the medians and ratios of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from capserve.hardware import cpu_info
from capserve.model.factory import build_model
from capserve.model.factory import load as load_model


def step_rate(model: torch.nn.Module, size: int, batch: int, steps: int, freeze: bool) -> float:
    """Images/s of ``steps`` training steps (cross-entropy, SGD) at ``size``×``size``."""
    model.train()
    model.backbone.requires_grad_(not freeze)
    if freeze:
        model.backbone.eval()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3, momentum=0.9)
    x = torch.randn(batch, model.config.in_channels, size, size)
    y = torch.randint(0, model.config.num_classes, (batch,))
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return batch * len(times) / sum(times)


@torch.no_grad()
def backbone_share(model: torch.nn.Module, size: int, batch: int) -> float:
    """The backbone's share of an inference forward pass."""
    model.eval()
    x = torch.randn(batch, model.config.in_channels, size, size)
    model(x)
    t0 = time.perf_counter()
    model.backbone(x)
    t1 = time.perf_counter()
    model(x)
    return (t1 - t0) / (time.perf_counter() - t1)


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--init", default="models/cifar10", help="the model folder a fine-tune starts from")
    p.add_argument("--sizes", default="32,64", help="comma-separated input sides")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    source = load_model(a.init)
    sizes = [int(s) for s in a.sizes.split(",")]
    models = {}
    for size in sizes:
        m = build_model(dataclasses.replace(source.config, image_size=size))
        own = m.state_dict()  # at another size the class layer (fc over positions) has another shape: fresh
        m.load_state_dict({k: v for k, v in source.state_dict().items() if own[k].shape == v.shape}, strict=False)
        models[size] = m
    variants = [(size, freeze) for size in sizes for freeze in (False, True)]
    rates: dict[tuple[int, bool], list[float]] = {v: [] for v in variants}
    for _ in range(a.repeats):
        for size, freeze in variants:
            rates[(size, freeze)].append(step_rate(models[size], size, a.batch_size, a.steps, freeze))
    print(
        f"{source.config.name} from {a.init}, batch {a.batch_size}, {torch.get_num_threads()} threads, "
        f"median of {a.repeats} interleaved runs of {a.steps} steps"
    )
    base = statistics.median(rates[variants[0]])
    for size, freeze in variants:
        r = statistics.median(rates[(size, freeze)])
        share = backbone_share(models[size], size, a.batch_size)
        what = "--freeze backbone" if freeze else "all layers"
        print(
            f"  {size}x{size} {what:17}: {r:7.1f} images/s ({r / base:.2f}x of the first), backbone "
            f"{100 * share:.0f} % of a forward"
        )


if __name__ == "__main__":
    main()
