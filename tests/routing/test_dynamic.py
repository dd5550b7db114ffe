"""Dynamic routing (Sabour et al., 2017) as ``routing_algorithm="dynamic"``: the paper's equations checked against
numbers computed by hand and by a NumPy transcription of its procedure, the properties the paper states (coupling
coefficients sum to 1 over parents, squashed lengths below 1), the margin loss, and the model through the public API
(T per call, save/load, training, serving)."""

from __future__ import annotations

import math

import httpx
import numpy as np
import pytest
import torch
from support.models import DEVICE, tiny_input, tiny_model
from support.server import eager_logits, export, random_png, softmax, start_server, stop, upload, wait_ready

import capserve
from capserve.data.images import preprocess
from capserve.routing import blocks
from capserve.routing.dynamic import dynamic_routing, margin_loss, squash
from capserve.routing.losses import training_loss

DYNAMIC = [n for n in capserve.list_models() if capserve.get_config(n).routing_algorithm == "dynamic"]


def paper_routing(u: np.ndarray, W: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Procedure 1 of the paper, one child and one parent at a time, for one position.

    u: (N, D_in) children; W: (N, J, D_out, D_in) with û_{j|i} = W_ij u_i. Returns v (J, D_out), c (N, J).
    """
    N, J = W.shape[:2]
    votes = np.array([[W[i, j] @ u[i] for j in range(J)] for i in range(N)])  # (N, J, D_out)
    b = np.zeros((N, J))
    for r in range(T):
        c = np.exp(b) / np.exp(b).sum(axis=1, keepdims=True)
        s = np.array([sum(c[i, j] * votes[i, j] for i in range(N)) for j in range(J)])
        v = np.array([np.dot(x, x) / (1 + np.dot(x, x)) * x / np.sqrt(np.dot(x, x)) for x in s])
        if r < T - 1:
            b = b + np.array([[votes[i, j] @ v[j] for j in range(J)] for i in range(N)])
    return v, c


def as_weight(W: np.ndarray) -> torch.Tensor:
    """(N, J, D_out, D_in) matrices acting on column vectors → capserve's (N, J, X, Y) row-vector layout."""
    return torch.from_numpy(np.ascontiguousarray(W.transpose(0, 1, 3, 2)))


def test_squash_by_hand():
    s = torch.tensor([[3.0, 4.0], [0.0, 0.0], [1e-4, 0.0]])
    v = squash(s)
    torch.testing.assert_close(v[0], torch.tensor([25 / 26 * 0.6, 25 / 26 * 0.8]))  # |s| = 5: length 25/26
    assert torch.equal(v[1], torch.zeros(2))  # no NaN at zero
    assert v[2, 0].item() == pytest.approx(1e-8, rel=1e-3)  # short vectors: length ≈ |s|²
    zero = torch.zeros(1, 3, requires_grad=True)
    squash(zero).sum().backward()
    assert torch.isfinite(zero.grad).all()


def test_two_children_two_parents_by_hand():
    """u₁ = (1, 0), u₂ = (0, 1); W₁₁ = W₂₁ = I, W₁₂ = −I, W₂₂ = 2I.

    Round 1 (c = ½): s₁ = (½, ½), |s₁|² = ½, v₁ = (1/3)(1, 1)/√2; s₂ = (−½, 1), |s₂|² = 5/4, v₂ = (5/9)(−½, 1)/√(5/4).
    Agreements: b₁₁ = <(1, 0), v₁> = √2/6, b₁₂ = <(−1, 0), v₂> = (5/9)(½)/√(5/4), b₂₁ = √2/6, b₂₂ = <(0, 2), v₂>
    = (10/9)/√(5/4). Round 2: c_i· = softmax(b_i·); s_j = Σ_i c_ij û_{j|i}; v_j = squash(s_j).
    """
    u = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]], dtype=torch.float64)  # (B=1, P=1, N=2, D=2)
    eye = np.eye(2)
    W = np.stack([np.stack([eye, -eye]), np.stack([eye, 2 * eye])])  # (N, J, D_out, D_in)
    v1, c1 = dynamic_routing(u, as_weight(W), 1, keep_coefficients=True)
    r = math.sqrt(5 / 4)
    expected = torch.tensor([[1 / 3 / math.sqrt(2)] * 2, [-5 / 18 / r, 5 / 9 / r]], dtype=torch.float64)
    torch.testing.assert_close(v1[0, 0], expected)
    torch.testing.assert_close(c1, torch.full((1, 1, 2, 2), 0.5, dtype=torch.float64))

    b = np.array([[math.sqrt(2) / 6, 5 / 18 / r], [math.sqrt(2) / 6, 10 / 9 / r]])  # (N, J)
    c = np.exp(b) / np.exp(b).sum(1, keepdims=True)
    s1 = c[0, 0] * np.array([1, 0]) + c[1, 0] * np.array([0, 1])  # s₁ = c₁₁ (1, 0) + c₂₁ (0, 1)
    s2 = c[0, 1] * np.array([-1, 0]) + c[1, 1] * np.array([0, 2])  # s₂ = c₁₂ (−1, 0) + c₂₂ (0, 2)
    s = np.stack([s1, s2])
    n2 = (s**2).sum(1, keepdims=True)
    v2, c2 = dynamic_routing(u, as_weight(W), 2, keep_coefficients=True)
    torch.testing.assert_close(v2[0, 0], torch.from_numpy(n2 / (1 + n2) * s / np.sqrt(n2)))
    torch.testing.assert_close(c2[0, 0], torch.from_numpy(c))
    assert c[1, 1] > 0.6  # the child that agrees with parent 2 (vote (0, 2)) routes more of itself there


