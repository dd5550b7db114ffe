"""Blocks of (batch × position) rows: any block size gives the numbers of ``reference_step`` (every vote at once),
forward and backward, for one step and for every named model."""

from __future__ import annotations

import pytest
import torch
from support.models import layer_norm, tiny_input, tiny_model

import capserve
from capserve.routing import attention, blocks
from capserve.routing.attention import reference_step, routing_step
from capserve.routing.blocks import vote_blocks


def test_vote_blocks_cover_the_rows_once_in_order():
    assert vote_blocks(7, row_bytes=10, block_bytes=30) == [(0, 3), (3, 6), (6, 7)]
    assert vote_blocks(7, row_bytes=10, block_bytes=30, start=5) == [(5, 7)]  # the rows before were fused
    assert vote_blocks(7, row_bytes=10, block_bytes=1000) == [(0, 7)]
    assert vote_blocks(0, row_bytes=10) == []


def test_an_export_plans_one_block_of_all_rows(monkeypatch):
    """An exported graph takes any batch: no Python loop over a symbolic number of rows."""
    monkeypatch.setattr(torch.compiler, "is_exporting", lambda: True)
    assert vote_blocks(7, row_bytes=10, block_bytes=30) == [(0, 7)]
    assert not blocks.reuses_buffers(torch.zeros(1))


def test_buffers_are_reused_in_plain_inference_only():
    x, w = torch.zeros(2), torch.zeros(2, requires_grad=True)
    assert blocks.reuses_buffers(x)
    assert not blocks.reuses_buffers(x, w)  # autograd keeps every block's votes
    with torch.no_grad():
        assert blocks.reuses_buffers(x, w)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert not blocks.reuses_buffers(x)  # autocast does not cast ``out=`` products


def random_step(pose, B=2, P=3, N=5, J=4, D=16, requires_grad=False):
    x = y = 4 if pose == "matrix" else D
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(*s, dtype=torch.float64, generator=g) for s in ((B, P, N, D), (N, J, x, y), (B, P, J, D))]
    return [t.requires_grad_(requires_grad) for t in tensors]


@pytest.mark.parametrize("pose", ["matrix", "vector"])
@pytest.mark.parametrize("rows_per_block", [1, 2, 3, 4, 5, 6, 100])  # B·P = 6 rows: divides, does not, one block
def test_blocks_of_any_size_give_the_reference_step(monkeypatch, pose, rows_per_block):
    children, weight, parents = random_step(pose)
    N, J, D = children.shape[2], weight.shape[1], parents.shape[-1]
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", rows_per_block * N * J * D * 8)  # float64
    assert vote_blocks(6, N * J * D * 8)[0] == (0, min(rows_per_block, 6))
    expected, expected_coef = reference_step(children, weight, parents, layer_norm, keep_coefficients=True)
    with torch.no_grad():  # inference: one vote buffer reused by every block
        got, coef = routing_step(children, weight, parents, layer_norm, keep_coefficients=True)
        alone, no_coef = routing_step(children, weight, parents, layer_norm)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)
    torch.testing.assert_close(coef, expected_coef, rtol=0, atol=1e-10)
    torch.testing.assert_close(alone, got, rtol=0, atol=0)
    assert no_coef is None


def test_a_budget_below_one_row_still_routes_a_row_at_a_time(monkeypatch):
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 1)
    assert vote_blocks(3, 10**9) == [(0, 1), (1, 2), (2, 3)]
    children, weight, parents = random_step("matrix")
    with torch.no_grad():
        got, _ = routing_step(children, weight, parents, layer_norm)
    torch.testing.assert_close(got, reference_step(children, weight, parents, layer_norm)[0], rtol=0, atol=1e-10)


