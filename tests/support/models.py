"""Tiny instances of every named configuration, and the device to test on."""

from __future__ import annotations

import dataclasses
import os

import torch

import capserve

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


def block_diagonal_weight(weight, rows):
    """(N, J, X, Y) → (N, r·X, J·r·Y): the r copies of each W_ij on a diagonal, so one product per child gives every
    vote with its D values adjacent (the layout of the first blocked step)."""
    N, J, X, Y = weight.shape
    w = weight.permute(0, 2, 1, 3)  # (N, X, J, Y)
    w = torch.diag_embed(w[..., None].expand(N, X, J, Y, rows), dim1=1, dim2=4)  # (N, r, X, J, r, Y)
    return w.reshape(N, rows * X, J * rows * Y)


def unblocked_step(children, weight, parents, normalize, keep_coefficients=False):
    """The routing step of the product before blocks: every vote of the batch in one tensor, read by ``bmm``."""
    B, P, N, D = children.shape
    J, Y = weight.shape[1], weight.shape[3]
    r = D // weight.shape[2]
    u = children.permute(2, 0, 1, 3).reshape(N, B * P, D)  # (N, BP, D)
    v = torch.bmm(u, block_diagonal_weight(weight, r)).view(N, B, P, J, r * Y)  # (N, B, P, J, D_out)
    D = v.shape[-1]
    v = v.view(N, B * P * J, D).transpose(0, 1)  # (BPJ, N, D)
    q = parents.reshape(B * P * J, D, 1) * D**-0.5
    coefficients = torch.softmax(torch.bmm(v, q).view(B, P, J, N), dim=2)  # (B, P, J, N)
    s = torch.bmm(coefficients.view(B * P * J, 1, N), v)  # (BPJ, 1, D)
    return normalize(s.view(B, P, J, D)), coefficients.transpose(2, 3) if keep_coefficients else None


def layer_norm(x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:])
