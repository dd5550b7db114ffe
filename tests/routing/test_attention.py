"""The routing maths: the package's readable reference (``votes``, ``agreement``, ``reference_step``,
``reference_uniform_step``) against the paper's definitions and numbers worked by hand, and each fast path (the
blocked ``routing_step``, ``uniform_step``, ``uniform_conv_step``) against that reference. The fused kernel and the
blocks of rows: test_fused.py, test_blocks.py."""

from __future__ import annotations

import math

import pytest
import torch
from support.models import layer_norm

from capserve.routing import blocks
from capserve.routing.attention import (
    agreement,
    reference_step,
    reference_uniform_step,
    routing_step,
    uniform_conv_step,
    uniform_step,
    votes,
)


def random_step(pose, B=2, P=3, N=5, J=4, D=9, seed=0):
    """Children (B, P, N, D), weights (N, J, X, Y) and parents (B, P, J, D) in float64; D = 9: 3×3 matrices."""
    x = y = math.isqrt(D) if pose == "matrix" else D
    g = torch.Generator().manual_seed(seed)
    shapes = ((B, P, N, D), (N, J, x, y), (B, P, J, D))
    return [torch.randn(*s, dtype=torch.float64, generator=g) for s in shapes]


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_votes_are_each_childs_pose_through_its_transform(pose):
    """v_ij = P_i · W_ij for √D×√D matrix poses, W_ij p_i (row vector times W) for vector poses."""
    children, weight, _ = random_step(pose)
    v = votes(children, weight)
    assert v.shape == (2, 3, 5, 4, 9)
    for b, p, i, j in [(0, 0, 0, 0), (1, 2, 4, 3), (0, 1, 2, 1)]:
        u = children[b, p, i]
        expected = (u.view(3, 3) @ weight[i, j]).flatten() if pose == "matrix" else weight[i, j].T @ u
        torch.testing.assert_close(v[b, p, i, j], expected)


def test_agreement_is_the_scaled_dot_product_with_each_parent():
    _, _, parents = random_step("vector")
    v = torch.randn(2, 3, 5, 4, 9, dtype=torch.float64)
    a = agreement(v, parents)
    assert a.shape == (2, 3, 5, 4)
    torch.testing.assert_close(a[1, 2, 3, 0], (v[1, 2, 3, 0] @ parents[1, 2, 0]) / 3)  # √D = 3


@pytest.mark.parametrize("step", [reference_step, routing_step], ids=["reference", "routing_step"])
def test_two_children_two_parents_by_hand(step):
    """Vector poses of size 2, identity weights: votes are the children themselves."""
    children = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (B=1, P=1, N=2, D=2)
    weight = torch.eye(2).expand(2, 2, 2, 2).clone()  # W_ij = I
    parents = torch.tensor([[[[2.0, 0.0], [0.0, 0.0]]]])  # parent 0 points along child 0
    new, coef = step(children, weight, parents, lambda s: s, keep_coefficients=True)  # raw sums

    # child 0: a = (<(2,0),(1,0)>, 0) / √2 = (√2, 0); child 1: a = (0, 0)
    r0 = math.exp(math.sqrt(2)) / (math.exp(math.sqrt(2)) + 1)
    torch.testing.assert_close(coef[0, 0], torch.tensor([[r0, 1 - r0], [0.5, 0.5]]))
    # parent 0 = r0·(1,0) + 0.5·(0,1); parent 1 = (1-r0)·(1,0) + 0.5·(0,1)
    torch.testing.assert_close(new[0, 0], torch.tensor([[r0, 0.5], [1 - r0, 0.5]]))
    # with LayerNorm (ε aside) a 2-vector (a, b) becomes (1, -1) when a > b and (-1, 1) when a < b
    normed, no_coef = step(children, weight, parents, layer_norm)
    torch.testing.assert_close(normed[0, 0], torch.tensor([[1.0, -1.0], [-1.0, 1.0]]), atol=1e-3, rtol=0)
    assert no_coef is None


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_routing_step_gives_the_reference_step(pose):
    children, weight, parents = random_step(pose)
    expected, expected_coef = reference_step(children, weight, parents, layer_norm, keep_coefficients=True)
    got, coef = routing_step(children, weight, parents, layer_norm, keep_coefficients=True)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(coef, expected_coef, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_uniform_steps_are_the_first_iteration_from_zero_parents(pose):
    children, weight, parents = random_step(pose, D=16, seed=1)
    J = weight.shape[1]
    expected = reference_uniform_step(children, weight, layer_norm)
    from_zero, coef = reference_step(children, weight, torch.zeros_like(parents), layer_norm, keep_coefficients=True)
    assert torch.all(coef == 1 / J)  # parents start at zero → uniform routing
    torch.testing.assert_close(from_zero, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(uniform_step(children, weight, layer_norm), expected, rtol=0, atol=1e-12)
    # the blocked attention path from all-zero parents is the same computation
    blocked, _ = routing_step(children, weight, torch.zeros_like(parents), layer_norm)
    torch.testing.assert_close(blocked, expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
@pytest.mark.parametrize(("kernel", "stride"), [(3, 1), (3, 2), (2, 2), (1, 1)])
def test_uniform_conv_step_gives_the_reference_over_windows(pose, kernel, stride):
    torch.manual_seed(4)
    B, H, I, J, D = 2, 6, 3, 4, 16
    x = y = 4 if pose == "matrix" else D
    grid = torch.randn(B, H, H, I, D, dtype=torch.float64)
    weight = torch.randn(kernel * kernel * I, J, x, y, dtype=torch.float64)
    windows = grid.unfold(1, kernel, stride).unfold(2, kernel, stride)  # (B, h, w, I, D, k, k)
    side = windows.shape[1]
    children = windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(B, side * side, kernel * kernel * I, D)  # (kh, kw, I)
    expected = reference_uniform_step(children, weight, layer_norm).view(B, side, side, J, D)
    got = uniform_conv_step(grid, weight, kernel, stride, layer_norm)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_coefficients_are_a_distribution_over_parents():
    torch.manual_seed(2)
    children, weight, parents = torch.randn(3, 2, 7, 16), torch.randn(7, 5, 4, 4), torch.randn(3, 2, 5, 16)
    _, coef = routing_step(children, weight, parents, layer_norm, keep_coefficients=True)
    assert coef.shape == (3, 2, 7, 5)
    assert torch.all(coef > 0)
    torch.testing.assert_close(coef.sum(-1), torch.ones(3, 2, 7))


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_vote_weight_maps_each_pose_row_to_every_vote(pose):
    """One product of a child's pose rows with its vote weight gives its J votes, laid out (r, Y, J)."""
    children, weight, _ = random_step(pose, seed=3)
    children = children[0, 0]  # (N, D)
    N, J, x, y = weight.shape
    vote_weight = blocks.vote_weight(weight)  # (N, X, Y·J)
    assert vote_weight.shape == (N, x, y * J)
    expected = votes(children, weight)  # (N, J, D)
    for i, j in [(0, 0), (3, 3), (2, 1)]:
        v = (children[i].view(-1, x) @ vote_weight[i]).view(-1, y, J)  # (r, Y, J)
        torch.testing.assert_close(v[..., j].flatten(), expected[i, j])
