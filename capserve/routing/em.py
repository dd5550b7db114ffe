"""EM routing (Hinton, Sabour & Frosst, "Matrix capsules with EM routing", ICLR 2018), the paper's comparison
system "em": its maths, its capsule layers and the spread loss.

Each capsule is a √D×√D pose matrix M and an activation a ∈ (0, 1). Between N children and J parents at each of P
positions (a conv capsule layer's k×k window over all child types, or all children of an fc layer):

    votes     V_ij = M_i W_ij                                  (√D×√D products, flattened to D values)
    M-step    R'_ij = R_ij a_i;  S_j = Σ_i R'_ij
              μ_j = Σ_i R'_ij V_ij / S_j;   σ²_j = Σ_i R'_ij (V_ij − μ_j)² / S_j + ε    (per pose entry h)
              cost_j = Σ_h (β_v + log σ_jh) · S_j · 100 J / N;   a_j = sigmoid(λ_t (β_a − cost_j))
    E-step    log p_ij = −½ Σ_h [(V_ij,h − μ_j,h)² / σ²_j,h + log σ²_j,h + log 2π]
              R_ij = a_j p_ij / Σ_k a_k p_ik = softmax_j(log a_j + log p_ij)     (log space: p underflows)

R starts uniform (1/J); each of the T iterations runs the M-step, and all but the last then run the E-step, so T = 1
is one M-step with uniform assignments. The parents' poses are μ_j and their activations a_j.

Choices the paper leaves open, written down here (following Gritzman, "Avoiding implementation pitfalls of 'Matrix
capsules with EM routing'", 2019, and IBM/matrix-capsules-with-em-routing, its code, the reproduction closest to
the paper's smallNORB accuracy; www0wwwjs1/Matrix-Capsules-EM-Tensorflow and yl-1993/Matrix-Capsules-EM-PyTorch
were also read):
- The cost is scaled by 100 J / N, i.e. S_j is measured against the N / J children a parent receives under uniform
  routing: a class layer fed by a whole grid gets far more data per parent than a 3×3 conv layer, and without the
  scaling one β_a, β_v and λ schedule cannot suit both (Gritzman's pitfall 2).
- λ_t = 0.01 (1 − 0.95^t) for t = 1..T, the schedule Hinton gave on OpenReview (final λ 0.01).
- The cost is not standardised over each position's parents (www0wwwjs1's choice, with λ_t = t): on
  DiverseMultiMNIST, standardised costs learn less, and not at all with an fc capsule layer before the class
  capsules (docs/benchmarks/routing.md, EM routing's cost).
- ε = 1e-6 floors σ² (a parent whose votes agree exactly keeps a finite log σ and 1/σ²).
- Each parent position routes its own window: a child in several overlapping windows is normalised per window,
  R_ij summing to 1 over the J parents of that position (as both reproductions do), which makes (batch × position)
  rows independent and lets the work go a block of rows at a time, like ``routing_step``.
- β_v and β_a are learned, one each per parent type, shared over positions; both start at 0.

Activations travel as logits: a capsule is D pose values and one more, the logit of its activation, so that every
layer's output is one tensor (…, D + 1), the class logits are read off exactly (no logit of a rounded
probability), and log a_j in the E-step is ``logsigmoid``, finite for any logit.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capserve.configs import CapsuleLayerConfig
from capserve.routing.attention import group_children, parents_layout
from capserve.routing.blocks import vote_blocks

EM_VARIANCE_FLOOR = 1e-6


EM_SHARE_EPS = 1e-8  # keeps μ, σ² finite for a parent that no active child reaches


# Bytes of one block's votes: the M- and E-steps hold a few tensors of the votes' size at once.
EM_BLOCK_BYTES = 32 * 2**20


EM_FINAL_LAMBDA = 0.01  # λ's limit as t grows (Hinton on OpenReview)


EM_COST_SCALE = 100.0  # the cost per N / J children (Gritzman 2019)


def em_inverse_temperature(iteration: int) -> float:
    """λ_t for iteration t = 1, 2, ... (see the section's notes): 0.01 (1 − 0.95^t)."""
    return EM_FINAL_LAMBDA * (1 - 0.95**iteration)


def em_votes(poses: Tensor, weight: Tensor) -> Tensor:
    """V_ij = M_i W_ij, with one transform per child type shared over the positions the children sit at.

    Args:
        poses: (n, N, D) child poses, N = M·G children in (M, G) order: M positions sharing the G transforms.
        weight: (G, J, X, X) transforms, D = X·X (G = N, M = 1 when every child has its own).
    Returns:
        (n, J, N, D) votes, each parent's votes adjacent for the per-parent sums of the M-step.
    """
    n, N, D = poses.shape
    G, J, X, _ = weight.shape
    M = N // G
    # one (n·M·X, X) @ (X, J·X) product per child type: the rows of every pose matrix at once, no zeros
    u = poses.reshape(n * M, G, X, X).permute(1, 0, 2, 3).reshape(G, n * M * X, X)  # (G, nMX, X)
    w = weight.permute(0, 2, 1, 3).reshape(G, X, J * X)  # (G, X, J·X)
    v = torch.bmm(u, w)  # (G, nMX, J·X)
    v = v.view(G, n, M, X, J, X).permute(1, 4, 2, 0, 3, 5)  # (n, J, M, G, X, X)
    return v.reshape(n, J, N, D)  # (n, J, N, D)


def coordinate_offsets(side: int, types: int, pose_dim: int) -> Tensor:
    """The paper's coordinate addition for the class capsules: (N, D) offsets, N = side·side·types in (H, W, I) order.

    "The scaled coordinate (row, column) of the centre of the receptive field of each capsule" is added to "the
    first two elements of the right-hand column of its vote matrix": entries (0, X−1) and (1, X−1) of the X×X vote,
    with the centres scaled to (0, 1) as (index + 0.5) / side.
    """
    X = math.isqrt(pose_dim)
    centres = (torch.arange(side, dtype=torch.float32) + 0.5) / side  # (side,)
    offsets = torch.zeros(side, side, types, X, X)
    offsets[..., 0, X - 1] = centres.view(side, 1, 1)  # row
    offsets[..., 1, X - 1] = centres.view(1, side, 1)  # column
    return offsets.reshape(side * side * types, pose_dim)  # (N, D)


def em_m_step(
    assignments: Tensor, activations: Tensor, votes: Tensor, beta_v: Tensor, beta_a: Tensor, inverse_temperature: float
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The M-step: each parent's Gaussian fitted to the votes, weighted by assignment and child activation.

    Args:
        assignments: (n, J, N) R_ij.
        activations: (n, 1, N) child activations a_i.
        votes: (n, J, N, D).
        beta_v, beta_a: (J,) per parent type.
    Returns:
        mean μ (n, J, D), variance σ² (n, J, D), squared deviations (V − μ)² (n, J, N, D) (the E-step reuses them),
        and the parents' activation logits λ(β_a − cost) (n, J).
    """
    n, J, N, D = votes.shape
    weighted = assignments * activations  # (n, J, N): R'_ij
    share = weighted.sum(-1)  # (n, J): S_j
    # normalised per parent, so that μ and σ² are two (1, N) @ (N, D) products per (row, parent)
    coeff = (weighted / (share.unsqueeze(-1) + EM_SHARE_EPS)).view(n * J, 1, N)  # (nJ, 1, N)
    mean = torch.bmm(coeff, votes.reshape(n * J, N, D)).view(n, J, 1, D)  # (n, J, 1, D)
    deviations = (votes - mean).square()  # (n, J, N, D)
    variance = torch.bmm(coeff, deviations.view(n * J, N, D)).view(n, J, D) + EM_VARIANCE_FLOOR  # (n, J, D)
    # cost_j = Σ_h (β_v + log σ_jh) · S_j, with log σ = ½ log σ², per N / J children (see the notes)
    cost = (D * beta_v + 0.5 * variance.log().sum(-1)) * share * (EM_COST_SCALE * J / N)  # (n, J)
    logits = inverse_temperature * (beta_a - cost)  # (n, J)
    return mean.view(n, J, D), variance, deviations, logits


def em_e_step(deviations: Tensor, variance: Tensor, logits: Tensor) -> Tensor:
    """The E-step: R_ij = a_j p_ij / Σ_k a_k p_ik, in log space.

    Args:
        deviations: (n, J, N, D) (V_ij − μ_j)²; variance: (n, J, D) σ²_j; logits: (n, J) parent activation logits.
    Returns:
        (n, J, N) assignments R_ij, summing to 1 over J.
    """
    n, J, N, D = deviations.shape
    # Σ_h (V − μ)²_h / σ²_h: per (row, parent) an (N, D) @ (D, 1) product
    distance = torch.bmm(deviations.view(n * J, N, D), variance.reciprocal().view(n * J, D, 1)).view(n, J, N)
    log_norm = variance.log().sum(-1) + D * math.log(2 * math.pi)  # (n, J): Σ_h log(2π σ²_h)
    log_p = -0.5 * (distance + log_norm.unsqueeze(-1))  # (n, J, N)
    return torch.softmax(F.logsigmoid(logits).unsqueeze(-1) + log_p, dim=1)  # (n, J, N): over parents


def em_routing(
    votes: Tensor, activations: Tensor, beta_v: Tensor, beta_a: Tensor, iterations: int
) -> tuple[Tensor, Tensor, Tensor]:
    """T iterations of EM between N children and J parents, for n independent rows.

    Args:
        votes: (n, J, N, D); activations: (n, N) child activations a_i in [0, 1]; beta_v, beta_a: (J,).
    Returns:
        parent poses μ (n, J, D), parent activation logits (n, J), and the assignments R (n, J, N) of the last
        M-step (uniform 1/J when T = 1).
    """
    n, J, N, _ = votes.shape
    assignments = votes.new_full((n, J, N), 1.0 / J)  # (n, J, N)
    a = activations.unsqueeze(1)  # (n, 1, N)
    for t in range(1, iterations + 1):
        mean, variance, deviations, logits = em_m_step(assignments, a, votes, beta_v, beta_a, em_inverse_temperature(t))
        if t < iterations:
            assignments = em_e_step(deviations, variance, logits)
    return mean, logits, assignments


def em_route(
    children: Tensor,
    weight: Tensor,
    beta_v: Tensor,
    beta_a: Tensor,
    iterations: int,
    offsets: Tensor | None = None,
    keep_coefficients: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """A capsule layer's EM routing, a block of (batch × position) rows at a time.

    Args:
        children: (B, P, N, D + 1) child capsules: D pose values, then the activation logit.
        weight: (G, J, X, X) transforms, G dividing N (see ``em_votes``).
        beta_v, beta_a: (J,).
        offsets: (N, D) added to every parent's votes (coordinate addition), or None.
        keep_coefficients: also return the assignments.
    Returns:
        parents: (B, P, J, D + 1) poses μ_j and activation logits.
        coefficients: (B, P, N, J) assignments R_ij of the last M-step, summing to 1 over J, or None.
    """
    B, P, N, E = children.shape
    J, D = weight.shape[1], E - 1
    rows = B * P
    u = children.reshape(rows, N, E)  # (BP, N, D + 1)
    blocks = vote_blocks(rows, N * J * D * children.element_size(), block_bytes=EM_BLOCK_BYTES)
    parents, coefficients = [], []
    for start, stop in blocks:
        votes = em_votes(u[start:stop, :, :D], weight)  # (n, J, N, D)
        if offsets is not None:
            votes = votes + offsets  # (n, J, N, D)
        mean, logits, assignments = em_routing(votes, torch.sigmoid(u[start:stop, :, D]), beta_v, beta_a, iterations)
        parents.append(torch.cat([mean, logits.unsqueeze(-1)], dim=-1))  # (n, J, D + 1)
        if keep_coefficients:
            coefficients.append(assignments.transpose(1, 2))  # (n, N, J)
    out = torch.cat(parents).view(B, P, J, E)  # (B, P, J, D + 1)
    if not keep_coefficients:
        return out, None
    return out, torch.cat(coefficients).view(B, P, N, J)  # (B, P, N, J)


# ------------------------------------------------------------------------------------- EM routing (Hinton et al. 2018)


class EMPrimaryCapsules(nn.Module):
    """Matrix capsules with activations (Hinton et al. 2018): a conv to types × D pose values and a conv to one
    activation logit per type, the paper's "logistic unit".

    Every EM capsule is packed as one vector of D + 1 values, the √D×√D pose (row-major) followed by the logit of its
    activation (activation = sigmoid of the last value), so that poses flow between layers as one tensor like the
    other routings' (see the module docstring). ``layer_norm`` must be False: EM normalises nothing
    (``ModelConfig`` refuses True for EM).

    Shapes:
        features (B, C, H, W) → capsules (B, H', W', I, D + 1).
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
        super().__init__()
        if layer_norm:
            raise ValueError("EM capsules take no LayerNorm: set layer_norm=False")
        self.types, self.pose_dim = types, pose_dim
        self.pose = nn.Conv2d(in_channels, types * pose_dim, kernel, stride=stride, padding=padding)
        self.activation = nn.Conv2d(in_channels, types, kernel, stride=stride, padding=padding)

    def forward(self, features: Tensor) -> Tensor:
        poses = self.pose(features)  # (B, I·D, H, W)
        B, _, H, W = poses.shape
        poses = poses.permute(0, 2, 3, 1).reshape(B, H, W, self.types, self.pose_dim)  # (B, H, W, I, D)
        logits = self.activation(features).permute(0, 2, 3, 1).unsqueeze(-1)  # (B, H, W, I, 1)
        return torch.cat([poses, logits], dim=-1)  # (B, H, W, I, D + 1)


class EMCapsuleLayer(nn.Module):
    """Parents routed from children by EM (Hinton et al. 2018); a conv capsule layer or a fully connected one.

    Conv: the parent at (h, w) routes the k×k window (stride s, no padding) over all child types, one 4×4 transform
    per (kh, kw, child type, parent type), shared over positions. FC from a grid (the paper's class capsules): one
    transform per (child type, parent type), shared over positions, with coordinate addition (each vote's scaled
    (row, column) centre added to the first two entries of its right-hand column). FC from an fc layer: one
    transform per (child, parent). β_v and β_a: learned, one per parent type.

    Args:
        config: kind, parent types J, kernel and stride.
        in_types: child capsule types I.
        in_size: side of the child grid (0 when the children come from an fc layer).
        pose: must be "matrix"; pose_dim D = X·X.
        layer_norm, activations: must be False (the EM capsule has its own activation; ``ModelConfig`` checks).
    Shapes:
        capsules carry D + 1 values (pose, activation logit; see ``EMPrimaryCapsules``).
        children: (B, H, W, I, D + 1) or (B, I, D + 1); parents: (B, h, w, J, D + 1) (conv) or (B, J, D + 1) (fc).
    """

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
        super().__init__()
        if pose != "matrix" or layer_norm or activations:
            raise ValueError("EM capsule layers need matrix poses, layer_norm=False and activations=False")
        self.kind, self.kernel_size, self.stride = config.kind, config.kernel_size, config.stride
        self.types = config.types
        X = math.isqrt(pose_dim)
        groups = config.kernel_size**2 * in_types if config.kind == "conv" else in_types
        children = groups * max(in_size, 1) ** 2 if config.kind == "fc" else groups  # N per parent position
        # std √N / X: 1/√X keeps each vote at its child's scale, and μ, the mean of N votes that disagree before
        # training, shrinks it by up to √N (less once the E-step concentrates the assignments). So the poses keep
        # their scale from layer to layer, where 1/√X alone shrinks it at every layer and leaves the class
        # capsules' coordinate addition (of scale 1) drowning the poses.
        std = math.sqrt(children) / X
        self.weight = nn.Parameter(torch.randn(groups, config.types, X, X) * std)  # (G, J, X, X)
        self.beta_v = nn.Parameter(torch.zeros(config.types))  # (J,)
        self.beta_a = nn.Parameter(torch.zeros(config.types))  # (J,)
        offsets = coordinate_offsets(in_size, in_types, pose_dim) if config.kind == "fc" and in_size else None
        self.register_buffer("offsets", offsets, persistent=False)  # (N, D) or None: derived, not saved

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` of EM for this layer: parents and, with ``keep_coefficients``, the assignment
        probabilities R (B, P, N, J) of the last M-step (uniform at one iteration)."""
        children = group_children(u, self.kind, self.kernel_size, self.stride)  # (B, P, N, D + 1)
        parents, coefficients = em_route(
            children, self.weight, self.beta_v, self.beta_a, iterations, self.offsets, keep_coefficients
        )
        return parents_layout(parents, u, self.kind, self.kernel_size, self.stride), coefficients

    forward = route

    @staticmethod
    def class_logits(parents: Tensor) -> Tensor:
        """(B, C, D + 1) class capsules → (B, C) logits of their activations (the paper's class score)."""
        return parents[..., -1]


SPREAD_MARGIN = (0.2, 0.9)  # the paper's margin at the start and at the end of training


def spread_margin(progress: float) -> float:
    """The spread loss margin after ``progress`` ∈ [0, 1] of training: linear from 0.2 to 0.9."""
    start, end = SPREAD_MARGIN
    return start + (end - start) * min(max(progress, 0.0), 1.0)


def spread_loss(logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0) -> Tensor:
    """The spread loss of matrix capsules (Hinton et al. 2018), mean over the batch.

    Single-label: L = Σ_{i≠t} max(0, m − (a_t − a_i))², a = sigmoid(logits), t the target class.
    Multi-label (the paper has none; this generalisation reduces to the paper's loss for one present class, apart from
    the threshold terms): every present class p is spread from every absent class q, Σ_{p,q} max(0, m − (a_p − a_q))²,
    and, because a multi-label decision is a > 0.5 (logit > 0; see ``ModelConfig.thresholds``), from that threshold
    too: + Σ_p max(0, m/2 − (a_p − ½))² + Σ_q max(0, m/2 − (½ − a_q))², so that a present class ends above 0.5 and an
    absent one below, as the pairs alone do not require.
    """
    m = spread_margin(progress)
    a = torch.sigmoid(logits)  # (B, C)
    if not multi_label:
        target = a.gather(1, targets.view(-1, 1))  # (B, 1): a_t
        gaps = F.relu(m - (target - a)).square()  # (B, C): the target's own term is m², removed below
        return (gaps.sum(1) - m**2).mean()
    present = targets > 0.5  # (B, C)
    # pairs (p, q): gap[b, p, q] = m − (a_p − a_q), kept where p is present and q absent
    gaps = F.relu(m - (a.unsqueeze(2) - a.unsqueeze(1))).square()  # (B, C, C)
    pairs = present.unsqueeze(2) & ~present.unsqueeze(1)  # (B, C, C)
    threshold = torch.where(present, F.relu(m / 2 - (a - 0.5)), F.relu(m / 2 - (0.5 - a))).square()  # (B, C)
    return ((gaps * pairs).sum((1, 2)) + threshold.sum(1)).mean()