@pytest.mark.parametrize("pose", ["matrix", "vector"])
def test_gradients_through_blocks_equal_the_reference_ones(monkeypatch, pose):
    """Training records every block (no shared buffer): the gradients are those of the reference step."""
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 1)  # six blocks of one row
    grads = []
    for step in (reference_step, routing_step):
        inputs = random_step(pose, requires_grad=True)
        new, coef = step(*inputs, layer_norm, keep_coefficients=True)
        (new.square().sum() + (coef * torch.arange(coef.shape[-1])).sum()).backward()
        grads.append([t.grad for t in inputs])
    for blocked, expected in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(blocked, expected, rtol=0, atol=1e-10)


def test_blocks_under_bf16_autocast_follow_the_float32_step(monkeypatch):
    """Autocast does not cast products written into a buffer: blocks under autocast allocate their votes."""
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 1)
    children, weight, parents = (t.float() for t in random_step("matrix"))
    expected, _ = reference_step(children, weight, parents, layer_norm)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = routing_step(children, weight, parents, layer_norm)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=0.1)


def largest_row_bytes(model: capserve.CapsNet) -> int:
    """Bytes of one row of votes (N children × J parents × D) of the model's biggest routed layer, in float64."""
    return max(layer.weight.shape[0] * layer.types * model.config.pose_dim * 8 for layer in model.capsules)


@pytest.mark.parametrize("routing_order", ["concurrent", "sequential"])
def test_every_model_blocked_equals_the_reference_for_one_to_five_iterations(monkeypatch, model_name, routing_order):
    """Logits and ``trace()`` coefficients of every named config, T = 1..5, shrunk to stay fast: the same layers
    with fewer channels and a smaller image (grids of 3×3 positions for the last conv capsule layer).

    Batch 3: the largest layer's 3·P rows split into blocks of 2 (the last one partial).
    """
    if routing_order == "concurrent" and capserve.get_config(model_name).routing_algorithm != "attention":
        pytest.skip("only attention routing has a concurrent schedule")
    if capserve.get_config(model_name).routing_algorithm == "em":
        pytest.skip("attention and dynamic routing share these vote blocks (EM's own: tests/routing/test_em.py)")
    image_size = 16 if model_name.startswith("cifar") else 20
    model = tiny_model(model_name, routing=routing_order, image_size=image_size).double()
    x = tiny_input(model, 3).double()
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 2 * largest_row_bytes(model))
    for T in range(1, 6):
        with monkeypatch.context() as m:
            m.setattr(attention, "routing_step", reference_step)
            m.setattr(blocks, "VOTE_BLOCK_BYTES", 2**62)  # dynamic routing: all rows in one block
            expected = model.trace(x, iterations=T)
        with torch.no_grad():
            logits = model(x, iterations=T)
        got = model.trace(x, iterations=T)
        torch.testing.assert_close(logits, expected.logits, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-10)
        for coef, expected_coef in zip(got.coefficients, expected.coefficients, strict=True):
            torch.testing.assert_close(coef, expected_coef, rtol=0, atol=1e-10)
        torch.testing.assert_close(got.part_whole(), expected.part_whole(), rtol=0, atol=1e-10)


def test_full_size_model_blocked_equals_the_reference(monkeypatch):
    """cifar10-resnet at its real size (288 children × 32 parents per position), batch 1, T = 3 and 5."""
    torch.manual_seed(0)
    model = capserve.create_model("cifar10-resnet").double().eval()
    x = torch.randn(1, 3, 32, 32, dtype=torch.float64)
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 3 * largest_row_bytes(model))  # 49 and 25 rows: no division
    for T in (3, 5):
        with monkeypatch.context() as m:
            m.setattr(attention, "routing_step", reference_step)
            m.setattr(blocks, "VOTE_BLOCK_BYTES", 2**62)  # dynamic routing: all rows in one block
            expected = model.trace(x, iterations=T)
        got = model.trace(x, iterations=T)
        torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-10)
        for coef, expected_coef in zip(got.coefficients, expected.coefficients, strict=True):
            torch.testing.assert_close(coef, expected_coef, rtol=0, atol=1e-10)
