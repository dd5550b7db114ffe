"""What the capsule layers add to their backbone: a capsule run's test score beside that of the backbone classifier
trained with it (``--backbone-loss``), on the same test images.

    python benchmarks/bench_backbone_head.py RUN DATA

RUN is a ``capserve train`` folder on a user's single-label images; its ``last/`` holds the model and, in
``optimizer.safetensors``, the backbone classifier (a linear layer on the backbone's map average-pooled to the run's
``backbone_loss_grid``). DATA is the folder or CSV it trained on; its test split is decoded as training decoded it.
Prints the CPU and both top-1 figures.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.nn import functional as F

import capserve
from capserve.data.cache import build_cache
from capserve.data.own import InputSize, scan
from capserve.hardware import cpu_info


def main() -> None:
    print(f"CPU: {cpu_info().describe()}", flush=True)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path)
    p.add_argument("data", type=Path)
    args = p.parse_args()
    model = capserve.load(args.run / "last").eval()
    c = model.config
    grid = json.loads((args.run / "train_config.json").read_text())["backbone_loss_grid"]
    head = load_file(args.run / "last" / "optimizer.safetensors")
    weight, bias = head["backbone_head.linear.weight"], head["backbone_head.linear.bias"]
    test = build_cache(scan(args.data), list(c.labels), InputSize(c.in_channels, c.image_size), None).splits["test"]
    mean, std = (torch.tensor(getattr(c, k)).view(1, -1, 1, 1) for k in ("mean", "std"))
    features: list[torch.Tensor] = []
    model.backbone.register_forward_hook(lambda module, inputs, output: features.append(output))
    with torch.no_grad():
        capsules = torch.cat([model((x.float() / 255 - mean) / std) for x in test.images.split(200)])
        backbone = torch.cat([F.adaptive_avg_pool2d(f, grid).flatten(1) for f in features]) @ weight.T + bias
    for name, logits in (("capsules", capsules), (f"backbone classifier ({grid}×{grid} pool)", backbone)):
        top1 = (logits.argmax(1) == test.targets).float().mean().item()
        print(f"{name}: {top1:.1%} top-1 on {len(test)} test images")


if __name__ == "__main__":
    main()
