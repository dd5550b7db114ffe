"""The fused attention kernel: big plain-CPU inference steps through ``torch.compile``, without writing votes.

Used by ``capserve.routing.attention.routing_step`` where it pays (see ``FUSED_MIN_VOTES``);
``CAPSERVE_FUSED_ROUTING=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

log = logging.getLogger(__name__)


# Plain CPU inference runs the big steps through one compiled kernel (``fused_block``) that never writes a vote: the
# eager passes each write or read every vote, in a parallel region of their own. It wins on the conv capsule steps of
# the CIFAR models and loses where the parents fill no whole vector register or the pose rows are long (class
# capsules, 8×8 poses, 64-d vectors), and its compile (seconds, once per process and shape) pays only for big steps.
# Hence the three bounds below, chosen by bench_model.py (figures: docs/benchmarks/routing.md).
# ``CAPSERVE_FUSED_ROUTING=0`` turns it off; where ``torch.compile`` cannot build (no C++ compiler) it is off.
FUSED_MIN_VOTES = 2**24


FUSED_MIN_PARENTS = 32


FUSED_MAX_ROW = 8


# Bytes of routing coefficients (N·J per row) in one fused block: the kernel's whole working set is a block's
# children, coefficients and parents. Blocks have a fixed number of rows, as the kernel is compiled for one shape;
# the last rows, fewer than a block, take the eager path.
FUSED_BLOCK_BYTES = 2**20


_FUSED_KERNELS: dict[tuple, Callable[..., Tensor]] = {}  # (block shapes, dtype, threads) → fused_block compiled


_FUSED_STATE = {"failed": False}


_FUSED_LOCK = threading.Lock()
_SKIPPED: ContextVar[bool] = ContextVar("capserve_fused_skipped", default=False)  # inside ``without_fused_kernel``


@contextlib.contextmanager
def without_fused_kernel() -> Iterator[None]:
    """Route eagerly inside this block (this thread or task only): for work too short for the kernel's compile,
    seconds per block shape, to pay back."""
    token = _SKIPPED.set(True)
    try:
        yield
    finally:
        _SKIPPED.reset(token)


def compiled_kernels() -> int | None:
    """How many block shapes ``fused_block`` is compiled for in this process (0: no step was big enough yet), or
    None where ``torch.compile`` failed here and the steps run eagerly."""
    return None if _FUSED_STATE["failed"] else len(_FUSED_KERNELS)


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
    # inductor's loops run on the intra-op threads of the thread that compiles them: a kernel per thread count, for
    # a server whose batches run on fewer threads than its lone requests (TorchRuntime.with_threads)
    key = (tuple(u.shape), tuple(w.shape), u.dtype, torch.get_num_threads())
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
            log.warning(
                "attention routing runs without its fused kernel: torch.compile failed here (%s: %s); set "
                "CAPSERVE_FUSED_ROUTING=0 to skip the attempt",
                type(e).__name__,
                reason,
            )
            _FUSED_STATE["failed"] = True
            return None
        _FUSED_KERNELS[key] = kernel
        return out


def fusable(children: Tensor, weight: Tensor, votes: int) -> bool:
    """Whether a plain-inference step goes through ``fused_block`` (see ``FUSED_MIN_VOTES``)."""
    _, J, X, _ = weight.shape
    return (
        votes >= FUSED_MIN_VOTES
        and J >= FUSED_MIN_PARENTS
        and X <= FUSED_MAX_ROW
        and children.device.type == "cpu"
        and children.dtype in (torch.float32, torch.float64)
        and not torch.compiler.is_compiling()
        and not torch.jit.is_tracing()
    )


def fused_rows(u: Tensor, w: Tensor, q: Tensor, coefficient_bytes: int) -> tuple[list[Tensor], int]:
    """The full fused blocks of a step (u (BP, N, r, X), w (N, X, Y, J), q (BP, r, Y, J)): their sums (n, D_out, J),
    and how many rows they cover from the first (0 where the kernel is off or cannot compile: the eager blocks then
    do every row)."""
    if os.environ.get("CAPSERVE_FUSED_ROUTING", "1") == "0" or _SKIPPED.get():
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