@pytest.mark.parametrize("T", [1, 2, 3, 5])
def test_routing_equals_the_papers_procedure(T):
    rng = np.random.default_rng(T)
    B, P, N, J, D_in, D_out = 2, 3, 7, 4, 5, 6
    u = rng.normal(size=(B, P, N, D_in))
    W = rng.normal(size=(N, J, D_out, D_in)) * 0.5
    v, c = dynamic_routing(torch.from_numpy(u), as_weight(W), T, keep_coefficients=True)
    assert v.shape == (B, P, J, D_out) and c.shape == (B, P, N, J)
    for b in range(B):
        for p in range(P):
            v_ref, c_ref = paper_routing(u[b, p], W, T)
            np.testing.assert_allclose(v[b, p].numpy(), v_ref, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(c[b, p].numpy(), c_ref, rtol=1e-10, atol=1e-12)


def test_blocks_of_rows_give_the_same_numbers(monkeypatch):
    """The votes are made a block of (batch × position) rows at a time; one row per block must change nothing."""
    g = torch.Generator().manual_seed(0)
    u = squash(torch.randn(3, 5, 6, 4, generator=g, dtype=torch.float64))
    w = torch.randn(6, 3, 4, 4, generator=g, dtype=torch.float64)
    whole = dynamic_routing(u, w, 3, keep_coefficients=True)
    monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", 1)
    with torch.no_grad():  # the reused vote buffer
        blocked = dynamic_routing(u, w, 3, keep_coefficients=True)
    for a, b in zip(whole, blocked, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-14)
    grads = []  # training: every block keeps its own votes for backward
    for block_bytes in (2**40, 1):
        monkeypatch.setattr(blocks, "VOTE_BLOCK_BYTES", block_bytes)
        u_, w_ = u.clone().requires_grad_(), w.clone().requires_grad_()
        parents, _ = dynamic_routing(u_, w_, 3)
        (parents * torch.linspace(-1, 1, parents.shape[-1], dtype=torch.float64)).sum().backward()
        grads.append((u_.grad, w_.grad))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("name", DYNAMIC)
def test_coupling_sums_to_one_over_parents_and_every_capsule_is_shorter_than_one(name):
    model = tiny_model(name)
    trace = model.trace(tiny_input(model, 2), iterations=3)
    for coefficients in trace.coefficients:  # (B, P, N, J)
        torch.testing.assert_close(coefficients.sum(-1), torch.ones(coefficients.shape[:-1], device=DEVICE))
        assert (coefficients >= 0).all()
    assert any((c - 1 / c.shape[-1]).abs().max() > 1e-3 for c in trace.coefficients)  # routing did something
    for poses in trace.poses:  # primary capsules squashed too
        lengths = torch.linalg.vector_norm(poses, dim=-1)
        assert (lengths < 1).all() and lengths.max() > 0
    torch.testing.assert_close(torch.sigmoid(trace.logits), torch.linalg.vector_norm(trace.poses[-1], dim=-1))


def test_iterations_per_call_and_the_papers_default():
    model = tiny_model("multimnist-capsnet-small")
    assert model.config.iterations == 3 and model.config.routing == "sequential"
    x = tiny_input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, iterations=3))
        outputs = [model(x, iterations=T) for T in (1, 2, 3)]
    assert (outputs[0] - outputs[1]).abs().max() > 1e-4 and (outputs[1] - outputs[2]).abs().max() > 1e-4


def test_one_iteration_needs_no_votes_and_equals_uniform_coupling():
    """At T = 1 the layers take the shortcut of the attention layers (one product or conv2d, no vote tensor); it
    must equal full dynamic routing with c = 1/J."""
    model = tiny_model("cifar10-simple-dynamic").double()
    x = tiny_input(model, 2).double()
    with torch.no_grad():
        u = model.primary(model.backbone(x))
        for layer in model.capsules:
            fast, _ = layer(u, iterations=1)
            full, _ = dynamic_routing(layer.group_children(u), layer.weight, 1)
            torch.testing.assert_close(fast, layer._grid(full, u))
            u = fast


def test_class_logits_are_the_capsule_lengths_and_stay_finite():
    layer = capserve.create_model("multimnist-capsnet-small").capsules[-1]
    parents = squash(torch.tensor([[[3.0, 4.0], [0.3, 0.0], [0.0, 0.0], [1e5, 0.0]]]))  # (1, 4, 2)
    logits = layer.class_logits(parents)
    assert torch.isfinite(logits).all()
    lengths = torch.sigmoid(logits)[0]
    torch.testing.assert_close(lengths[:2], torch.tensor([25 / 26, 0.09 / 1.09]))
    assert lengths[2] < 1e-11 and lengths[3] > 0.999


