"""Inverted dot-product attention routing (Tsai et al., ICLR 2020), the maths alone.

One routing step between N children and J parents, at each of P positions (P = 1 for a fully connected
capsule layer; for a conv capsule layer the children of a position are its k×k window over all child types):

    votes       v_ij = u_i · W_ij            matrix poses (√D×√D product), or W_ij u_i for vector poses
    agreement   a_ij = <p_j, v_ij> / √D      p_j: the parents' poses from the previous iteration
    routing     r_ij = softmax_j(a_ij)       over parents: each child splits itself among the parents
    update      p_j  = LayerNorm(Σ_i r_ij v_ij)

Parents start at zero, so the first step has a_ij = 0 and routes uniformly, r_ij = 1/J. That step needs no
votes at all: Σ_i v_ij / J is one matrix product of the children with the stacked weights, which is how
``uniform_step`` computes it. ``routing_step`` builds the (N, B, P, r, J, Y) vote tensor once and reads it
twice, with the contractions as batched matrix products.

Weights have shape (N, J, X, Y): a child pose of D values is viewed as r rows of X values (matrix: r = X = √D;
vector: r = 1, X = D_in) and each row is mapped to Y values, so a parent pose has D_out = r·Y values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

Normalize = Callable[[Tensor], Tensor]


def _rows(children: Tensor, weight: Tensor) -> int:
    rows, rem = divmod(children.shape[-1], weight.shape[2])
    assert rem == 0, f"pose size {children.shape[-1]} is not a multiple of the weight's input size {weight.shape[2]}"
    return rows


def uniform_step(children: Tensor, weight: Tensor, normalize: Normalize) -> Tensor:
    """First routing iteration (all r_ij = 1/J): p_j = normalize(Σ_i v_ij / J).

    Args:
        children: (B, P, N, D) child poses.
        weight: (N, J, X, Y) transforms.
    Returns:
        (B, P, J, D_out) parent poses.
    """
    B, P, N, _ = children.shape
    _, J, X, Y = weight.shape
    r = _rows(children, weight)
    # Σ_i u_i W_ij is one (B·P·r, N·X) @ (N·X, J·Y) product: no (children × parents) tensor is ever built.
    u = children.reshape(B, P, N, r, X).transpose(2, 3).reshape(B * P * r, N * X)  # (BPr, NX)
    w = weight.permute(0, 2, 1, 3).reshape(N * X, J * Y)  # (NX, JY)
    s = (u @ w).div_(J)  # (BPr, JY)
    s = s.view(B, P, r, J, Y).transpose(2, 3).reshape(B, P, J, r * Y)  # (B, P, J, D_out)
    return normalize(s)


def votes(children: Tensor, weight: Tensor) -> Tensor:
    """All votes v_ij, as one matrix product per child (batched over N).

    Args:
        children: (B, P, N, D) child poses.
        weight: (N, J, X, Y) transforms.
    Returns:
        (N, B, P, r, J, Y) votes; the pose of vote (i, j) is [..., :, j, :] flattened to r·Y = D_out.
    """
    B, P, N, _ = children.shape
    _, J, X, Y = weight.shape
    r = _rows(children, weight)
    u = children.permute(2, 0, 1, 3).reshape(N, B * P * r, X)  # (N, BPr, X)
    w = weight.permute(0, 2, 1, 3).reshape(N, X, J * Y)  # (N, X, JY)
    return torch.bmm(u, w).view(N, B, P, r, J, Y)  # (N, B, P, r, J, Y)


def routing_step(children: Tensor, weight: Tensor, parents: Tensor, normalize: Normalize) -> tuple[Tensor, Tensor]:
    """One inverted dot-product attention iteration given the parents' current poses.

    Args:
        children: (B, P, N, D) child poses.
        weight: (N, J, X, Y) transforms.
        parents: (B, P, J, D_out) parent poses from the previous iteration.
    Returns:
        parents: (B, P, J, D_out) updated parent poses.
        coefficients: (B, P, N, J) routing probabilities r_ij, summing to 1 over J.
    """
    B, P = children.shape[:2]
    J, Y = weight.shape[1], weight.shape[3]
    v = votes(children, weight)  # (N, B, P, r, J, Y)
    r = v.shape[3]
    p = parents.reshape(B, P, J, r, Y).transpose(2, 3)  # (B, P, r, J, Y)
    scale = (r * Y) ** -0.5
    # a_ij = <p_j, v_ij> / √D: a product summed over the pose's rows and columns
    logits = (v * p).sum(dim=(3, 5)).mul_(scale)  # (N, B, P, J)
    coefficients = torch.softmax(logits, dim=-1)  # (N, B, P, J)
    # Σ_i r_ij v_ij: weight each vote, sum over children (the leading dim, contiguous slabs)
    s = (v * coefficients[:, :, :, None, :, None]).sum(dim=0)  # (B, P, r, J, Y)
    s = s.transpose(2, 3).reshape(B, P, J, r * Y)  # (B, P, J, D_out)
    return normalize(s), coefficients.permute(1, 2, 0, 3)  # (B, P, J, D_out), (B, P, N, J)
