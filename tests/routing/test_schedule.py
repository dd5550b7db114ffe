"""The routing schedules end to end, against a reference written here from the paper and the documented layouts.

``reference_step`` is one routing iteration of one capsule layer from its weights alone, in float64: children
grouped by loops written here, the paper's equations as the package writes them once
(``capserve.routing.attention.reference_step``: votes, agreement, softmax over parents, weighted sum; tested against
numbers worked by hand in test_attention.py), then LayerNorm with the layer's own scale and shift. None of the
layers' fast paths take part. On top of it, the two schedules are plain loops:

- sequential: all T iterations of layer 1, then all T of layer 2, ...;
- concurrent: iteration t updates every layer from iteration t-1's poses; every update is computed, so the
  test knows the whole history and can check which iteration the model's trace reports.

What these tests catch (see tests/README.md): a schedule that runs one iteration too few or too many, a
routed step without its LayerNorm, coefficients (and the ``part_whole`` parse ``/explain`` serves) taken from
an update that never reaches the logits, and ``part_whole`` laid out in another order than (H, W, I).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support.models import tiny_input, tiny_model

from capserve.model.capsnet import part_whole
from capserve.routing import attention

# cifar100-simple: conv, conv, fc, class (L = 4, matrix poses, the fc chain in part_whole);
# multimnist-vector: vector poses; cifar10-simple: conv, conv, class (the class layer reads a grid).
CONFIGS = ("cifar100-simple", "multimnist-vector", "cifar10-simple")


def reference_children(layer, u: torch.Tensor) -> torch.Tensor:
    """(B, P, N, D): a conv layer's k×k windows in (kh, kw, I) order, or every fc child in (H, W, I) order."""
    B, D = u.shape[0], u.shape[-1]
    if layer.kind == "fc":
        return u.reshape(B, 1, -1, D)
    k, s = layer.kernel_size, layer.stride
    side = (u.shape[1] - k) // s + 1
    types = range(u.shape[3])
    windows = [
        torch.stack([u[:, h * s + dy, w * s + dx, i] for dy in range(k) for dx in range(k) for i in types], dim=1)
        for h in range(side)
        for w in range(side)
    ]  # P entries of (B, N, D), positions row-major
    return torch.stack(windows, dim=1)