def test_margin_loss_by_hand():
    lengths = torch.tensor([[0.95, 0.5, 0.05], [0.3, 0.2, 0.6]])
    logits = torch.log(lengths) - torch.log1p(-lengths)
    # image 0, class 0: 0 + ½·(0.5 − 0.1)² + 0 = 0.08; image 1, class 2: ½·0.2² + ½·0.1² + (0.9 − 0.6)² = 0.115
    loss = margin_loss(logits, torch.tensor([0, 2]), multi_label=False)
    assert loss.item() == pytest.approx((0.08 + 0.115) / 2, abs=1e-6)
    # multi-label, classes {0, 1} and {2}: (0 + 0.16 + 0) and 0.115 as before
    multi = margin_loss(logits, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]), multi_label=True)
    assert multi.item() == pytest.approx((0.16 + 0.115) / 2, abs=1e-6)
    assert training_loss(capserve.get_config("multimnist-capsnet")) is margin_loss


def test_configs_refuse_what_dynamic_routing_does_not_have():
    with pytest.raises(ValueError, match="pose='vector'"):
        capserve.create_model("cifar10-simple-dynamic", pose="matrix")
    with pytest.raises(ValueError, match="layer_norm=False"):
        capserve.create_model("cifar10-simple-dynamic", layer_norm=True)
    with pytest.raises(ValueError, match="sequential"):
        capserve.create_model("cifar10-simple-dynamic", routing="concurrent")
    for name in DYNAMIC:
        config = capserve.get_config(name)
        assert (config.pose, config.iterations, config.layer_norm) == ("vector", 3, False)


def test_save_load_round_trip(tmp_path):
    model = tiny_model("cifar100-simple-dynamic")
    model.save(tmp_path / "m")
    loaded = capserve.load(tmp_path / "m", DEVICE)
    assert loaded.config == model.config and loaded.classifier is None
    x = tiny_input(model, 3)
    with torch.no_grad():
        assert torch.equal(loaded(x, iterations=2), model(x, iterations=2))


def test_margin_loss_training_reaches_every_parameter_and_learns():
    torch.manual_seed(0)
    model = tiny_model("multimnist-capsnet-small").train()
    x = tiny_input(model, 8)
    targets = torch.zeros(8, 10, device=DEVICE)
    targets[torch.arange(8), torch.arange(8) % 3] = 1  # three classes to tell apart
    loss_fn = training_loss(model.config)
    loss = loss_fn(model(x), targets, True, 0.0)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    first = loss.item()
    for _ in range(15):
        opt.zero_grad()
        loss = loss_fn(model(x), targets, True, 0.0)
        loss.backward()
        opt.step()
    assert loss.item() < 0.8 * first  # measured: 0.805 → 0.544 in 12 steps


def test_served_over_http_like_any_model(tmp_path):
    """The service does not ask which routing a model uses: a dynamic-routing classifier (with its explanation graph)
    and a multi-label one, exported to ONNX at the config's T = 3, answer as eager PyTorch does."""
    pytest.importorskip("bentoml")
    pytest.importorskip("onnxruntime")

    single = tiny_model("cifar10-simple-dynamic")
    multi = tiny_model("multimnist-capsnet-small")
    env = dict(
        CAPSERVE_MODEL=str(export(single, tmp_path / "single", explain=True)),
        CAPSERVE_MULTILABEL_MODEL=str(export(multi, tmp_path / "multi", explain=False)),
    )
    proc, url, log = start_server(tmp_path, **env)
    try:
        wait_ready(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            data = random_png(0)
            r = client.post("/classify", **upload(data), data={"top_k": "10"})
            assert r.status_code == 200, r.text
            assert r.json()["iterations"] == 3
            got = np.zeros(10)
            for p in r.json()["predictions"]:
                got[p["index"]] = p["probability"]
            np.testing.assert_allclose(got, softmax(eager_logits(single, data)), atol=1e-5)

            digits = random_png(1, (36, 36))
            r = client.post("/multilabel", **upload(digits))
            assert r.status_code == 200, r.text
            x = torch.from_numpy(preprocess(digits, multi.config))
            with torch.no_grad():
                lengths = torch.linalg.vector_norm(multi.trace(x).poses[-1], dim=-1)[0].numpy()  # |v_k|
            np.testing.assert_allclose([r.json()["probabilities"][str(d)] for d in range(10)], lengths, atol=1e-5)

            r = client.post("/explain", **upload(data), data={"capsules": "3"})
            assert r.status_code == 200, r.text
            x = torch.from_numpy(preprocess(data, single.config))
            parse = single.trace(x).part_whole()[0, r.json()["prediction"]["index"]].numpy()  # (H, W, I)
            for capsule in r.json()["capsules"]:
                expected = parse[capsule["row"], capsule["col"], capsule["type"]]
                assert capsule["routing_probability"] == pytest.approx(expected, abs=1e-5)
    finally:
        stop(proc)
