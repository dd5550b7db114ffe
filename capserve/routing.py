"""Inverted dot-product attention routing (Tsai et al., ICLR 2020), the maths alone.

One routing step between N children and J parents, at each of P positions (P = 1 for a fully connected
capsule layer; for a conv capsule layer the children of a position are its k×k window over all child types):

    votes       v_ij = u_i · W_ij            matrix poses (√D×√D product), or W_ij u_i for vector poses
    agreement   a_ij = <p_j, v_ij> / √D      p_j: the parents' poses from the previous iteration
    routing     r_ij = softmax_j(a_ij)       over parents: each child splits itself among the parents
    update      p_j  = LayerNorm(Σ_i r_ij v_ij)

Parents start at zero, so the first step has a_ij = 0 and routes uniformly, r_ij = 1/J. That step needs no
votes at all: Σ_i v_ij / J is one matrix product of the children with the stacked weights (``uniform_step``),
or, for a conv capsule layer, one ``conv2d`` over the child grid (``uniform_conv_step``), which also skips
gathering the k×k windows.

Later steps need every vote: the agreement is a three-way contraction (children, weights, parents), and any
two-operand order builds a tensor of D values per (child, parent, position), far too big to hold whole (7 GB
for the first conv capsule layer of cifar10-resnet at batch 250). ``routing_step`` therefore works through the
(batch × position) rows a block at a time, in two buffers reused by every block and small enough to stay in cache
(``VOTE_BLOCK_BYTES`` each). A block's votes come from one product per child of its r pose rows (r, X) with its
(X, Y·J) weights, laid out (children, rows, D_out, J) with the parents innermost; in that layout the agreement is
an elementwise product with the parents and a sum over D_out, the softmax runs over the innermost dim, and the
weighted sum scales the votes in place and sums over the children, the outermost dim. Each of those passes reads
the block where it lies, with unit stride over J, while it is still in cache. Rows are independent (the softmax is
over parents, per child and row), so the blocks give the same numbers as one big block. Memory for a step is the
two buffers plus its inputs and outputs, whatever the batch and T.

Weights have shape (N, J, X, Y): a child pose of D values is viewed as r rows of X values (matrix: r = X = √D;
vector: r = 1, X = D_in) and each row is mapped to Y values, so a parent pose has D_out = r·Y values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Normalize = Callable[[Tensor], Tensor]

# Size of one block of votes in bytes (the step holds two: the votes and their products with the parents). Small,
# so that each of the passes over a block reads it from cache: for the second conv capsule layer of cifar10-resnet
# at batch 64 (one thread, CPU time, the cores shared with other work), 2, 4, 8, 16, 32 MB blocks took 0.54, 0.69,
# 0.93, 1.05, 1.02× the time of the former step (block-diagonal weights, 32 MB blocks). Two threads halve each
# pass, hence 4 MB. Every block costs a handful of parallel regions, so on oversubscribed cores (far more runnable
# threads than cores) small blocks wait at many more thread barriers: there, fewer, larger blocks do better.
VOTE_BLOCK_BYTES = 4 * 2**20


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


def _vote_weight(weight: Tensor) -> Tensor:
    """(N, J, X, Y) → (N, X, Y·J): each child's map from one pose row to that row of every parent's vote.

    One product per child of its r pose rows (r, X) with this gives its votes as (r, Y, J), parents innermost: the
    layout in which the agreement and the weighted sum are plain elementwise products and sums (see
    ``routing_step``). Only the X·Y·J useful weights take part: no block-diagonal zeros for matrix poses.
    """
    N, J, X, Y = weight.shape
    return weight.permute(0, 2, 3, 1).reshape(N, X, Y * J)  # (N, X, YJ)


def block_rows(row_bytes: int) -> int:
    """How many (batch × position) rows of votes, of ``row_bytes`` each, one block holds (at least one)."""
    return max(1, VOTE_BLOCK_BYTES // row_bytes)


def routing_step(children: Tensor, weight: Tensor, parents: Tensor, normalize: Normalize,
                 keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
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
    r = _rows(children, weight)
    D_out, rows = r * Y, B * P
    u = children.reshape(rows, N, D)  # (BP, N, D)
    w = _vote_weight(weight)  # (N, X, Y·J)
    # a_ij = <p_j, v_ij> / √D, with the scale folded into the (small) parents, laid out like a vote: (D_out, J)
    q = (parents.reshape(rows, J, D_out) * D_out**-0.5).transpose(1, 2).contiguous()  # (BP, D_out, J)
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (children, weight, parents))
    if torch.compiler.is_exporting():
        # an exported graph takes any batch: one block of all rows, no Python loop over a symbolic size
        blocks, buffers = [(0, rows)], None
    else:
        block = block_rows(N * J * D_out * children.element_size())
        blocks = [(start, min(start + block, rows)) for start in range(0, rows, block)]
        # autograd keeps every block's votes for the backward pass, and autocast does not cast ``out=`` products,
        # so only plain inference reuses two buffers (votes, and their products with the parents) and works in place
        inplace = not recording and not torch.is_autocast_enabled(children.device.type)
        size = N * min(block, rows) * J * D_out
        buffers = (children.new_empty(size), children.new_empty(size)) if inplace else None
    sums, coefficients = [], []
    for start, stop in blocks:
        n, size = stop - start, N * (stop - start) * J * D_out
        u_block = u[start:stop].transpose(0, 1).reshape(N, n * r, -1)  # (N, n·r, X): each child's pose rows
        out = None if buffers is None else buffers[0][:size].view(N, n * r, Y * J)
        v = torch.bmm(u_block, w, out=out).view(N, n, D_out, J)  # (N, n, D_out, J): one product per child
        q_block = q[start:stop].to(v.dtype)  # (n, D_out, J)
        products = torch.mul(v, q_block) if buffers is None else torch.mul(v, q_block, out=buffers[1][:size].view_as(v))
        c = torch.softmax(products.sum(2), dim=2).to(v.dtype)  # (N, n, J): over parents
        # Σ_i r_ij v_ij: scale each vote by its coefficient, then sum over the children (the outermost dim)
        weighted = v * c[:, :, None] if buffers is None else v.mul_(c[:, :, None])  # (N, n, D_out, J)
        sums.append(weighted.sum(0))  # (n, D_out, J)
        if keep_coefficients:
            coefficients.append(c.transpose(0, 1))  # (n, N, J)
    new = normalize(torch.cat(sums).transpose(1, 2).reshape(B, P, J, D_out))  # (B, P, J, D_out)
    if not keep_coefficients:
        return new, None
    return new, torch.cat(coefficients).view(B, P, N, J)  # (B, P, N, J)
