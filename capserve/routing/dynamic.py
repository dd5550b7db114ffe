"""Dynamic routing (Sabour, Frosst & Hinton, NeurIPS 2017), the paper's comparison system "dynamic": squash,
the routing by agreement, its capsule layers and the margin loss.

Vector poses whose length is the probability that the entity exists. Between N children u_i and J parents, per
position (conv capsule layers: the k×k window over all child types, weights shared across positions, as above):

    votes       û_{j|i} = W_ij u_i
    coupling    c_ij = softmax_j(b_ij)            b_ij = 0 at the start, so round 1 couples uniformly (1/J)
    parents     v_j = squash(Σ_i c_ij û_{j|i})
    agreement   b_ij ← b_ij + <û_{j|i}, v_j>      (not after the last round: it would never be read)

for T rounds, all of one layer's before the next layer starts (sequential). The votes do not change between
rounds, so ``dynamic_routing`` computes each block of (batch × position) rows' votes once and runs all T rounds
on the block while it is in cache, in blocks planned like ``routing_step``'s (``vote_blocks``). Memory is one block of
votes, plus, when training, every block's votes once (the attention step keeps one copy per iteration) and the
D-times-smaller couplings of each round.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capserve.configs import CapsuleLayerConfig
from capserve.routing.attention import CapsuleLayer, PrimaryCapsules, uniform_conv_step, uniform_step
from capserve.routing.blocks import pose_rows, reuses_buffers, vote_blocks


def squash(s: Tensor) -> Tensor:
    """Sabour et al.'s non-linearity (their eq. 1), over the last dim: v = |s|²/(1 + |s|²) · s/|s| = s·|s|/(1 + |s|²).

    The direction of ``s`` with a length in [0, 1): short vectors shrink to almost nothing (length ≈ |s|²), long
    ones reach just below 1. Written without 1/|s|, so it is exact for short vectors and 0 (with a zero gradient)
    at s = 0, with no epsilon. Any shape (…, D) → the same shape.
    """
    length = torch.linalg.vector_norm(s, dim=-1, keepdim=True)  # (…, 1)
    return s * (length / (1 + length * length))  # (…, D)


def dynamic_routing(
    children: Tensor, weight: Tensor, iterations: int, keep_coefficients: bool = False
) -> tuple[Tensor, Tensor | None]:
    """All ``iterations`` rounds of dynamic routing between children and parents, a block of rows at a time.

    Args:
        children: (B, P, N, D) child poses (squashed vectors).
        weight: (N, J, X, Y) transforms (vector poses: X = D, Y = D_out).
        iterations: T >= 1 rounds.
        keep_coefficients: also return the coupling coefficients of the last round.
    Returns:
        parents: (B, P, J, D_out) squashed parent poses v_j after round T.
        coefficients: (B, P, N, J) coupling coefficients c_ij of round T, summing to 1 over J (1/J at T = 1), or
            None.
    Example:
        >>> v, c = dynamic_routing(torch.randn(2, 1, 5, 8), torch.randn(5, 3, 8, 8), 3, keep_coefficients=True)
        >>> v.shape, c.shape
        (torch.Size([2, 1, 3, 8]), torch.Size([2, 1, 5, 3]))
    """
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    B, P, N, D = children.shape
    J, D_out = weight.shape[1], weight.shape[3]
    assert pose_rows(children, weight) == 1, "dynamic routing has vector poses"
    u = children.reshape(B * P, N, D)  # (BP, N, D)
    w = weight.permute(0, 2, 1, 3).reshape(N, D, J * D_out)  # (N, D, J·D_out): û_{j|i} = W_ij u_i, D_out adjacent
    blocks = vote_blocks(B * P, N * J * D_out * children.element_size())
    # plain inference writes every block's votes into one buffer
    size = N * (blocks[0][1] - blocks[0][0]) * J * D_out if blocks else 0
    vote_buffer = children.new_empty(size) if reuses_buffers(children, weight) else None
    parents, coefficients = [], []
    for start, stop in blocks:
        n = stop - start
        u_block = u[start:stop].transpose(0, 1).contiguous()  # (N, n, D)
        out = None if vote_buffer is None else vote_buffer[: N * n * J * D_out].view(N, n, J * D_out)
        votes = torch.bmm(u_block, w, out=out)  # (N, n, J·D_out): û_{j|i}, one product per child
        votes = votes.view(N, n * J, D_out).transpose(0, 1)  # (nJ, N, D_out): a view, never a copy
        # round 1: b_ij = 0, so c_ij = 1/J for every child and no softmax is needed
        c = None
        v = squash(votes.sum(dim=1, keepdim=True) / J)  # (nJ, 1, D_out)
        logits = None
        for _ in range(iterations - 1):
            # (1, D_out) @ (D_out, N) per (row, j): the agreement <û_{j|i}, v_j> of every child, parents first
            agreement = torch.bmm(v, votes.transpose(1, 2)).view(n, J, N)  # (n, J, N)
            logits = agreement if logits is None else logits + agreement  # b_ij
            c = torch.softmax(logits, dim=1)  # (n, J, N): over parents
            # s_j = Σ_i c_ij û_{j|i}: per (row, j) a (1, N) @ (N, D_out) product reading the votes in place
            v = squash(torch.bmm(c.view(n * J, 1, N), votes))  # (nJ, 1, D_out)
        parents.append(v)
        if keep_coefficients:
            coefficients.append(votes.new_full((n, J, N), 1.0 / J) if c is None else c)
    new = torch.cat(parents).view(B, P, J, D_out)  # (B, P, J, D_out)
    if not keep_coefficients:
        return new, None
    return new, torch.cat(coefficients).view(B, P, J, N).transpose(2, 3)  # (B, P, N, J)


# ------------------------------------------------------------------------------------- dynamic routing (Sabour 2017)


class Squash(nn.Module):
    """``squash`` as a module: a vector's direction kept, its length mapped into [0, 1)."""

    def forward(self, s: Tensor) -> Tensor:
        return squash(s)


