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
