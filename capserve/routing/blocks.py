"""Memory engineering shared by the routing algorithms: the (batch × position) rows of a step are worked through a
block at a time, in buffers small enough to stay in cache (``VOTE_BLOCK_BYTES``), so a step's memory does not
grow with the batch or T. The blocks give the same numbers as one big block (rows are independent)."""

from __future__ import annotations

import torch
from torch import Tensor

# Size of one block of votes in bytes (the step holds two: the votes and their products with the parents). Small,
# so that each pass over a block reads it from cache; every block costs a few parallel regions, so much smaller
# blocks pay in thread barriers. Chosen by bench_routing.py (figures: docs/benchmarks.md).
VOTE_BLOCK_BYTES = 4 * 2**20


def pose_rows(children: Tensor, weight: Tensor) -> int:
    rows, rem = divmod(children.shape[-1], weight.shape[2])
    assert rem == 0, f"pose size {children.shape[-1]} is not a multiple of the weight's input size {weight.shape[2]}"
    return rows


def vote_weight(weight: Tensor) -> Tensor:
    """(N, J, X, Y) → (N, X, Y·J): each child's map from one pose row to that row of every parent's vote.

    One product per child of its r pose rows (r, X) with this gives its votes as (r, Y, J), parents innermost: the
    layout in which the agreement and the weighted sum are plain elementwise products and sums (see
    ``routing_step``). Only the X·Y·J useful weights take part: no block-diagonal zeros for matrix poses.
    """
    N, J, X, Y = weight.shape
    return weight.permute(0, 2, 3, 1).reshape(N, X, Y * J)  # (N, X, YJ)


def softmax_(x: Tensor) -> Tensor:
    """Softmax over the innermost dim, in place. Written out because ``torch.softmax`` over an innermost dim shorter
    than a vector register is slow on CPU: over 8 and 10 parents (class capsules) it took 5–6× the time of these
    passes, over 16 to 100 parents 0.6–0.8× (one thread, 0.5 M values); hence only for J < 16. Same maths: the max is
    subtracted first."""
    x = x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def block_rows(row_bytes: int) -> int:
    """How many (batch × position) rows of votes, of ``row_bytes`` each, one block holds (at least one)."""
    return max(1, VOTE_BLOCK_BYTES // row_bytes)


def row_blocks(rows: int, block: int, start: int = 0) -> list[tuple[int, int]]:
    """Rows ``start``..``rows`` as (start, stop) blocks of ``block`` rows, the last one shorter."""
    return [(first, min(first + block, rows)) for first in range(start, rows, block)]


def vote_blocks(
    children: Tensor, weight: Tensor, *inputs: Tensor
) -> tuple[Tensor, Tensor, list[tuple[int, int]], Tensor | None]:
    """How a routing step works through its (batch × position) rows: the same blocks as ``routing_step``.

    Args:
        children: (B, P, N, D) child poses; weight: (N, J, X, Y); inputs: any other tensors the step reads (a
            block's votes are kept for backward when any of them, or children or weight, requires grad).
    Returns:
        the children as rows (BP, N, D); each child's map to all parents (N, D, J·D_out); the blocks of rows as
        (start, stop); and one buffer for a block's votes, or None where it cannot be reused (recording autograd,
        autocast, export).
    """
    B, P, N, D = children.shape
    J, Y = weight.shape[1], weight.shape[3]
    r = pose_rows(children, weight)
    D_out, rows = r * Y, B * P
    u = children.reshape(rows, N, D)  # (BP, N, D)
    assert r == 1, "dynamic routing has vector poses"
    w = weight.permute(0, 2, 1, 3).reshape(N, D, J * D_out)  # (N, D, J·D_out): û_{j|i} = W_ij u_i, D_out adjacent
    if torch.compiler.is_exporting():
        # an exported graph takes any batch: one block of all rows, no Python loop over a symbolic size
        return u, w, [(0, rows)], None
    block = block_rows(N * J * D_out * children.element_size())
    blocks = row_blocks(rows, block)
    # autograd keeps every block's votes for the backward pass, and autocast does not cast ``out=`` products, so only
    # plain inference reuses one buffer
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (children, weight, *inputs))
    reuse = not recording and not torch.is_autocast_enabled(children.device.type)
    return u, w, blocks, children.new_empty(N * min(block, rows) * J * D_out) if reuse else None
