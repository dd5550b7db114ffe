"""Inverted dot-product attention routing (Tsai et al., ICLR 2020), the maths alone.

One routing step between N children and J parents, at each of P positions (P = 1 for a fully connected
capsule layer; for a conv capsule layer the children of a position are its k×k window over all child types):

    votes       v_ij = u_i · W_ij            matrix poses (√D×√D product), or W_ij u_i for vector poses
    agreement   a_ij = <p_j, v_ij> / √D      p_j: the parents' poses from the previous iteration
    routing     r_ij = softmax_j(a_ij)       over parents: each child splits itself among the parents
    update      p_j  = LayerNorm(Σ_i r_ij v_ij)

Parents start at zero, so the first step has a_ij = 0 and routes uniformly, r_ij = 1/J.

The module reads top to bottom: first these equations as written (``votes``, ``agreement``, ``reference_step``,
``reference_uniform_step``), every vote held at once; then the fast paths, which give the reference's numbers
(tests/routing) without holding every vote; then the capsule layers that call them.

The first step needs no votes at all: Σ_i v_ij / J is one matrix product of the children with the stacked weights
(``uniform_step``), or, for a conv capsule layer, one ``conv2d`` over the child grid (``uniform_conv_step``), which
also skips gathering the k×k windows.

Later steps need every vote: the agreement is a three-way contraction (children, weights, parents), and any
two-operand order builds a tensor of D values per (child, parent, position), far too big to hold whole for a conv
capsule layer at serving batch sizes. ``routing_step`` therefore works through the (batch × position) rows a block
at a time (``vote_blocks``), in two buffers reused by every block and small enough to stay in cache. A block's votes
come from one product per child of its r pose rows (r, X) with its (X, Y·J) weights, laid out (children, rows,
D_out, J) with the parents innermost; in that layout the agreement is an elementwise product with the parents and a
sum over D_out, the softmax runs over the innermost dim, and the weighted sum scales the votes in place and sums over
the children, the outermost dim. Each of those passes reads the block where it lies, with unit stride over J, while
it is still in cache. Rows are independent (the softmax is over parents, per child and row), so the blocks give the
same numbers as one big block. Memory for a step is the two buffers plus its inputs and outputs, whatever the batch
and T.

In plain CPU inference, the big steps with many parents go one better (``fused_block``): ``torch.compile`` turns
each block's agreement, softmax and weighted sum into loop nests that recompute the few products each needs instead
of writing any vote, one parallel region per block instead of seven passes (``FUSED_MIN_VOTES``: where it pays).

Weights have shape (N, J, X, Y): a child pose of D values is viewed as r rows of X values (matrix: r = X = √D;
vector: r = 1, X = D_in) and each row is mapped to Y values, so a parent pose has D_out = r·Y values.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from capserve.configs import CapsuleLayerConfig
from capserve.routing.blocks import pose_rows, reuses_buffers, softmax_, vote_blocks, vote_weight
from capserve.routing.fused import fusable, fused_rows

Normalize = Callable[[Tensor], Tensor]


# ---------------------------------------------------------------------------- the equations, every vote held at once


def votes(children: Tensor, weight: Tensor) -> Tensor:
    """v_ij = u_i · W_ij: every child's vote for every parent.

    Args:
        children: (..., N, D) child poses, each viewed as r rows of X values.
        weight: (N, J, X, Y) transforms, each mapping one pose row of X values to Y values.
    Returns:
        (..., N, J, D_out) votes, D_out = r·Y.
    Example:
        >>> votes(torch.randn(2, 5, 16), torch.randn(5, 3, 4, 4)).shape  # 4×4 matrix poses
        torch.Size([2, 5, 3, 16])
    """
    *batch, N, D = children.shape
    X = weight.shape[2]
    u = children.reshape(*batch, N, D // X, X)  # (..., N, r, X)
    # children first: each child's r pose rows against its own J transforms, contracted over X
    v = torch.einsum("...nrx,njxy->...njry", u, weight)  # (..., N, J, r, Y)
    return v.flatten(-2)  # (..., N, J, D_out)


def agreement(votes: Tensor, parents: Tensor) -> Tensor:
    """a_ij = <p_j, v_ij> / √D_out: how far each child's vote agrees with each parent's current pose.

    Args:
        votes: (..., N, J, D_out); parents: (..., J, D_out).
    Returns:
        (..., N, J) agreements.
    """
    # votes first: each child's J votes against the J parents, contracted over the pose
    return torch.einsum("...njd,...jd->...nj", votes, parents) / math.sqrt(votes.shape[-1])  # (..., N, J)


def reference_step(
    children: Tensor, weight: Tensor, parents: Tensor, normalize: Normalize, keep_coefficients: bool = False
) -> tuple[Tensor, Tensor | None]:
    """One routing iteration as the paper writes it: the four equations, with every vote in one tensor.

    The fast paths (``routing_step``, ``fused_block``, ``uniform_step``, ``uniform_conv_step``) give these numbers;
    this one is for reading and for testing them, not for serving (its votes grow with the batch).

    Args:
        children: (..., N, D) child poses, e.g. (B, P, N, D).
        weight: (N, J, X, Y) transforms.
        parents: (..., J, D_out) parent poses from the previous iteration.
        normalize: the pose normalisation (LayerNorm over D_out, or identity for the ablation).
        keep_coefficients: also return the routing coefficients.
    Returns:
        parents: (..., J, D_out) updated parent poses.
        coefficients: (..., N, J) routing probabilities r_ij, summing to 1 over J, or None.
    """
    v = votes(children, weight)  # (..., N, J, D_out)
    r = torch.softmax(agreement(v, parents), dim=-1)  # (..., N, J): over parents
    # coefficients first: Σ_i r_ij v_ij, contracted over the children
    s = torch.einsum("...nj,...njd->...jd", r, v)  # (..., J, D_out)
    return normalize(s), r if keep_coefficients else None


def reference_uniform_step(children: Tensor, weight: Tensor, normalize: Normalize) -> Tensor:
    """The first iteration as the paper writes it: parents start at zero, so a_ij = 0, r_ij = 1/J and
    p_j = normalize(Σ_i v_ij / J).

    Args:
        children: (..., N, D); weight: (N, J, X, Y).
    Returns:
        (..., J, D_out) parent poses.
    """
    v = votes(children, weight)  # (..., N, J, D_out)
    return normalize(v.sum(dim=-3) / weight.shape[1])  # (..., J, D_out)


# ------------------------------------------------------------------ the fast paths: the same numbers, bounded memory


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
    r = pose_rows(children, weight)
    # Σ_i u_i W_ij is one (B·P·r, N·X) @ (N·X, J·Y) product: no (children × parents) tensor is ever built.
    u = children.reshape(B, P, N, r, X).transpose(2, 3).reshape(B * P * r, N * X)  # (BPr, NX)
    w = weight.permute(0, 2, 1, 3).reshape(N * X, J * Y)  # (NX, JY)
    s = (u @ w).div_(J)  # (BPr, JY)
    s = s.view(B, P, r, J, Y).transpose(2, 3).reshape(B, P, J, r * Y)  # (B, P, J, D_out)
    return normalize(s)


def uniform_conv_step(grid: Tensor, weight: Tensor, kernel_size: int, stride: int, normalize: Normalize) -> Tensor:
    """``uniform_step`` of a conv capsule layer, straight from the child grid: one ``conv2d``, no window copies.

    Σ_i u_i W_ij over a k×k window of all child types is a convolution whose input channels are (type, column
    of the pose row) and whose output channels are (parent type, column); the r pose rows ride in the batch.

    Args:
        grid: (B, H, W, I, D) child poses; the children of a position are its k×k window, in (kh, kw, I) order.
        weight: (N, J, X, Y) transforms, N = k·k·I.
    Returns:
        (B, h, w, J, D_out) parent poses.
    """
    B, H, W, I, D = grid.shape
    _, J, X, Y = weight.shape
    r, k = D // X, kernel_size
    # channels-last input (B·r, H, W, I·X): oneDNN's preferred layout, one copy of the (small) child grid
    x = grid.reshape(B, H, W, I, r, X).permute(0, 4, 1, 2, 3, 5).reshape(B * r, H, W, I * X)  # (Br, H, W, IX)
    x = x.permute(0, 3, 1, 2)  # (Br, IX, H, W), a channels-last view
    w = weight.reshape(k, k, I, J, X, Y).permute(3, 5, 2, 4, 0, 1).reshape(J * Y, I * X, k, k)  # (JY, IX, k, k)
    w = w.contiguous(memory_format=torch.channels_last)
    s = F.conv2d(x, w, stride=stride)  # (Br, JY, h, w)
    h, w_ = s.shape[-2:]
    s = s.view(B, r, J, Y, h, w_).permute(0, 4, 5, 2, 1, 3).reshape(B, h, w_, J, r * Y)  # (B, h, w, J, D_out)
    return normalize(s / J)


def routing_step(
    children: Tensor, weight: Tensor, parents: Tensor, normalize: Normalize, keep_coefficients: bool = False
) -> tuple[Tensor, Tensor | None]:
    """One inverted dot-product attention iteration given the parents' current poses, a block of rows at a time.

    Args:
        children: (B, P, N, D) child poses.
        weight: (N, J, X, Y) transforms.
        parents: (B, P, J, D_out) parent poses from the previous iteration.
        keep_coefficients: also return the routing coefficients (B·P·N·J values: as many as the votes ÷ D).
    Returns:
        parents: (B, P, J, D_out) updated parent poses.
        coefficients: (B, P, N, J) routing probabilities r_ij, summing to 1 over J, or None.
    """
    B, P, N, D = children.shape
    J, Y = weight.shape[1], weight.shape[3]
    r = pose_rows(children, weight)
    D_out, rows = r * Y, B * P
    u = children.reshape(rows, N, D)  # (BP, N, D)
    w = vote_weight(weight)  # (N, X, Y·J)
    # a_ij = <p_j, v_ij> / √D, with the scale folded into the (small) parents, laid out like a vote: (D_out, J)
    q = (parents.reshape(rows, J, D_out) * D_out**-0.5).transpose(1, 2).contiguous()  # (BP, D_out, J)
    sums: list[Tensor] = []
    # plain inference reuses two buffers (votes, and their products with the parents) and works in place
    inplace = reuses_buffers(children, weight, parents)
    done = 0
    if inplace and not keep_coefficients and fusable(children, weight, rows * N * J * D_out):
        coefficient_bytes = N * J * children.element_size()  # per row
        # fused_block's layouts are views of the eager step's: (BP, N, r, X), (N, X, Y, J), (BP, r, Y, J)
        sums, done = fused_rows(u.view(rows, N, r, -1), w.view(N, -1, Y, J), q.view(rows, r, Y, J), coefficient_bytes)
    blocks = vote_blocks(rows, N * J * D_out * children.element_size(), start=done)
    size = N * (blocks[0][1] - blocks[0][0]) * J * D_out if blocks else 0
    buffers = (children.new_empty(size), children.new_empty(size)) if inplace and blocks else None
    coefficients = []
    for start, stop in blocks:
        n, size = stop - start, N * (stop - start) * J * D_out
        u_block = u[start:stop].transpose(0, 1).reshape(N, n * r, -1)  # (N, n·r, X): each child's pose rows
        out = None if buffers is None else buffers[0][:size].view(N, n * r, Y * J)
        v = torch.bmm(u_block, w, out=out).view(N, n, D_out, J)  # (N, n, D_out, J): one product per child
        q_block = q[start:stop].to(v.dtype)  # (n, D_out, J)
        products = torch.mul(v, q_block) if buffers is None else torch.mul(v, q_block, out=buffers[1][:size].view_as(v))
        a = products.sum(2)  # (N, n, J): a_ij
        c = softmax_(a) if buffers is not None and J < 16 else torch.softmax(a, dim=2).to(v.dtype)
        # Σ_i r_ij v_ij: scale each vote by its coefficient, then sum over the children (the outermost dim)
        weighted = v * c[:, :, None] if buffers is None else v.mul_(c[:, :, None])  # (N, n, D_out, J)
        sums.append(weighted.sum(0))  # (n, D_out, J)
        if keep_coefficients:
            coefficients.append(c.transpose(0, 1))  # (n, N, J)
    new = normalize(torch.cat(sums).transpose(1, 2).reshape(B, P, J, D_out))  # (B, P, J, D_out)
    if not keep_coefficients:
        return new, None
    return new, torch.cat(coefficients).view(B, P, N, J)  # (B, P, N, J)


def pose_norm(dim: int, enabled: bool, types: int | None = None) -> nn.Module:
    """LayerNorm over each pose of ``dim`` values, or with ``types`` over all of a position's ``types`` poses
    together (the last two dims of (..., J, D)); identity when not ``enabled``."""
    if not enabled:
        return nn.Identity()
    return nn.LayerNorm(dim if types is None else (types, dim))


class PrimaryCapsules(nn.Module):
    """A bias-free conv to types × D channels; each D-vector is one capsule's pose, LayerNorm'd."""

    def __init__(
        self,
        in_channels: int,
        types: int,
        pose_dim: int,
        kernel: int,
        stride: int,
        padding: int,
        layer_norm: bool = True,
    ):
        super().__init__()
        self.types, self.pose_dim = types, pose_dim
        self.conv = nn.Conv2d(in_channels, types * pose_dim, kernel, stride=stride, padding=padding, bias=False)
        self.norm = pose_norm(pose_dim, layer_norm)

    def forward(self, features: Tensor) -> Tensor:
        if self.conv.kernel_size == (1, 1):
            # a channels-last 1×1 conv writes (B, H, W, I·D) in memory, so the permute below is a free view; larger
            # kernels keep the default layout, in which they run faster on CPU (bench_model.py)
            features = features.contiguous(memory_format=torch.channels_last)
        u = self.conv(features)  # (B, I·D, H, W)
        B, _, H, W = u.shape
        u = u.permute(0, 2, 3, 1).reshape(B, H, W, self.types, self.pose_dim)  # (B, H, W, I, D)
        return self.norm(u)


def group_children(u: Tensor, kind: str, kernel_size: int, stride: int) -> Tensor:
    """Capsules grouped by the parent position they reach: (B, P, N, D), N in (kh, kw, I) order for conv (the
    k×k window over all child types at stride s, no padding), all children in (H, W, I) order for fc (P = 1)."""
    if kind == "fc":
        return u.reshape(u.shape[0], 1, -1, u.shape[-1])  # (B, 1, N, D)
    k, s = kernel_size, stride
    windows = u.unfold(1, k, s).unfold(2, k, s)  # (B, h, w, I, D, k, k)
    B, h, w, I, D = windows.shape[:5]
    return windows.permute(0, 1, 2, 5, 6, 3, 4).reshape(B, h * w, k * k * I, D)  # (B, P, N, D)


def parents_layout(parents: Tensor, u: Tensor, kind: str, kernel_size: int, stride: int) -> Tensor:
    """Parents (B, P, J, D) of children ``u`` → the layer's output layout: (B, h, w, J, D) for conv, (B, J, D) fc."""
    B, P, J, D = parents.shape
    if kind == "fc":
        return parents.view(B, J, D)  # (B, J, D)
    side = (u.shape[1] - kernel_size) // stride + 1
    return parents.view(B, side, P // side, J, D)  # (B, h, w, J, D)


class CapsuleLayer(nn.Module):
    """Parents routed from children by inverted dot-product attention; a conv layer or a fully connected one.

    Conv: the children of the parent at (h, w) are the true k×k window (stride s, no padding) over all child
    types, with weights shared across positions. FC: every child capsule (all types and positions) is a child
    of every parent.

    Args:
        config: kind, parent types J, kernel and stride.
        in_types: child capsule types I.
        in_size: side of the child grid (0 when the children come from an fc layer).
        pose: "matrix" or "vector"; pose_dim D is the same for children and parents.
        shared: fc from a grid: one transform per child type, whatever its position (``votes_weight``).
        cells: fc from a grid: one transform per child type in each cell of a cells×cells partition of the grid
            (``ModelConfig.class_grid``); 1 is ``shared``, the grid's side a transform per position.
        init_types: the authors' init as for this many parent types (``ModelConfig.init_classes``).
        joint_norm: one LayerNorm over all J parents of a position (``ModelConfig.class_norm="joint"``).
    Shapes:
        children: (B, H, W, I, D) or (B, I, D); parents: (B, h, w, J, D) (conv) or (B, J, D) (fc).
    """

    def __init__(
        self,
        config: CapsuleLayerConfig,
        in_types: int,
        in_size: int,
        pose: str,
        pose_dim: int,
        layer_norm: bool = True,
        activations: bool = False,
        shared: bool = False,
        cells: int | None = None,
        init_types: int | None = None,
        joint_norm: bool = False,
    ):
        super().__init__()
        self.kind, self.kernel_size, self.stride = config.kind, config.kernel_size, config.stride
        self.types = config.types
        side = math.isqrt(pose_dim)
        x, y = (side, side) if pose == "matrix" else (pose_dim, pose_dim)
        if config.kind == "conv":
            n = config.kernel_size**2 * in_types
            fan_in = in_types * config.kernel_size**2
        else:
            n = in_types * max(in_size, 1) ** 2
            fan_in = n
        # fc from a grid with ``shared`` or ``cells``: the positions of a cell share one transform per child type
        # (``votes_weight``); the cell of each position, in (H, W) order, is a buffer the checkpoint need not hold
        self.cells = 1 if shared else cells
        if self.cells is not None and config.kind == "fc" and in_size > 0:
            side = torch.arange(in_size) * self.cells // in_size  # (S,) each row's (and column's) cell
            self.register_buffer("cell_of", (side[:, None] * self.cells + side).flatten(), persistent=False)  # (P,)
            n = in_types * self.cells**2
        else:
            self.cells = None
        # the authors' init: N(0, 1) · √(J / (√D·N_in·K²)) for matrix poses (D_in in place of √D for vectors), with J
        # = ``init_types`` when given (ModelConfig.init_classes)
        std = math.sqrt((init_types or config.types) / (x * fan_in))
        self.weight = nn.Parameter(torch.randn(n, config.types, x, y) * std)  # (N, J, X, Y), N = (kh, kw, I)

        # joint: one LayerNorm over all J parents of a position, so that their sizes still say which got the votes
        self.norm = pose_norm(pose_dim, layer_norm, config.types if joint_norm else None)
        self.activation = nn.Linear(pose_dim, 1) if activations else None

    def votes_weight(self) -> Tensor:
        """The (N, J, X, Y) transforms of every child. Shared within cells, a type's transform is repeated at each
        position of its cell (children in (H, W, I) order), so a part votes alike wherever it lies in the cell: with a
        transform per position, the same part seen at another place meets weights that never learnt it."""
        if self.cells is None:
            return self.weight
        per_cell = self.weight.unflatten(0, (self.cells**2, -1))  # (cells², I, J, X, Y)
        # index_select, not per_cell[cell_of]: its gradient sums the positions of a cell in a fixed order, where
        # indexing's scatters them with atomic adds whose order, and so whose sum, follows the threads' timing
        return per_cell.index_select(0, self.cell_of).flatten(0, 1)  # (P·I, J, X, Y)

    def _activate(self, u: Tensor) -> Tensor:
        if self.activation is not None:
            u = u * torch.sigmoid(self.activation(u))  # capsule activations ablation: scale each child pose
        return u

    def group_children(self, u: Tensor) -> Tensor:
        """Child poses grouped by the parent position they reach: (B, P, N, D)."""
        return group_children(self._activate(u), self.kind, self.kernel_size, self.stride)

    def _grid(self, parents: Tensor, u: Tensor) -> Tensor:
        """(B, P, J, D) → the layer's output layout."""
        return parents_layout(parents, u, self.kind, self.kernel_size, self.stride)

    def route(self, u: Tensor, iterations: int, keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:
        """All ``iterations`` of this layer with its children fixed (the sequential schedule)."""
        parents, coefficients = self(u)
        for _ in range(iterations - 1):
            parents, coefficients = self(u, parents, keep_coefficients)
        return parents, coefficients

    def forward(
        self, u: Tensor, parents: Tensor | None = None, keep_coefficients: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """One routing iteration: uniform when ``parents`` is None, else attention to the given parents.

        Returns the new parent poses and, with ``keep_coefficients``, the routing coefficients (B, P, N, J) of an
        attention step (None otherwise, and always None for the uniform step).
        """
        if parents is None and self.kind == "conv":  # straight from the grid: no (B, P, N, D) window copy
            grid = uniform_conv_step(self._activate(u), self.weight, self.kernel_size, self.stride, self.norm)
            return grid, None
        children = self.group_children(u)
        weight = self.votes_weight()  # (N, J, X, Y)
        if parents is None:
            return self._grid(uniform_step(children, weight, self.norm), u), None
        B, J, D = parents.shape[0], parents.shape[-2], parents.shape[-1]
        new, coefficients = routing_step(children, weight, parents.reshape(B, -1, J, D), self.norm, keep_coefficients)
        return self._grid(new, u), coefficients


def cross_entropy_loss(
    logits: Tensor, targets: Tensor, multi_label: bool, progress: float = 1.0, label_smoothing: float = 0.0
) -> Tensor:
    """Softmax cross-entropy (against targets smoothed by ``label_smoothing``: 1 - ε on the label, ε spread evenly over
    all classes), or per-class binary cross-entropy for multi-label targets, which are never smoothed."""
    if multi_label:
        if label_smoothing:
            raise ValueError("label smoothing spreads one label's weight over the others: single-label targets only")
        return F.binary_cross_entropy_with_logits(logits, targets)
    return F.cross_entropy(logits, targets, label_smoothing=label_smoothing)
