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

In plain CPU inference, the big steps with many parents go one better (``fused_block``): ``torch.compile`` turns
each block's agreement, softmax and weighted sum into loop nests that recompute the few products each needs instead
of writing any vote, one parallel region per block instead of seven passes (``FUSED_MIN_VOTES``: where it pays).

Weights have shape (N, J, X, Y): a child pose of D values is viewed as r rows of X values (matrix: r = X = √D;
vector: r = 1, X = D_in) and each row is mapped to Y values, so a parent pose has D_out = r·Y values.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import types
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Normalize = Callable[[Tensor], Tensor]
log = logging.getLogger(__name__)

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


def _softmax_(x: Tensor) -> Tensor:
    """Softmax over the innermost dim, in place. Written out because ``torch.softmax`` over an innermost dim shorter
    than a vector register is slow on CPU: over 8 and 10 parents (class capsules) it took 5–6× the time of these
    passes, over 16 to 100 parents 0.6–0.8× (one thread, 0.5 M values); hence only for J < 16. Same maths: the max is
    subtracted first."""
    x = x.sub_(x.amax(-1, keepdim=True)).exp_()
    return x.div_(x.sum(-1, keepdim=True))


def block_rows(row_bytes: int) -> int:
    """How many (batch × position) rows of votes, of ``row_bytes`` each, one block holds (at least one)."""
    return max(1, VOTE_BLOCK_BYTES // row_bytes)


# Plain CPU inference runs the big steps through one compiled kernel (``fused_block``) that never writes a vote:
# the eager passes each write or read every vote, in a parallel region of their own, and the step of the second
# conv capsule layer of cifar10-resnet at batch 64 is 229 blocks × 7 of them. Measured (2 threads, float32, eager
# → fused ms): cifar10-resnet's conv capsule steps (J = 32, 4×4 poses) 421 → 230 and 2256 → 470 at batch 250;
# cifar100-resnet's (J = 32, 6×6) 233 → 198 and 439 → 372 at batch 64, its 20 → 100 class capsules 2308 → 653 at
# batch 512 (beside another job). It lost where the parents fill no whole vector register or the pose rows are
# long: class capsules (J = 10, 20) 25 → 179 and 23 → 52, multimnist-matrix's 8×8 poses with J = 16 even,
# multimnist-vector's 64-d vectors 1726 → 14803. Hence: at least FUSED_MIN_VOTES votes (below, the compile, seconds
# once per process and shape, does not pay), at least FUSED_MIN_PARENTS parents, and pose rows of at most
# FUSED_MAX_ROW values. ``CAPSERVE_FUSED_ROUTING=0`` turns it off; where ``torch.compile`` cannot build (no C++
# compiler) it is off.
FUSED_MIN_VOTES = 2**24
FUSED_MIN_PARENTS = 32
FUSED_MAX_ROW = 8
# Bytes of routing coefficients (N·J per row) in one fused block: the kernel's whole working set is a block's
# children, coefficients and parents. Blocks have a fixed number of rows, as the kernel is compiled for one shape;
# the last rows, fewer than a block, take the eager path. For the step above (2 threads), blocks of 8, 32, 128 and
# all 1,600 rows took 62, 57, 62 and 91 ms (eager: 110-300 ms).
FUSED_BLOCK_BYTES = 2**20
_FUSED_KERNELS: dict[tuple, Callable[..., Tensor]] = {}  # (block shapes, dtype) → fused_block compiled for them
_FUSED_STATE = {"failed": False}
_FUSED_LOCK = threading.Lock()


def fused_block(u: Tensor, w: Tensor, q: Tensor) -> Tensor:
    """One attention iteration over a block of rows, written for ``torch.compile``: each sum below is one loop nest
    over its products, and no vote v_ij = u_i W_ij is ever stored (each sum recomputes the products it needs,
    about 1.5× the multiplications of storing the votes, for far less memory traffic).

    Args:
        u: (n, N, r, X) child pose rows; w: (N, X, Y, J) weights; q: (n, r, Y, J) parents' poses ÷ √D_out.
    Returns:
        (n, r, Y, J): Σ_i r_ij v_ij, the parents' poses before normalisation, laid out like ``q``.
    """
    # a_ij = <p_j, v_ij> / √D_out = Σ_{a,b,c} u_i[a,b] W_ij[b,c] q_j[a,c]
    agreement = (u[..., None, None] * w[:, None] * q[:, None, :, None]).sum((2, 3, 4))  # (n, N, J)
    c = torch.softmax(agreement, dim=-1)  # (n, N, J)
    # Σ_i r_ij v_ij [a,c] = Σ_{i,b} u_i[a,b] r_ij W_ij[b,c]
    return (u[..., None, None] * c[:, :, None, None, None] * w[:, None]).sum((1, 3))  # (n, r, Y, J)


def _fused(u: Tensor, w: Tensor, q: Tensor) -> Tensor | None:
    """``fused_block(u, w, q)`` compiled for these shapes (the first call of a shape compiles it, one thread at a
    time); None when compiling fails, with a warning the first time: the steps then run eagerly, as everywhere
    ``torch.compile`` cannot build."""
    key = (tuple(u.shape), tuple(w.shape), u.dtype)
    kernel = _FUSED_KERNELS.get(key)
    if kernel is not None:
        return kernel(u, w, q)
    with _FUSED_LOCK:
        if _FUSED_STATE["failed"]:
            return None
        # its own code object per shape: dynamo keeps at most ``recompile_limit`` (8) compiled shapes per code
        # object, and one process can route more shapes than that (layers × dtypes × models)
        code = fused_block.__code__.replace()
        kernel = torch.compile(types.FunctionType(code, fused_block.__globals__), dynamic=False, fullgraph=True)
        try:
            out = kernel(u, w, q)
        except Exception as e:  # torch.compile raises its backends' own types (no C++ compiler, unsupported platform)
            reason = (str(e).strip().splitlines() or [""])[0]
            log.warning("attention routing runs without its fused kernel: torch.compile failed here (%s: %s); set "
                        "CAPSERVE_FUSED_ROUTING=0 to skip the attempt", type(e).__name__, reason)  # fmt: skip
            _FUSED_STATE["failed"] = True
            return None
        _FUSED_KERNELS[key] = kernel
        return out


def _fusable(children: Tensor, weight: Tensor, votes: int) -> bool:
    """Whether a plain-inference step goes through ``fused_block`` (see ``FUSED_MIN_VOTES``)."""
    _, J, X, _ = weight.shape
    return (votes >= FUSED_MIN_VOTES and J >= FUSED_MIN_PARENTS and X <= FUSED_MAX_ROW
            and children.device.type == "cpu" and children.dtype in (torch.float32, torch.float64)
            and not torch.compiler.is_compiling() and not torch.jit.is_tracing())  # fmt: skip


def _fused_rows(u: Tensor, w: Tensor, q: Tensor, coefficient_bytes: int) -> tuple[list[Tensor], int]:
    """The full fused blocks of a step (u (BP, N, r, X), w (N, X, Y, J), q (BP, r, Y, J)): their sums (n, D_out, J),
    and how many rows they cover from the first (0 where the kernel is off or cannot compile: the eager blocks then
    do every row)."""
    if os.environ.get("CAPSERVE_FUSED_ROUTING", "1") == "0":
        return [], 0
    # at least two rows a block: the kernel's parallel loops are over its rows
    block = max(2, FUSED_BLOCK_BYTES // coefficient_bytes)
    sums: list[Tensor] = []
    for start in range(0, u.shape[0] - block + 1, block):
        s = _fused(u[start : start + block], w, q[start : start + block])  # (n, r, Y, J)
        if s is None:
            return [], 0
        sums.append(s.view(block, -1, s.shape[-1]))  # (n, D_out, J)
    return sums, len(sums) * block


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
    sums: list[Tensor] = []
    if torch.compiler.is_exporting():
        # an exported graph takes any batch: one block of all rows, no Python loop over a symbolic size
        blocks, buffers = [(0, rows)], None
    else:
        # autograd keeps every block's votes for the backward pass, and autocast does not cast ``out=`` products,
        # so only plain inference reuses two buffers (votes, and their products with the parents) and works in place
        inplace = not recording and not torch.is_autocast_enabled(children.device.type)
        row_bytes = N * J * D_out * children.element_size()
        done = 0
        if inplace and not keep_coefficients and _fusable(children, weight, rows * N * J * D_out):
            coefficient_bytes = N * J * children.element_size()  # per row
            # fused_block's layouts are views of the eager step's: (BP, N, r, X), (N, X, Y, J), (BP, r, Y, J)
            sums, done = _fused_rows(u.view(rows, N, r, -1), w.view(N, -1, Y, J), q.view(rows, r, Y, J),
                                     coefficient_bytes)  # fmt: skip
        block = block_rows(row_bytes)
        blocks = [(start, min(start + block, rows)) for start in range(done, rows, block)]
        size = N * min(block, rows - done) * J * D_out
        buffers = (children.new_empty(size), children.new_empty(size)) if inplace and blocks else None
    coefficients = []
    for start, stop in blocks:
        n, size = stop - start, N * (stop - start) * J * D_out
        u_block = u[start:stop].transpose(0, 1).reshape(N, n * r, -1)  # (N, n·r, X): each child's pose rows
        out = None if buffers is None else buffers[0][:size].view(N, n * r, Y * J)
        v = torch.bmm(u_block, w, out=out).view(N, n, D_out, J)  # (N, n, D_out, J): one product per child
        q_block = q[start:stop].to(v.dtype)  # (n, D_out, J)
        products = torch.mul(v, q_block) if buffers is None else torch.mul(v, q_block, out=buffers[1][:size].view_as(v))
        agreement = products.sum(2)  # (N, n, J)
        c = _softmax_(agreement) if buffers is not None and J < 16 else torch.softmax(agreement, dim=2).to(v.dtype)
        # Σ_i r_ij v_ij: scale each vote by its coefficient, then sum over the children (the outermost dim)
        weighted = v * c[:, :, None] if buffers is None else v.mul_(c[:, :, None])  # (N, n, D_out, J)
        sums.append(weighted.sum(0))  # (n, D_out, J)
        if keep_coefficients:
            coefficients.append(c.transpose(0, 1))  # (n, N, J)
    new = normalize(torch.cat(sums).transpose(1, 2).reshape(B, P, J, D_out))  # (B, P, J, D_out)
    if not keep_coefficients:
        return new, None
    return new, torch.cat(coefficients).view(B, P, N, J)  # (B, P, N, J)


# ==================================================================================================================
# Dynamic routing (Sabour, Frosst & Hinton, NeurIPS 2017), the paper's comparison system "dynamic"
# ==================================================================================================================
#
# Vector poses whose length is the probability that the entity exists. Between N children u_i and J parents, per
# position (conv capsule layers: the k×k window over all child types, weights shared across positions, as above):
#
#     votes       û_{j|i} = W_ij u_i
#     coupling    c_ij = softmax_j(b_ij)            b_ij = 0 at the start, so round 1 couples uniformly (1/J)
#     parents     v_j = squash(Σ_i c_ij û_{j|i})
#     agreement   b_ij ← b_ij + <û_{j|i}, v_j>      (not after the last round: it would never be read)
#
# for T rounds, all of one layer's before the next layer starts (sequential). The votes do not change between
# rounds, so ``dynamic_routing`` computes each block of (batch × position) rows' votes once and runs all T rounds
# on the block while it is in cache, in blocks of ``routing_step``'s size (``vote_blocks``). Memory is one block of
# votes, plus, when training, every block's votes once (the attention step keeps one copy per iteration) and the
# D-times-smaller couplings of each round.


def squash(s: Tensor) -> Tensor:
    """Sabour et al.'s non-linearity (their eq. 1), over the last dim: v = |s|²/(1 + |s|²) · s/|s| = s·|s|/(1 + |s|²).

    The direction of ``s`` with a length in [0, 1): short vectors shrink to almost nothing (length ≈ |s|²), long
    ones reach just below 1. Written without 1/|s|, so it is exact for short vectors and 0 (with a zero gradient)
    at s = 0, with no epsilon. Any shape (…, D) → the same shape.
    """
    length = torch.linalg.vector_norm(s, dim=-1, keepdim=True)  # (…, 1)
    return s * (length / (1 + length * length))  # (…, D)


def vote_blocks(children: Tensor, weight: Tensor, *inputs: Tensor
                ) -> tuple[Tensor, Tensor, list[tuple[int, int]], Tensor | None]:  # fmt: skip
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
    r = _rows(children, weight)
    D_out, rows = r * Y, B * P
    u = children.reshape(rows, N, D)  # (BP, N, D)
    assert r == 1, "dynamic routing has vector poses"
    w = weight.permute(0, 2, 1, 3).reshape(N, D, J * D_out)  # (N, D, J·D_out): û_{j|i} = W_ij u_i, D_out adjacent
    if torch.compiler.is_exporting():
        # an exported graph takes any batch: one block of all rows, no Python loop over a symbolic size
        return u, w, [(0, rows)], None
    block = block_rows(N * J * D_out * children.element_size())
    blocks = [(start, min(start + block, rows)) for start in range(0, rows, block)]
    # autograd keeps every block's votes for the backward pass, and autocast does not cast ``out=`` products, so only
    # plain inference reuses one buffer
    recording = torch.is_grad_enabled() and any(t.requires_grad for t in (children, weight, *inputs))
    reuse = not recording and not torch.is_autocast_enabled(children.device.type)
    return u, w, blocks, children.new_empty(N * min(block, rows) * J * D_out) if reuse else None


def dynamic_routing(children: Tensor, weight: Tensor, iterations: int,
                    keep_coefficients: bool = False) -> tuple[Tensor, Tensor | None]:  # fmt: skip
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
    B, P, N, _ = children.shape
    J = weight.shape[1]
    u, w, blocks, vote_buffer = vote_blocks(children, weight)  # (BP, N, D), (N, D, J·D_out)
    D_out = w.shape[-1] // J
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


# ==================================================================================================================
# EM routing (Hinton, Sabour & Frosst, "Matrix capsules with EM routing", ICLR 2018), the paper's comparison system.
# ==================================================================================================================
#
# Each capsule is a √D×√D pose matrix M and an activation a ∈ (0, 1). Between N children and J parents at each of P
# positions (a conv capsule layer's k×k window over all child types, or all children of an fc layer):
#
#     votes     V_ij = M_i W_ij                                  (√D×√D products, flattened to D values)
#     M-step    R'_ij = R_ij a_i;  S_j = Σ_i R'_ij
#               μ_j = Σ_i R'_ij V_ij / S_j;   σ²_j = Σ_i R'_ij (V_ij − μ_j)² / S_j + ε    (per pose entry h)
#               cost_j = Σ_h (β_v + log σ_jh) · S_j · 100 J / N;   a_j = sigmoid(λ_t (β_a − cost_j))
#     E-step    log p_ij = −½ Σ_h [(V_ij,h − μ_j,h)² / σ²_j,h + log σ²_j,h + log 2π]
#               R_ij = a_j p_ij / Σ_k a_k p_ik = softmax_j(log a_j + log p_ij)     (log space: p underflows)
#
# R starts uniform (1/J); each of the T iterations runs the M-step, and all but the last then run the E-step, so T = 1
# is one M-step with uniform assignments. The parents' poses are μ_j and their activations a_j.
#
# Choices the paper leaves open, written down here (following Gritzman, "Avoiding implementation pitfalls of 'Matrix
# capsules with EM routing'", 2019, and IBM/matrix-capsules-with-em-routing, its code, the reproduction closest to
# the paper's smallNORB accuracy; www0wwwjs1/Matrix-Capsules-EM-Tensorflow and yl-1993/Matrix-Capsules-EM-PyTorch
# were also read):
# - The cost is scaled by 100 J / N, i.e. S_j is measured against the N / J children a parent receives under uniform
#   routing: a class layer fed by a whole grid gets far more data per parent than a 3×3 conv layer, and without the
#   scaling one β_a, β_v and λ schedule cannot suit both (Gritzman's pitfall 2).
# - λ_t = 0.01 (1 − 0.95^t) for t = 1..T, the schedule Hinton gave on OpenReview (final λ 0.01).
# An earlier version standardised the cost over each position's parents, with λ_t = t, after www0wwwjs1. Measured on
# DiverseMultiMNIST (multimnist-em-small, 300 Adam steps of 32 images, validation recall of the k top-scoring classes
# for images with k digits, chance 0.19): standardised 0.25–0.29, this cost 0.34; with an fc capsule layer before the
# class capsules, standardised did not learn (validation spread loss flat with SGD or Adam; ranked recall 0.16–0.19
# trained with BCE instead), this cost reached 0.26.
# - ε = 1e-6 floors σ² (a parent whose votes agree exactly keeps a finite log σ and 1/σ²).
# - Each parent position routes its own window: a child in several overlapping windows is normalised per window,
#   R_ij summing to 1 over the J parents of that position (as both reproductions do), which makes (batch × position)
#   rows independent and lets the work go a block of rows at a time, like ``routing_step``.
# - β_v and β_a are learned, one each per parent type, shared over positions; both start at 0.
#
# Activations travel as logits: a capsule is D pose values and one more, the logit of its activation, so that every
# layer's output is one tensor (…, D + 1), the class logits are read off exactly (no logit of a rounded
# probability), and log a_j in the E-step is ``logsigmoid``, finite for any logit.

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


def em_m_step(assignments: Tensor, activations: Tensor, votes: Tensor, beta_v: Tensor, beta_a: Tensor,
              inverse_temperature: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
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


def em_routing(votes: Tensor, activations: Tensor, beta_v: Tensor, beta_a: Tensor,
               iterations: int) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
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


def em_route(children: Tensor, weight: Tensor, beta_v: Tensor, beta_a: Tensor, iterations: int,
             offsets: Tensor | None = None, keep_coefficients: bool = False
             ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
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
    if torch.compiler.is_exporting():
        blocks = [(0, rows)]  # an exported graph takes any batch: one block, no loop over a symbolic size
    else:
        block = max(1, EM_BLOCK_BYTES // (N * J * D * children.element_size()))  # rows whose votes fit
        blocks = [(start, min(start + block, rows)) for start in range(0, rows, block)]
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
