"""DDP through torchrun: which process this is, and the process group (one process when not launched by torchrun)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

# ------------------------------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> tuple[Dist, torch.device]:
    """Join the torchrun process group if the environment says so; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if device == "auto":
        dev = torch.device(f"cuda:{d.local_rank}" if cuda else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{d.local_rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if d.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return d, dev
