"""The routing maths against a literal, loop-by-loop reading of the paper."""

from __future__ import annotations

import math

import pytest
import torch

from capserve.routing import blocks
from capserve.routing.attention import routing_step, uniform_conv_step, uniform_step


def reference_step(children, weight, parents, pose):
    """One routing step written literally: per position, child and parent, no vectorisation."""
    B, P, N, D = children.shape
    J = weight.shape[1]
    out = torch.zeros(B, P, J, parents.shape[-1] if parents is not None else D, dtype=torch.float64)
    coef = torch.zeros(B, P, N, J, dtype=torch.float64)
    side = math.isqrt(D)
    for b in range(B):
        for p in range(P):
            v = {}
            for i in range(N):
                for j in range(J):
                    if pose == "matrix":
                        v[i, j] = (children[b, p, i].view(side, side) @ weight[i, j]).flatten()  # P_i · W_ij
                    else:
                        v[i, j] = weight[i, j].T @ children[b, p, i]  # W_ij p_i
            for i in range(N):
                a = torch.tensor(
                    [0.0 if parents is None else float(parents[b, p, j] @ v[i, j]) for j in range(J)],
                    dtype=torch.float64,
                )
                a = a / math.sqrt(v[i, 0].numel())
                coef[b, p, i] = torch.softmax(a, dim=0)
            for j in range(J):
                s = sum(coef[b, p, i, j] * v[i, j] for i in range(N))
                out[b, p, j] = torch.nn.functional.layer_norm(s, s.shape)
    return out, coef


def layer_norm(x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_routing_step_matches_the_literal_algorithm(pose):
    torch.manual_seed(0)
    B, P, N, J, D = 2, 3, 5, 4, 9
    x = y = 3 if pose == "matrix" else D
    children = torch.randn(B, P, N, D, dtype=torch.float64)
    weight = torch.randn(N, J, x, y, dtype=torch.float64)
    parents = torch.randn(B, P, J, D, dtype=torch.float64)

    expected, expected_coef = reference_step(children, weight, parents, pose)
    got, coef = routing_step(children, weight, parents, layer_norm, keep_coefficients=True)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(coef, expected_coef)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_uniform_step_is_the_first_iteration_from_zero_parents(pose):
    torch.manual_seed(1)
    B, P, N, J, D = 2, 3, 5, 4, 16
    x = y = 4 if pose == "matrix" else D
    children = torch.randn(B, P, N, D, dtype=torch.float64)
    weight = torch.randn(N, J, x, y, dtype=torch.float64)

    expected, coef = reference_step(children, weight, None, pose)
    assert torch.all(coef == 1 / J)  # parents start at zero → uniform routing
    torch.testing.assert_close(uniform_step(children, weight, layer_norm), expected)
    # the attention path from all-zero parents is the same computation
    from_zero, _ = routing_step(children, weight, torch.zeros(B, P, J, D, dtype=torch.float64), layer_norm)
    torch.testing.assert_close(from_zero, expected)


def test_coefficients_are_a_distribution_over_parents():
    torch.manual_seed(2)
    children, weight, parents = torch.randn(3, 2, 7, 16), torch.randn(7, 5, 4, 4), torch.randn(3, 2, 5, 16)
    _, coef = routing_step(children, weight, parents, layer_norm, keep_coefficients=True)
    assert coef.shape == (3, 2, 7, 5)
    assert torch.all(coef > 0)
    torch.testing.assert_close(coef.sum(-1), torch.ones(3, 2, 7))


def test_two_children_two_parents_by_hand():
    """Vector poses of size 2, identity weights: votes are the children themselves."""
    children = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # (B=1, P=1, N=2, D=2)
    weight = torch.eye(2).expand(2, 2, 2, 2).clone()  # W_ij = I
    parents = torch.tensor([[[[2.0, 0.0], [0.0, 0.0]]]])  # parent 0 points along child 0
    new, coef = routing_step(children, weight, parents, lambda s: s, keep_coefficients=True)  # raw sums

    # child 0: a = (<(2,0),(1,0)>, 0) / √2 = (√2, 0); child 1: a = (0, 0)
    r0 = math.exp(math.sqrt(2)) / (math.exp(math.sqrt(2)) + 1)
    torch.testing.assert_close(coef[0, 0], torch.tensor([[r0, 1 - r0], [0.5, 0.5]]))
    # parent 0 = r0·(1,0) + 0.5·(0,1); parent 1 = (1-r0)·(1,0) + 0.5·(0,1)
    torch.testing.assert_close(new[0, 0], torch.tensor([[r0, 0.5], [1 - r0, 0.5]]))
    # with LayerNorm (ε aside) a 2-vector (a, b) becomes (1, -1) when a > b and (-1, 1) when a < b
    normed, _ = routing_step(children, weight, parents, layer_norm)
    torch.testing.assert_close(normed[0, 0], torch.tensor([[1.0, -1.0], [-1.0, 1.0]]), atol=1e-3, rtol=0)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_vote_weight_maps_each_pose_row_to_every_vote(pose):
    """One product of a child's pose rows with its vote weight gives its J votes, laid out (r, Y, J)."""
    torch.manual_seed(3)
    N, J, D = 4, 5, 9
    x = y = 3 if pose == "matrix" else D
    children = torch.randn(N, D, dtype=torch.float64)
    weight = torch.randn(N, J, x, y, dtype=torch.float64)
    vote_weight = blocks.vote_weight(weight)  # (N, X, Y·J)
    assert vote_weight.shape == (N, x, y * J)
    for i, j in [(0, 0), (3, 4), (2, 1)]:
        u = children[i]
        expected = (u.view(x, x) @ weight[i, j]).flatten() if pose == "matrix" else weight[i, j].T @ u
        votes = (u.view(D // x, x) @ vote_weight[i]).view(D // x, y, J)  # (r, Y, J)
        torch.testing.assert_close(votes[..., j].flatten(), expected)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
@pytest.mark.parametrize(("kernel", "stride"), [(3, 1), (3, 2), (2, 2), (1, 1)])
def test_uniform_conv_step_equals_the_uniform_step_over_windows(pose, kernel, stride):
    torch.manual_seed(4)
    B, H, I, J, D = 2, 6, 3, 4, 16
    x = y = 4 if pose == "matrix" else D
    grid = torch.randn(B, H, H, I, D, dtype=torch.float64)
    weight = torch.randn(kernel * kernel * I, J, x, y, dtype=torch.float64)
    windows = grid.unfold(1, kernel, stride).unfold(2, kernel, stride)  # (B, h, w, I, D, k, k)
    side = windows.shape[1]
    children = windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(B, side * side, kernel * kernel * I, D)  # (kh, kw, I)
    expected = uniform_step(children, weight, layer_norm).view(B, side, side, J, D)
    torch.testing.assert_close(uniform_conv_step(grid, weight, kernel, stride, layer_norm), expected)
