"""Memory engineering shared by the routing algorithms: the (batch × position) rows of a step are worked through a
block at a time (``vote_blocks``), in buffers small enough to stay in cache, so a step's memory does not grow with
the batch or T. The blocks give the same numbers as one big block: rows are independent (each softmax is over
parents, per child and row)."""

from __future__ import annotations

import torch
from torch import Tensor

# Size of one block of votes in bytes (attention's step holds two: the votes and their products with the parents).
# Small, so that each pass over a block reads it from cache; every block costs a few parallel regions, so much
# smaller blocks pay in thread barriers. Chosen by bench_routing.py (figures: docs/benchmarks/routing.md).
VOTE_BLOCK_BYTES = 4 * 2**20


def vote_blocks(rows: int, row_bytes: int, block_bytes: int | None = None, start: int = 0) -> list[tuple[int, int]]:
    """How a routing step works through its (batch × position) rows: as (start, stop) blocks, the last one shorter.

    Attention, dynamic and EM routing all plan their blocks here; each block holds as many rows as fit in
    ``block_bytes`` (``VOTE_BLOCK_BYTES`` unless given; at least one row). An exported graph takes any batch, so
    under ``torch.export`` there is one block of all rows and no Python loop over a symbolic size.

    Args:
        rows: B·P, the step's rows.
        row_bytes: bytes of one row's votes (N children × J parents × D_out values).
        block_bytes: the budget of one block (EM's steps hold several vote-sized tensors at once: a larger one).
        start: the first row to plan (the rows before it were done elsewhere, e.g. by the fused kernel).
    Example:
        >>> vote_blocks(5, row_bytes=1, block_bytes=2)
        [(0, 2), (2, 4), (4, 5)]
    """
    if torch.compiler.is_exporting():
        return [(start, rows)]
    budget = VOTE_BLOCK_BYTES if block_bytes is None else block_bytes
    block = max(1, budget // row_bytes)
    return [(first, min(first + block, rows)) for first in range(start, rows, block)]


def reuses_buffers(*inputs: Tensor) -> bool:
    """Whether a step may write every block's votes into one buffer, and work on it in place: plain inference only.

    Autograd keeps every block's votes for the backward pass (when any input requires grad), autocast does not cast
    ``out=`` products, and an exported graph has one block (no buffer to reuse).
    """
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in inputs)
    autocast = torch.is_autocast_enabled(inputs[0].device.type)
    return not recording and not autocast and not torch.compiler.is_exporting()


def pose_rows(children: Tensor, weight: Tensor) -> int:
    """r, the rows of X values a child pose of D values is viewed as (matrix poses: r = X = √D; vectors: r = 1)."""
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
    than a vector register is slow on CPU (class capsules: 8 or 10 parents), while from 16 parents on it is the
    faster one; hence only for J < 16. Same maths: the max is subtracted first."""
    x = x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))