def reference_step(layer, u: torch.Tensor, parents: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One iteration: p_j = LayerNorm(Σ_i r_ij v_ij), r_ij = softmax_j(<p_j, v_ij> / √D), r_ij = 1/J from zero."""
    children = reference_children(layer, u)  # (B, P, N, D)
    B, P, N, _ = children.shape
    weight = layer.weight  # (N, J, X, Y): a pose is r rows of X values, each row mapped to Y values
    J = weight.shape[1]

    def norm(s: torch.Tensor) -> torch.Tensor:
        if not isinstance(layer.norm, torch.nn.LayerNorm):
            return s
        return F.layer_norm(s, s.shape[-1:], layer.norm.weight, layer.norm.bias, layer.norm.eps)

    if parents is None:
        coefficients = torch.full((B, P, N, J), 1.0 / J, dtype=u.dtype)
        s = attention.reference_uniform_step(children, weight, norm)  # (B, P, J, D_out)
    else:
        parents = parents.reshape(B, P, J, -1)  # (B, P, J, D_out)
        s, coefficients = attention.reference_step(children, weight, parents, norm, keep_coefficients=True)
    if layer.kind == "fc":
        return s.reshape(B, J, -1), coefficients
    side = round(P**0.5)
    return s.reshape(B, side, side, J, -1), coefficients


def sequential_reference(model, x: torch.Tensor, T: int):
    poses, coefficients = [model.primary(model.backbone(x))], []
    for layer in model.capsules:
        parents = None
        for _ in range(T):
            parents, c = reference_step(layer, poses[-1], parents)
        poses.append(parents)
        coefficients.append(c)
    return poses, coefficients


def concurrent_history(model, x: torch.Tensor, T: int) -> list[tuple[list, list]]:
    """[(poses, coefficients) after iteration t for t = 1..T], every layer updated at every iteration."""
    poses, coefficients = [model.primary(model.backbone(x))], []
    for layer in model.capsules:
        parents, c = reference_step(layer, poses[-1], None)
        poses.append(parents)
        coefficients.append(c)
    history = [(poses, coefficients)]
    for _ in range(2, T + 1):
        previous = history[-1][0]
        steps = [reference_step(layer, previous[i], previous[i + 1]) for i, layer in enumerate(model.capsules)]
        history.append(([previous[0], *(p for p, _ in steps)], [c for _, c in steps]))
    return history


def logits_of(model, poses) -> torch.Tensor:
    return model.classifier(poses[-1]).squeeze(-1)


def double_model(name: str, routing: str):
    model = tiny_model(name, routing=routing).double()
    with torch.no_grad():  # LayerNorm scale and shift away from (1, 0), so that dropping or misplacing it shows
        for layer in model.capsules:
            layer.norm.weight.uniform_(0.5, 1.5)
            layer.norm.bias.uniform_(-0.3, 0.3)
    return model, tiny_input(model, 2, seed=5).double()


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("T", [1, 3])
def test_sequential_routing_runs_exactly_T_iterations_per_layer(name, T):
    model, x = double_model(name, "sequential")
    with torch.no_grad():
        poses, coefficients = sequential_reference(model, x, T)
        torch.testing.assert_close(model(x, iterations=T), logits_of(model, poses))
    trace = model.trace(x, iterations=T)
    for got, expected in zip(trace.coefficients, coefficients, strict=True):
        torch.testing.assert_close(got, expected)  # each layer's last (T-th) iteration


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_concurrent_routing_and_its_trace_equal_the_full_schedule(name, T):
    """Concurrent routing: the logits are the full schedule's (skipping the updates nothing reads changes none);
    layer i (0-based, of L) last reaches the logits at iteration T - (L-1-i), and what ``trace()`` reports for it
    (poses, coefficients, and so ``part_whole``) must come from that iteration, not from a later dead update."""
    model, x = double_model(name, "concurrent")
    L = len(model.capsules)
    with torch.no_grad():
        history = concurrent_history(model, x, T)
        torch.testing.assert_close(model(x, iterations=T), logits_of(model, history[-1][0]))
    trace = model.trace(x, iterations=T)
    torch.testing.assert_close(trace.logits, logits_of(model, history[-1][0]))
    dead_updates_differ = False
    for i in range(L):
        t = max(1, T - (L - 1 - i))  # the iteration whose layer-i update reaches the output
        poses, coefficients = history[t - 1]
        torch.testing.assert_close(trace.poses[i + 1], poses[i + 1], msg=f"layer {i} poses, T={T}")
        torch.testing.assert_close(trace.coefficients[i], coefficients[i], msg=f"layer {i} coefficients, T={T}")
        dead_updates_differ |= t < T and not torch.allclose(history[-1][1][i], coefficients[i], atol=1e-6)
    assert dead_updates_differ or T == 1, "the test should see dead updates that differ from the reported ones"
    torch.testing.assert_close(trace.part_whole(), expected_part_whole(trace.poses, history, T))


def expected_part_whole(poses, history, T: int) -> torch.Tensor:
    """(B, C, H, W, I) by explicit loops: each capsule of the last grid, its routing chained through fc layers to
    the classes, every coefficient from the iteration that reaches the output; child n ↔ (h, w, i) in (H, W, I)."""
    L = len(history[0][1])
    grid = max(i for i, p in enumerate(poses) if p.ndim == 5)  # the last grid level; layers grid..L-1 read fc capsules
    B, H, W, I = poses[grid].shape[:4]

    def coefficients(layer: int) -> torch.Tensor:  # (B, N, J) of that layer's one position
        return history[max(1, T - (L - 1 - layer)) - 1][1][layer][:, 0]

    flow = coefficients(grid)  # (B, H·W·I, J)
    for layer in range(grid + 1, L):
        flow = flow @ coefficients(layer)  # (B, H·W·I, J') routed onwards
    C = flow.shape[-1]
    out = torch.empty(B, C, H, W, I, dtype=flow.dtype)
    for h in range(H):
        for w in range(W):
            for i in range(I):
                out[:, :, h, w, i] = flow[:, (h * W + w) * I + i]
    return out


def test_part_whole_layout_is_h_w_i_from_a_hand_built_trace():
    """A class layer reading a 2×3 grid of 4 types: coefficient of child (h, w, i) to class c = a value that
    spells out (h, w, i, c), so any other layout (I, H, W), (W, H, I), ... puts a wrong number somewhere."""
    B, H, W, I, C, D = 1, 2, 3, 4, 5, 4
    grid = torch.zeros(B, H, W, I, D)
    coefficients = torch.zeros(B, 1, H * W * I, C)
    for h in range(H):
        for w in range(W):
            for i in range(I):
                for c in range(C):
                    coefficients[0, 0, (h * W + w) * I + i, c] = 1000 * h + 100 * w + 10 * i + c
    poses = (torch.zeros(B, 5, 5, 3, D), grid, torch.zeros(B, C, D))  # primary grid, the last grid, classes
    parse = part_whole(poses, (torch.zeros(B, 4, 9 * 3, I), coefficients))
    assert parse.shape == (B, C, H, W, I)
    for h, w, i, c in [(0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (0, 0, 1, 0), (1, 2, 3, 4), (0, 2, 1, 3)]:
        assert parse[0, c, h, w, i].item() == 1000 * h + 100 * w + 10 * i + c


def test_part_whole_chains_through_fc_layers_from_a_hand_built_trace():
    """A 1×2 grid of 2 types → 2 fc capsules → 3 classes: strength of a grid capsule for a class is
    Σ_j r(capsule → fc j) · r(fc j → class), written out by hand for every entry."""
    B, H, W, I, J, C, D = 1, 1, 2, 2, 2, 3, 4
    # rows: the grid capsules (h, w, i) = (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1); columns: fc capsules 0, 1
    to_fc = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5], [0.0, 1.0]])
    to_class = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.3, 0.6]])  # fc capsule → class
    poses = (torch.zeros(B, 3, 3, 2, D), torch.zeros(B, H, W, I, D), torch.zeros(B, J, D), torch.zeros(B, C, D))
    coefficients = (torch.zeros(B, 4, 18, I), to_fc[None, None], to_class[None, None])
    parse = part_whole(poses, coefficients)
    assert parse.shape == (B, C, H, W, I)
    expected = {  # (w, i): Σ_j to_fc[n, j] · to_class[j]
        (0, 0): [0.9 * 0.7 + 0.1 * 0.1, 0.9 * 0.2 + 0.1 * 0.3, 0.9 * 0.1 + 0.1 * 0.6],
        (0, 1): [0.2 * 0.7 + 0.8 * 0.1, 0.2 * 0.2 + 0.8 * 0.3, 0.2 * 0.1 + 0.8 * 0.6],
        (1, 0): [0.5 * 0.7 + 0.5 * 0.1, 0.5 * 0.2 + 0.5 * 0.3, 0.5 * 0.1 + 0.5 * 0.6],
        (1, 1): [0.1, 0.3, 0.6],
    }
    for (w, i), values in expected.items():
        torch.testing.assert_close(parse[0, :, 0, w, i], torch.tensor(values))


@pytest.mark.parametrize("name", CONFIGS)
def test_every_routed_update_is_layer_normalised(name):
    """With LayerNorm at its initial scale 1 and shift 0, every capsule pose any layer outputs (uniform or routed
    step, conv, fc or class layer) has mean 0 and variance at most 1 over its D values: LayerNorm is the last
    operation of each routing step (the paper's p_j = LayerNorm(Σ_i r_ij v_ij)). The reference tests above catch
    a missing LayerNorm too; this one says so in the failure."""
    model = tiny_model(name).double()
    x = tiny_input(model, 2).double()
    for T in (1, 2, 4):  # T = 4 >= L: every layer's reported pose comes from a routed (non-uniform) step
        for pose in model.trace(x, iterations=T).poses[1:]:  # the routed layers' outputs
            torch.testing.assert_close(pose.mean(-1), torch.zeros_like(pose[..., 0]), atol=1e-9, rtol=0)
            # biased variance v / (v + eps) <= 1 for a sum of variance v (LayerNorm's eps = 1e-5): near 1 for some
            # poses, far below it where a random tiny model's class poses are near-constant before their LayerNorm
            variance = pose.var(-1, unbiased=False)
            assert (variance <= 1).all() and variance.max() > 0.99
