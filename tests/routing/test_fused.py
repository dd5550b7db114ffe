"""The fused attention step (``fused_block`` under ``torch.compile``) gives the numbers of ``reference_step`` and of
the eager step.

Plain CPU inference sends the full blocks of a big step (``FUSED_MIN_VOTES``) with at least
``FUSED_MIN_PARENTS`` parents through one compiled kernel, and the rows left over through the eager blocks. Each
test lowers the thresholds so that small float64 steps take that path, and checks that it did.
"""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch
from support.models import layer_norm, tiny_input, tiny_model

import capserve
from capserve.evaluate.evaluator import FUSED_MIN_IMAGE_RUNS, predict_batches
from capserve.routing import fused as kernel
from capserve.routing.attention import reference_step, routing_step
from capserve.routing.fused import FUSED_MAX_ROW, FUSED_MIN_PARENTS, _fused, fused_block

needs_compiler = pytest.mark.skipif(
    not any(shutil.which(c) for c in ("g++", "c++", "clang++")), reason="torch.compile needs a C++ compiler on CPU"
)


@pytest.fixture
def fused(monkeypatch):
    """Every step of at least 32 parents fuses; kernels compiled by the test stay with the test. Yields the list of
    (block shape, rows given to the kernel) of each kernel call."""
    monkeypatch.setattr(kernel, "FUSED_MIN_VOTES", 0)
    monkeypatch.setattr(kernel, "_FUSED_KERNELS", {})
    monkeypatch.setattr(kernel, "_FUSED_STATE", {"failed": False})
    monkeypatch.delenv("CAPSERVE_FUSED_ROUTING", raising=False)
    calls = []
    run = _fused

    def recording(u, w, q):
        out = run(u, w, q)
        calls.append((tuple(u.shape), out is not None))
        return out

    monkeypatch.setattr(kernel, "_fused", recording)
    return calls