class SquashedPrimaryCapsules(PrimaryCapsules):
    """Sabour et al.'s PrimaryCaps: a bias-free conv to types × D channels, each D-vector squashed (no LayerNorm).

    Shapes: features (B, C, H, W) → poses (B, h, w, I, D) with lengths in [0, 1). ``layer_norm`` must be False:
    the squash takes LayerNorm's place.
    """

    def __init__(
        self,
        in_channels: int,
        types: int,
        pose_dim: int,
        kernel: int,
        stride: int,
        padding: int,
        layer_norm: bool = False,
    ):
        if layer_norm:
            raise ValueError("dynamic routing squashes its capsules instead of LayerNorm: set layer_norm=False")
        super().__init__(in_channels, types, pose_dim, kernel, stride, padding, layer_norm=False)
        self.norm = Squash()


class DynamicCapsuleLayer(CapsuleLayer):
    """Parents routed from children by dynamic routing (Sabour et al., 2017); a conv layer or a fully connected one.

    Children and windows as in ``CapsuleLayer`` (whose weights, window gathering and output layout it shares),
    with vector poses only: û_{j|i} = W_ij u_i, coupling logits updated by agreement for all ``iterations`` rounds
    at once (``dynamic_routing``), parents squashed. A parent's length is the probability that its entity
    is present; the class layer reads it out as a logit (``class_logits``).

    Shapes:
        children: (B, H, W, I, D) or (B, I, D); parents: (B, h, w, J, D) (conv) or (B, J, D) (fc).
    Example:
        >>> layer = DynamicCapsuleLayer(CapsuleLayerConfig("fc", 10), 8, 0, "vector", 16)
        >>> parents, _ = layer(squash(torch.randn(4, 8, 16)), iterations=3)
        >>> layer.class_logits(parents).shape
        torch.Size([4, 10])
    """

    # lengths are clamped to [1e-12, 1 − 1e-6] before the logit: finite logits in [-27.6, 13.8], and only lengths
    # out of float32's reach of 1 (|s| > 1000) or exactly 0 lose their gradient
    MIN_LENGTH, LENGTH_EPS = 1e-12, 1e-6

    def __init__(
        self,
        config: CapsuleLayerConfig,
        in_types: int,
        in_size: int,
        pose: str,
        pose_dim: int,
        layer_norm: bool = False,
        activations: bool = False,
    ):
        if pose != "vector" or layer_norm or activations:
            raise ValueError(
                "dynamic routing has vector poses, squashed: set pose='vector', layer_norm=False, activations=False"
            )
        super().__init__(config, in_types, in_size, pose, pose_dim, layer_norm=False, activations=False)
        # W ~ N(0, 1/D_out): each vote is about as long as its child (E|û_j|i|² = |u_i|²), so that the agreements
        # <û_j|i, v_j> start below 1 and the first rounds route softly; the lengths then start short and grow
        # under the margin loss (our choice: the paper gives no init). A scale that keeps |s_j| ≈ |u_i| at uniform
        # coupling, about J/√N times larger, makes routing near one-hot from the start, and SGD oscillate as the
        # lengths saturate.
        nn.init.normal_(self.weight, std=pose_dim**-0.5)

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` rounds with the children fixed; see ``forward``."""
        return self(u, iterations, keep_coefficients)

    def forward(
        self,
        u: Tensor,
        iterations: int = 3,
        keep_coefficients: bool = False,  # type: ignore[override]
    ) -> tuple[Tensor, Tensor | None]:
        """Parents after ``iterations`` rounds, and with ``keep_coefficients`` the coupling coefficients (B, P, N, J)
        of the last round (None at one round, which couples uniformly: the caller fills in 1/J)."""
        if iterations == 1:  # c_ij = 1/J: one product (conv: one conv2d), no vote tensor
            if self.kind == "conv":
                return uniform_conv_step(u, self.weight, self.kernel_size, self.stride, squash), None
            return self._grid(uniform_step(self.group_children(u), self.weight, squash), u), None
        parents, coefficients = dynamic_routing(self.group_children(u), self.weight, iterations, keep_coefficients)
        return self._grid(parents, u), coefficients

    def class_logits(self, parents: Tensor) -> Tensor:
        """(B, C, D) class capsules → (B, C) logits whose sigmoid is each capsule's length |v_k|."""
        length = torch.linalg.vector_norm(parents, dim=-1).clamp(self.MIN_LENGTH, 1 - self.LENGTH_EPS)  # (B, C)
        return torch.log(length) - torch.log1p(-length)  # logit(|v_k|)


# Sabour et al. (2017), section 3: a present class's capsule should be longer than m⁺, an absent one's shorter than
# m⁻; absent classes weigh λ, so that early training does not shrink every capsule
MARGIN_PRESENT, MARGIN_ABSENT, ABSENT_WEIGHT = 0.9, 0.1, 0.5


def margin_loss(logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0) -> Tensor:
    """Margin loss on capsule lengths sigmoid(logits) (B, C), summed over classes, averaged over the batch."""
    lengths = torch.sigmoid(logits)  # (B, C): |v_k|
    present = targets.to(lengths.dtype) if multi_label else F.one_hot(targets, logits.shape[1]).to(lengths.dtype)
    per_class = present * F.relu(MARGIN_PRESENT - lengths) ** 2  # (B, C)
    per_class = per_class + ABSENT_WEIGHT * (1 - present) * F.relu(lengths - MARGIN_ABSENT) ** 2
    return per_class.sum(dim=1).mean()
