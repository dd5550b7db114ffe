"""Tiny instances of every named configuration, a short training run of one, and the device to test on."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

import capserve
from capserve.train.config import TrainConfig

DEVICE = torch.device(os.environ.get("CAPSERVE_TEST_DEVICE", "cpu"))


def tiny_overrides(name: str) -> dict:
    """Overrides that shrink a named config to a few thousand parameters, keeping its structure."""
    config = capserve.get_config(name)
    layers = tuple(
        dataclasses.replace(layer, types=min(layer.types, 4 if layer.kind == "conv" else 5))
        for layer in config.capsules
    )
    return dict(
        backbone_channels=8,
        primary_types=4,
        pose_dim=16 if config.pose == "matrix" else 6,
        capsules=layers,
    )


def tiny_model(name: str, **overrides) -> capserve.Model:
    torch.manual_seed(0)
    return capserve.create_model(name, **{**tiny_overrides(name), **overrides}).to(DEVICE).eval()


def tiny_input(model: capserve.Model, batch: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = model.config
    return torch.randn(batch, c.in_channels, c.image_size, c.image_size, generator=g).to(DEVICE)


# the capsule networks (routing, traces); the baseline CNNs have tests of their own (model/test_baselines.py)
CAPSULE_MODELS = [name for name in capserve.list_models() if capserve.get_config(name).has_routing]


CNN_MODELS = [name for name in capserve.list_models() if not capserve.get_config(name).has_routing]


def layer_norm(x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def own_config(data: Path, out: Path, **kw) -> TrainConfig:
    """One epoch of a tiny cifar10-conv on the CPU, on own data ``data``, into ``out`` (``kw`` override)."""
    base = dict(model="cifar10-conv", overrides=tiny_overrides("cifar10-conv"), epochs=1, device="cpu", test=False)
    return TrainConfig(data=str(data), out=str(out), **{**base, **kw})