def random_step(B=2, P=5, N=6, J=32, D=16, X=4, dtype=torch.float64, requires_grad=False):
    g = torch.Generator().manual_seed(0)
    shapes = ((B, P, N, D), (N, J, X, D // (D // X)), (B, P, J, D))
    return [torch.randn(*s, dtype=dtype, generator=g).requires_grad_(requires_grad) for s in shapes]


@needs_compiler
@pytest.mark.parametrize("D, X", [(16, 4), (36, 6), (8, 8)])  # 4×4 and 6×6 matrices, 8-d vectors
@pytest.mark.parametrize("rows_per_block", [2, 3, 10])  # B·P = 10 rows: blocks that divide them, and that do not
def test_fused_blocks_give_the_reference_step(fused, monkeypatch, D, X, rows_per_block):
    children, weight, parents = random_step(D=D, X=X)
    N, J = weight.shape[:2]
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", rows_per_block * N * J * 8)
    with torch.no_grad():
        got, _ = routing_step(children, weight, parents, layer_norm)
    torch.testing.assert_close(got, reference_step(children, weight, parents, layer_norm)[0], rtol=0, atol=1e-10)
    fused_rows = 10 - 10 % rows_per_block
    assert [shape[0] for shape, ran in fused] == [rows_per_block] * (fused_rows // rows_per_block)
    assert all(ran for _, ran in fused)


@needs_compiler
def test_float32_fused_step_is_close_to_the_eager_one(fused, monkeypatch):
    children, weight, parents = random_step(B=4, dtype=torch.float32)
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", 4 * 6 * 32 * 4)
    with torch.no_grad():
        got, _ = routing_step(children, weight, parents, layer_norm)
        monkeypatch.setenv("CAPSERVE_FUSED_ROUTING", "0")
        expected, _ = routing_step(children, weight, parents, layer_norm)
    assert len(fused) == 5
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def fuses(name: str) -> bool:
    """Whether a named config has a conv capsule layer with enough parents to fuse, and pose rows short enough
    (attention routing only)."""
    config = capserve.get_config(name)
    wide = any(layer.kind == "conv" and layer.types >= FUSED_MIN_PARENTS for layer in config.capsules)
    row = config.pose_dim if config.pose == "vector" else math.isqrt(config.pose_dim)
    return config.has_routing and config.routing_algorithm == "attention" and wide and row <= FUSED_MAX_ROW


FUSING_CONFIGS = [name for name in capserve.list_models() if fuses(name)]


def test_the_configs_that_fuse():
    expected = {"cifar10-resnet", "cifar10-simple", "cifar10-conv", "cifar100-resnet", "cifar100-simple"}
    assert set(FUSING_CONFIGS) == expected


@needs_compiler
@pytest.mark.parametrize("routing_order", ["concurrent", "sequential"])
@pytest.mark.parametrize("name", FUSING_CONFIGS)
def test_every_model_with_fused_steps_gives_the_eager_logits(fused, monkeypatch, name, routing_order):
    """The named configs whose conv capsule layers have 32 types, with those layers and their pose size, the rest
    shrunk; T = 1..5, batch 3, blocks of at least 2 rows (rows left over where they do not divide). The steps with
    at least 32 parents fuse; the class capsule steps with 10 parents do not."""
    config = capserve.get_config(name)
    model = tiny_model(
        name, capsules=config.capsules, pose_dim=config.pose_dim, image_size=24, routing=routing_order
    ).double()
    x = tiny_input(model, 3).double()
    many_parents = [layer for layer in model.capsules if layer.weight.shape[1] >= FUSED_MIN_PARENTS]
    # blocks of 2 rows for cifar100's 20 → 100 capsules and for the second conv capsule layer, 3 for the first
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", 2 * 20 * 100 * 8)
    for T in range(1, 6):
        with torch.no_grad():
            got = model(x, iterations=T)
            with monkeypatch.context() as m:
                m.setenv("CAPSERVE_FUSED_ROUTING", "0")
                expected = model(x, iterations=T)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert all(ran for _, ran in fused)
    # the layers with at least 32 parents fused (the conv capsule layers; cifar100-resnet's 100 class capsules from
    # its fc layer of 20 too), no other
    assert {shape[1] for shape, _ in fused} == {layer.weight.shape[0] for layer in many_parents}


@needs_compiler
def test_more_shapes_than_dynamos_recompile_limit_all_fuse(fused, monkeypatch):
    """Dynamo keeps at most ``recompile_limit`` (8) compiled shapes per function: each shape has its own."""
    children, weight, parents = random_step(B=2, P=6, N=2)
    for rows_per_block in range(2, 12):
        monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", rows_per_block * 2 * 32 * 8)
        with torch.no_grad():
            got, _ = routing_step(children, weight, parents, layer_norm)
        torch.testing.assert_close(got, reference_step(children, weight, parents, layer_norm)[0], rtol=0, atol=1e-10)
    assert len(kernel._FUSED_KERNELS) == 10 and all(ran for _, ran in fused)
    assert not kernel._FUSED_STATE["failed"]


def test_a_failed_compile_warns_once_and_routes_eagerly(fused, monkeypatch, caplog):
    compiles = []

    def no_compiler(fn, **kwargs):
        compiles.append(fn)

        def fail(*args):
            raise RuntimeError("Failed to find C++ compiler.\nPlease specify via CXX environment variable.")

        return fail

    monkeypatch.setattr(torch, "compile", no_compiler)
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", 2 * 6 * 32 * 8)
    children, weight, parents = random_step()
    expected = reference_step(children, weight, parents, layer_norm)[0]
    with torch.no_grad(), caplog.at_level(logging.WARNING, logger="capserve.routing"):
        for _ in range(2):
            got, _ = routing_step(children, weight, parents, layer_norm)
            torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    assert len(compiles) == 1  # not tried again
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        "attention routing runs without its fused kernel: torch.compile failed here (RuntimeError: Failed to find "
        "C++ compiler.); set CAPSERVE_FUSED_ROUTING=0 to skip the attempt"
    ]


@pytest.mark.parametrize(
    "case",
    [
        "switched off",
        "too few votes",
        "too few parents",
        "long pose rows",
        "coefficients kept",
        "recording grads",
        "autocast",
        "on a compile trace",
    ],
)
def test_steps_that_do_not_fuse(fused, monkeypatch, case):
    """Fusing is for plain CPU inference of big steps with many parents and short pose rows; the rest is eager."""
    kwargs = {"too few parents": dict(J=16), "long pose rows": dict(D=16, X=16)}.get(case, {})
    children, weight, parents = random_step(requires_grad=case == "recording grads", **kwargs)
    if case == "switched off":
        monkeypatch.setenv("CAPSERVE_FUSED_ROUTING", "0")
    if case == "too few votes":
        monkeypatch.setattr(kernel, "FUSED_MIN_VOTES", children.shape[0] * 5 * 6 * 32 * 16 + 1)
    if case == "on a compile trace":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    keep = case == "coefficients kept"
    with torch.set_grad_enabled(case == "recording grads"):
        if case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                routing_step(children.float(), weight.float(), parents.float(), layer_norm)
        else:
            new, _ = routing_step(children, weight, parents, layer_norm, keep_coefficients=keep)
            torch.testing.assert_close(
                new, reference_step(children, weight, parents, layer_norm)[0], rtol=0, atol=1e-10
            )
    assert fused == []


def test_a_short_evaluation_routes_eagerly_and_a_long_one_through_the_kernel(fused, monkeypatch):
    """A ``capserve evaluate`` of a few hundred images would spend much of its time compiling the kernel: below
    ``FUSED_MIN_IMAGE_RUNS`` image runs it routes eagerly, with the same logits."""
    monkeypatch.setattr(kernel, "FUSED_MIN_PARENTS", 1)
    monkeypatch.setattr(kernel, "FUSED_BLOCK_BYTES", 1)  # blocks of two rows
    monkeypatch.setattr(kernel, "_fused", lambda u, w, q: fused.append(tuple(u.shape)))  # records; None: eager
    model = tiny_model("cifar10-simple")
    images = (tiny_input(model, 4) * 40 + 120).clamp(0, 255).to(torch.uint8)
    short = predict_batches(model, [images], [2], images=len(images))
    assert fused == []
    long = predict_batches(model, [images], [2], images=FUSED_MIN_IMAGE_RUNS)
    assert fused  # the kernel was asked for (and, returning None here, left the rows to the eager blocks)
    torch.testing.assert_close(short[2], long[2])


def test_compiled_kernels_counts_the_shapes_or_says_compiling_failed(monkeypatch):
    monkeypatch.setattr(kernel, "_FUSED_KERNELS", {})
    monkeypatch.setattr(kernel, "_FUSED_STATE", {"failed": False})
    assert kernel.compiled_kernels() == 0
    kernel._FUSED_KERNELS[(1,)] = fused_block
    assert kernel.compiled_kernels() == 1
    kernel._FUSED_STATE["failed"] = True
    assert kernel.compiled_kernels() is None


def test_a_kernel_is_compiled_per_intra_op_thread_count(monkeypatch):
    """Inductor's loops run on the thread count of the thread that compiled them: a server's batches (one thread
    each) and its lone requests (every thread) each get a kernel of their own, and reuse it."""
    monkeypatch.setattr(kernel, "_FUSED_KERNELS", {})
    monkeypatch.setattr(kernel, "_FUSED_STATE", {"failed": False})
    compiled: list[int] = []

    def compile_here(function, **options):
        compiled.append(torch.get_num_threads())  # what inductor would specialise the loops for
        return function

    monkeypatch.setattr(torch, "compile", compile_here)
    u, w, q = torch.randn(2, 3, 1, 4), torch.randn(3, 4, 4, 32), torch.randn(2, 1, 4, 32)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            torch.testing.assert_close(_fused(u, w, q), fused_block(u, w, q))
    finally:
        torch.set_num_threads(before)
    assert compiled == [1, 2]
    assert sorted(key[-1] for key in kernel._FUSED_KERNELS) == [1, 2]
