"""Capsule layers: conv windows are the true k×k windows over all child types."""

from __future__ import annotations

import pytest
import torch

from capserve.configs import CapsuleLayerConfig
from capserve.routing.attention import CapsuleLayer, PrimaryCapsules


@pytest.mark.parametrize(("kernel", "stride"), [(3, 1), (3, 2), (2, 2)])
def test_conv_children_are_the_windows(kernel, stride):
    torch.manual_seed(0)
    B, H, I, D = 2, 7, 3, 4
    layer = CapsuleLayer(CapsuleLayerConfig("conv", 5, kernel, stride), I, H, "matrix", D)
    u = torch.randn(B, H, H, I, D)
    children = layer.group_children(u)
    side = (H - kernel) // stride + 1
    assert children.shape == (B, side * side, kernel * kernel * I, D)
    for h in range(side):
        for w in range(side):
            window = [
                u[:, h * stride + dy, w * stride + dx, i]
                for dy in range(kernel)
                for dx in range(kernel)
                for i in range(I)
            ]
            torch.testing.assert_close(children[:, h * side + w], torch.stack(window, dim=1))


def test_conv_layer_output_grid_and_fc_flattening():
    torch.manual_seed(0)
    conv = CapsuleLayer(CapsuleLayerConfig("conv", 5, 3, 2), 3, 7, "vector", 6)
    parents, coef = conv(torch.randn(2, 7, 7, 3, 6))
    assert parents.shape == (2, 3, 3, 5, 6) and coef is None
    fc = CapsuleLayer(CapsuleLayerConfig("fc", 4), 5, 3, "vector", 6)
    out, _ = fc(parents)
    assert out.shape == (2, 4, 6)
    out2, coef = fc(parents, out, keep_coefficients=True)
    assert out2.shape == (2, 4, 6) and coef.shape == (2, 1, 45, 4)
    assert fc(parents, out)[1] is None  # coefficients (as many values as the votes ÷ D) only when asked for


def test_weights_are_shared_across_positions():
    """Moving a pattern by one window step moves the conv layer's output by one position."""
    torch.manual_seed(0)
    layer = CapsuleLayer(CapsuleLayerConfig("conv", 2, 3, 1), 2, 8, "matrix", 4)
    u = torch.randn(1, 8, 8, 2, 4)
    shifted = torch.roll(u, shifts=1, dims=2)
    a, _ = layer(u)
    b, _ = layer(shifted)
    torch.testing.assert_close(a[:, :, :-1], b[:, :, 1:])


@pytest.mark.parametrize("activations", [False, True])
@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_conv_uniform_pass_equals_attention_from_zero_parents(pose, activations):
    """The conv layer's first iteration (a conv2d on the grid) is the window-gathered routing from zero parents."""
    torch.manual_seed(0)
    layer = CapsuleLayer(CapsuleLayerConfig("conv", 5, 3, 2), 3, 7, pose, 16, activations=activations).double()
    u = torch.randn(2, 7, 7, 3, 16, dtype=torch.float64)
    uniform, _ = layer(u)
    from_zero, coef = layer(u, torch.zeros_like(uniform), keep_coefficients=True)
    torch.testing.assert_close(uniform, from_zero)
    torch.testing.assert_close(coef, torch.full_like(coef, 1 / 5))


@pytest.mark.parametrize("kernel", [1, 3])
def test_primary_capsules_are_the_conv_channels_as_poses(kernel):
    torch.manual_seed(0)
    primary = PrimaryCapsules(6, 4, 9, kernel, stride=1, padding=kernel // 2, layer_norm=False)
    features = torch.randn(2, 6, 5, 5)
    out = primary(features)
    channels = primary.conv(features)  # (B, I·D, H, W)
    assert out.shape == (2, 5, 5, 4, 9)
    torch.testing.assert_close(out[1, 2, 3, 1], channels[1, 9:18, 2, 3])


@pytest.mark.parametrize("cells", [1, 2])
def test_transforms_shared_within_cells_sum_their_gradient_in_a_fixed_order(cells):
    """The gradient of a transform shared by the positions of a cell sums them without an atomic scatter
    (``index_put`` with accumulate), whose parallel CPU kernel adds in the order busy threads reach it, so that two
    seeded runs part by rounding. It is the positions' own sum, as a loop would make it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Scatters(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "index_put" in str(func) and ((len(args) > 3 and args[3]) or (kwargs or {}).get("accumulate")):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    layer = CapsuleLayer(CapsuleLayerConfig("fc", 3), 4, 5, "matrix", 16, cells=cells)
    upstream = torch.randn(25 * 4, 3, 4, 4)  # (P·I, J, X, Y)
    with Scatters() as scatters:
        (layer.votes_weight() * upstream).sum().backward()
    assert scatters.seen == []
    per_cell = upstream.unflatten(0, (25, 4))  # (P, I, J, X, Y)
    expected = torch.zeros(cells * cells, 4, 3, 4, 4).index_add_(0, layer.cell_of, per_cell).flatten(0, 1)
    torch.testing.assert_close(layer.weight.grad, expected)
