"""EM routing (Hinton et al. 2018): the maths against a NumPy transcription of the paper's equations, the layers'
properties (assignments are distributions over parents, activations in (0, 1)), the spread loss against hand-computed
values, and the EM models through the public API (T per call, save/load, gradients, blocks, config checks)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from support.models import DEVICE, tiny_input, tiny_model

import capserve
from capserve.routing import em
from capserve.routing.em import (
    EM_SHARE_EPS,
    EM_VARIANCE_FLOOR,
    coordinate_offsets,
    em_routing,
    em_votes,
    spread_loss,
    spread_margin,
)
from capserve.routing.losses import training_loss

EM_MODELS = [name for name in capserve.list_models() if capserve.get_config(name).routing_algorithm == "em"]


# ------------------------------------------------------------------------------------------ NumPy reference


def reference_em(votes: np.ndarray, activations: np.ndarray, beta_v: np.ndarray, beta_a: np.ndarray, T: int):
    """The section's equations in float64 with explicit loops: votes (N, J, D), activations (N,), betas (J,).

    Returns μ (J, D), activation logits (J,), R (N, J) of the last M-step.
    """
    N, J, D = votes.shape
    R = np.full((N, J), 1.0 / J)
    for t in range(1, T + 1):
        lam = 0.01 * (1 - 0.95**t)  # Hinton's schedule
        mu, var, cost = np.zeros((J, D)), np.zeros((J, D)), np.zeros(J)
        for j in range(J):
            r = R[:, j] * activations  # R'_ij
            S = r.sum()
            for h in range(D):
                mu[j, h] = (r * votes[:, j, h]).sum() / (S + EM_SHARE_EPS)
                var[j, h] = (r * (votes[:, j, h] - mu[j, h]) ** 2).sum() / (S + EM_SHARE_EPS)
            var[j] += EM_VARIANCE_FLOOR
            cost[j] = sum(beta_v[j] + math.log(math.sqrt(var[j, h])) for h in range(D)) * S * 100 / (N / J)
        logits = lam * (beta_a - cost)
        a = 1 / (1 + np.exp(-logits))
        if t < T:
            for i in range(N):
                p = np.ones(J)  # p_ij = Π_h N(V_ijh; μ_jh, σ²_jh)
                for j in range(J):
                    for h in range(D):
                        gauss = math.exp(-((votes[i, j, h] - mu[j, h]) ** 2) / (2 * var[j, h]))
                        p[j] *= gauss / math.sqrt(2 * math.pi * var[j, h])
                R[i] = a * p / (a * p).sum()
    return mu, logits, R


def small_example(seed: int = 0, N: int = 5, J: int = 3, D: int = 4):
    """Votes clustered so that the likelihoods neither underflow nor tie (the reference works outside log space)."""
    g = np.random.default_rng(seed)
    centres = g.normal(size=(J, D))
    votes = centres[None] + 0.6 * g.normal(size=(N, J, D))  # (N, J, D)
    activations = g.uniform(0.2, 0.95, size=N)
    beta_v, beta_a = g.normal(scale=0.3, size=J), g.normal(scale=0.3, size=J)
    return votes, activations, beta_v, beta_a


@pytest.mark.parametrize("T", [1, 2, 3])
def test_em_routing_matches_the_papers_equations(T):
    votes, activations, beta_v, beta_a = small_example()
    mu, logits, R = reference_em(votes, activations, beta_v, beta_a, T)
    t = torch.from_numpy
    got_mu, got_logits, got_R = em_routing(
        t(votes).permute(1, 0, 2).unsqueeze(0), t(activations).unsqueeze(0), t(beta_v), t(beta_a), T
    )
    np.testing.assert_allclose(got_mu[0].numpy(), mu, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got_logits[0].numpy(), logits, rtol=0, atol=1e-10)
    np.testing.assert_allclose(got_R[0].T.numpy(), R, rtol=0, atol=1e-12)
    if T > 1:  # the E-step moved the assignments away from uniform
        assert np.abs(R - 1 / 3).max() > 0.05


def test_em_routing_by_hand_two_children_agreeing():
    """Two fully active children, one parent, 1-value votes 1 and 3: μ = 2, σ² = 1 + ε; with β_v = 0 the cost is
    ½ log σ² · S · 100 J / N = 50 log(1 + ε), and the activation logit after T = 2 is λ_2 (β_a − cost)."""
    f64 = dict(dtype=torch.float64)
    votes = torch.tensor([[[[1.0], [3.0]]]], **f64)  # (n=1, J=1, N=2, D=1)
    mu, logits, R = em_routing(votes, torch.ones(1, 2, **f64), torch.zeros(1, **f64), torch.full((1,), 0.5, **f64), 2)
    assert mu.item() == pytest.approx(2.0)
    cost = 0.5 * math.log(1 + EM_VARIANCE_FLOOR) * 2 * 100 * 1 / 2
    assert logits.item() == pytest.approx(0.01 * (1 - 0.95**2) * (0.5 - cost), rel=1e-6)  # 1e-6: EM_SHARE_EPS
    assert torch.equal(R, torch.ones(1, 1, 2, dtype=torch.float64))


def test_votes_are_pose_matrix_products_with_shared_transforms():
    g = torch.Generator().manual_seed(1)
    n, M, G, J, X = 2, 3, 4, 5, 4
    poses = torch.randn(n, M * G, X * X, generator=g, dtype=torch.float64)
    weight = torch.randn(G, J, X, X, generator=g, dtype=torch.float64)
    votes = em_votes(poses, weight)  # (n, J, N, D)
    assert votes.shape == (n, J, M * G, X * X)
    P, W = poses.numpy().reshape(n, M, G, X, X), weight.numpy()
    for b, m, i, j in [(0, 0, 0, 0), (1, 2, 3, 4), (0, 1, 2, 3)]:
        expected = P[b, m, i] @ W[i, j]  # child (m, i) uses its type's transform whatever its position m
        np.testing.assert_allclose(votes[b, j, m * G + i].numpy(), expected.reshape(-1), rtol=1e-12)


def test_coordinate_addition_adds_scaled_centres_to_the_right_hand_column():
    offsets = coordinate_offsets(side=2, types=3, pose_dim=16).view(2, 2, 3, 4, 4)  # (H, W, I, X, X)
    # the capsule at row 1, column 0 (any type): centre (1.5 / 2, 0.5 / 2)
    assert offsets[1, 0, 2, 0, 3].item() == 0.75 and offsets[1, 0, 2, 1, 3].item() == 0.25
    assert offsets[0, 1, 0, 0, 3].item() == 0.25 and offsets[0, 1, 0, 1, 3].item() == 0.75
    offsets[..., 0:2, 3] = 0
    assert not offsets.any()  # nothing else is touched


# ------------------------------------------------------------------------------------------ model properties


@pytest.mark.parametrize("name", EM_MODELS)
def test_assignments_are_distributions_and_activations_lie_in_zero_one(name):
    model = tiny_model(name)
    x = tiny_input(model, 3)
    for T in (1, 2, 3):
        trace = model.trace(x, iterations=T)
        for coef in trace.coefficients:  # (B, P, N, J)
            assert (coef >= 0).all()
            torch.testing.assert_close(coef.sum(-1), torch.ones(coef.shape[:-1], device=DEVICE))
        for capsules in trace.poses:  # (…, D + 1): the last value is the activation's logit
            assert capsules.shape[-1] == model.config.pose_dim + 1
            # the activation travels as its logit, so a finite logit is an activation strictly inside (0, 1), even
            # where a sigmoid would round it to 0 or 1: float64's beyond ±37, which a parent that only one child
            # reaches can pass (its σ² sits at the floor: Gritzman's pitfall 1; cifar100-*-em routes 20 fc capsules
            # to 100 classes)
            assert torch.isfinite(capsules).all()
        torch.testing.assert_close(trace.logits, trace.poses[-1][..., -1])  # class logits = activation logits


def test_iterations_chosen_per_call_change_the_result():
    model = tiny_model("multimnist-em-small")
    x = tiny_input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, iterations=model.config.iterations))
        results = [model(x, iterations=T) for T in (1, 2, 3)]
    assert (results[0] - results[1]).abs().max() > 1e-3 and (results[1] - results[2]).abs().max() > 1e-3


def test_blocks_of_rows_give_the_same_result_as_one_block(monkeypatch):
    model = tiny_model("cifar10-simple-em").double()
    x = tiny_input(model, 3).double()
    expected = model.trace(x, iterations=3)
    monkeypatch.setattr(em, "EM_BLOCK_BYTES", 1)  # one row per block
    got = model.trace(x, iterations=3)
    torch.testing.assert_close(got.logits, expected.logits, rtol=0, atol=1e-10)
    for coef, expected_coef in zip(got.coefficients, expected.coefficients, strict=True):
        torch.testing.assert_close(coef, expected_coef, rtol=0, atol=1e-10)


def test_save_load_round_trip_keeps_the_em_model(tmp_path):
    model = tiny_model("cifar100-simple-em")
    model.save(tmp_path / "m")
    loaded = capserve.load(tmp_path / "m").to(DEVICE)
    assert loaded.config.routing_algorithm == "em"
    x = tiny_input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x, iterations=3), model(x, iterations=3), rtol=0, atol=0)


def test_gradients_reach_every_parameter():
    model = tiny_model("cifar100-simple-em").train()
    x = tiny_input(model, 4)
    targets = torch.tensor([0, 3, 7, 1], device=DEVICE)
    spread_loss(model(x, iterations=2), targets, multi_label=False, progress=0.5).backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


def test_parameters_are_transforms_and_two_betas_per_parent_type():
    model = capserve.create_model("cifar10-simple-em")
    conv, _, classes = model.capsules
    assert conv.weight.shape == (3 * 3 * 32, 32, 4, 4) and conv.beta_v.shape == conv.beta_a.shape == (32,)
    assert classes.weight.shape == (32, 10, 4, 4)  # class capsules: transforms shared over the 5×5 positions
    assert "capsules.2.offsets" not in model.state_dict()  # coordinate offsets are derived, not saved


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (dict(pose="vector", pose_dim=16), "matrix poses"),
        (dict(layer_norm=True), "layer_norm=False"),
        (dict(activations=True), "activations=False"),
        (dict(routing="concurrent"), "sequential"),
    ],
)
def test_em_configs_refuse_what_em_cannot_do(overrides, match):
    with pytest.raises(ValueError, match=match):
        capserve.get_config("cifar10-simple-em", **overrides)


# ------------------------------------------------------------------------------------------ spread loss


def logits_of(activations: list[list[float]]) -> torch.Tensor:
    a = torch.tensor(activations, dtype=torch.float64)
    return torch.log(a) - torch.log1p(-a)


def test_spread_margin_rises_linearly_from_0_2_to_0_9():
    assert [spread_margin(p) for p in (0.0, 0.5, 1.0)] == pytest.approx([0.2, 0.55, 0.9])
    assert spread_margin(-1.0) == pytest.approx(0.2) and spread_margin(2.0) == pytest.approx(0.9)


def test_spread_loss_single_label_by_hand():
    logits = logits_of([[0.6, 0.5, 0.2], [0.9, 0.1, 0.1]])
    targets = torch.tensor([0, 0])
    # m = 0.9: image 1: (0.9 − 0.1)² + (0.9 − 0.4)² = 0.89; image 2: 2·(0.9 − 0.8)² = 0.02
    assert spread_loss(logits, targets, False, 1.0).item() == pytest.approx((0.89 + 0.02) / 2)
    # m = 0.2: image 1: (0.2 − 0.1)² = 0.01, the 0.4 gap is beyond the margin; image 2: 0
    assert spread_loss(logits, targets, False, 0.0).item() == pytest.approx(0.01 / 2)
    assert training_loss(capserve.get_config("cifar10-simple-em")) is spread_loss


def test_spread_loss_multi_label_by_hand():
    logits = logits_of([[0.6, 0.4, 0.3]])
    targets = torch.tensor([[1.0, 1.0, 0.0]])
    # m = 0.9; pairs (present, absent): (0, 2) 0.6² + (1, 2) 0.8²; threshold 0.5 at m/2 = 0.45:
    # class 0 (0.45 − 0.1)², class 1 (0.45 + 0.1)², class 2 absent (0.45 − 0.2)²
    expected = 0.36 + 0.64 + 0.35**2 + 0.55**2 + 0.25**2
    assert spread_loss(logits, targets, True, 1.0).item() == pytest.approx(expected)


def test_spread_loss_is_zero_once_the_margin_is_met_and_trains_the_activations():
    logits = logits_of([[0.99, 0.02, 0.01]]).requires_grad_()
    assert spread_loss(logits, torch.tensor([0]), False, 1.0).item() == 0
    assert spread_loss(logits, torch.tensor([[1.0, 0.0, 0.0]]), True, 1.0).item() == 0
    loss = spread_loss(logits, torch.tensor([1]), False, 1.0)  # the wrong class wins: push 1 up, 0 down
    loss.backward()
    assert loss.item() > 0 and logits.grad[0, 1] < 0 < logits.grad[0, 0]


def test_torch_runtime_serves_an_em_model_and_explains_it(tmp_path):
    """What the service calls: ``load_runtime`` predicts the eager logits and explains with the routing trace."""
    from capserve.runtime import load_runtime

    model = tiny_model("multimnist-em-small")
    model.save(tmp_path / "em")
    runtime = load_runtime(tmp_path / "em", backend="torch", iterations=3)
    x = tiny_input(model, 2).cpu()
    trace = model.cpu().trace(x, iterations=3)
    np.testing.assert_allclose(runtime.predict(x.numpy()), trace.logits.numpy(), rtol=0, atol=1e-5)
    explanation = runtime.explain(x.numpy())
    np.testing.assert_allclose(explanation.part_whole, trace.part_whole().numpy(), rtol=0, atol=1e-6)
