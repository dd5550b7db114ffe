"""Every named model through the public API: shapes, batch independence, routing schedules, determinism."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.models import DEVICE, tiny_input, tiny_model

import capserve
from capserve.model.backbones import BasicBlock

# The authors' parameter counts (their code, these configurations).
PAPER_PARAMETERS = {
    "cifar10-resnet": 1_828_817,
    "cifar100-resnet": 2_799_629,
    "cifar10-simple": 492_177,
    "cifar100-simple": 1_462_989,
}


@pytest.mark.parametrize("name", sorted(PAPER_PARAMETERS))
def test_parameter_counts_equal_the_authors(name):
    model = capserve.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == PAPER_PARAMETERS[name]


def test_list_models_names_the_paper_configurations():
    names = capserve.list_models()
    for name in [*PAPER_PARAMETERS, "multimnist-matrix", "multimnist-vector"]:
        assert name in names


def test_the_vector_conv_model_is_the_own_data_default_with_vector_poses():
    """``--model cifar10-conv-vector`` is what docs/research/multi-label.md measured as ``--set pose='"vector"'`` on
    the default."""
    vector, matrix = capserve.get_config("cifar10-conv-vector"), capserve.get_config("cifar10-conv")
    assert vector.pose == "vector" and vector.pose_dim == matrix.pose_dim
    assert dataclasses.replace(vector, name=matrix.name, pose=matrix.pose) == matrix


def test_unknown_model_lists_the_valid_names():
    with pytest.raises(ValueError, match="cifar10-resnet"):
        capserve.create_model("cifar11-resnet")


@pytest.mark.parametrize(
    "name, overrides, message",
    [
        ("cifar10-resnet", {"pose_dim": 15}, "square"),
        ("cifar10-resnet", {"image_size": 8}, "feature map"),
        ("cifar10-resnet", {"stem_pool": 2}, "stem_pool is the conv backbone's"),
        ("cifar10-conv", {"stem_pool": 0}, "stem_pool is the conv backbone's, 1 or more"),
        ("cifar10-conv", {"init_classes": 0}, "init_classes is attention routing's"),
        ("cifar10-simple-dynamic", {"init_classes": 10}, "init_classes is attention routing's"),
        ("cifar10-simple", {"backbone_layers": 5}, "backbone_layers is the conv backbone's"),
        ("cifar10-conv", {"backbone_layers": 1}, "backbone_layers is the conv backbone's, 2 or more"),
        ("cifar10-resnet", {"backbone_blocks": 1}, "backbone_blocks is the conv backbone's"),
        ("cifar10-conv", {"backbone_blocks": -1}, "backbone_blocks is the conv backbone's, 0 or more"),
        ("cifar10-conv", {"class_norm": "batch"}, "class_norm must be"),
        ("cifar10-conv", {"class_norm": "joint", "layer_norm": False}, "class_norm='joint' is a LayerNorm"),
        ("cifar10-simple-dynamic", {"class_norm": "joint"}, "class_norm='joint' is a LayerNorm"),
    ],
)
def test_bad_override_is_a_clear_error(name, overrides, message):
    with pytest.raises(ValueError, match=message):
        capserve.create_model(name, **overrides)


@pytest.mark.parametrize("class_norm", ["per_class", "joint"])
def test_joint_class_norm_keeps_a_class_the_votes_pass_by_small(class_norm):
    """``class_norm="joint"`` (the own-images model's): the class capsules share one LayerNorm, so a class whose votes
    are faint keeps a faint pose beside the one they reach; LayerNorm'd alone (the paper's) each class capsule's pose
    comes out the same size, however little reached it."""
    model = tiny_model("cifar10-conv", class_norm=class_norm)
    with torch.no_grad():
        model.capsules[-1].weight[:, 1:].mul_(0.1)  # every class but the first hears a tenth as much
        classes = model.trace(tiny_input(model, 4)).poses[-1]  # (B, C, D)
    size = classes.norm(dim=-1)  # (B, C)
    faint = size[:, 1:].max(dim=1).values / size[:, 0]  # (B,)
    if class_norm == "joint":
        assert (faint < 0.3).all()
    else:
        assert (faint > 0.9).all()


def test_backbone_layers_deepens_the_conv_backbone_and_keeps_its_grid():
    """``backbone_layers=N`` (the own-images model's 5): N conv + BatchNorm + ReLU layers in front of the capsules, the
    later ones at the strided layer's grid and width, so the capsule layers see the same grid as with 3."""
    shallow, deep = (tiny_model("cifar10-conv", backbone_layers=n) for n in (3, 5))
    x = tiny_input(deep, 2)
    convs = [m for m in deep.backbone if isinstance(m, torch.nn.Conv2d)]
    assert len(convs) == 5 and len([m for m in shallow.backbone if isinstance(m, torch.nn.Conv2d)]) == 3
    assert all(c.stride == (1, 1) and c.in_channels == c.out_channels for c in convs[2:])
    assert deep.backbone(x).shape == shallow.backbone(x).shape
    assert deep(x).shape == (2, len(deep.config.labels))


def test_backbone_blocks_add_residual_blocks_at_the_conv_backbones_grid():
    """``backbone_blocks=N`` (the own-images model's 2): N ResNet basic blocks after the conv layers, at their width
    and grid; each adds its input back, so a block whose convs answer nothing passes its input on (after the ReLU it
    ends with)."""
    plain, residual = (tiny_model("cifar10-conv", backbone_layers=2, backbone_blocks=n) for n in (0, 2))
    x = tiny_input(residual, 2)
    blocks = [m for m in residual.backbone if isinstance(m, BasicBlock)]
    assert len(blocks) == 2 and not any(isinstance(m, BasicBlock) for m in plain.backbone)
    assert residual.backbone(x).shape == plain.backbone(x).shape
    assert residual(x).shape == (2, len(residual.config.labels))
    with torch.no_grad():
        blocks[-1].bn2.weight.zero_()
        blocks[-1].bn2.bias.zero_()
        assert torch.equal(residual.backbone(x), torch.relu(residual.backbone[:-1](x)))


def test_init_classes_starts_the_class_transforms_at_that_many_classes_scale():
    """``init_classes=N``: the class layer's transforms start at the authors' init for N classes (std ∝ √J), every
    other weight as without it."""
    torch.manual_seed(0)
    theirs = capserve.create_model("cifar100-simple")  # 100 classes
    torch.manual_seed(0)
    ours = capserve.create_model("cifar100-simple", init_classes=10)
    a, b = theirs.capsules[-1].weight, ours.capsules[-1].weight
    assert a.shape == b.shape and (b.std() / a.std()).item() == pytest.approx((10 / 100) ** 0.5, rel=1e-3)
    rest = [k for k in theirs.state_dict() if k != f"capsules.{len(theirs.capsules) - 1}.weight"]
    assert rest and all(torch.equal(theirs.state_dict()[k], ours.state_dict()[k]) for k in rest)


def test_full_size_models_run_at_batch_one():
    for name in ("cifar10-resnet", "cifar100-simple", "multimnist-matrix"):
        model = capserve.create_model(name).eval()
        c = model.config
        with torch.no_grad():
            logits = model(torch.randn(1, c.in_channels, c.image_size, c.image_size))
        assert logits.shape == (1, c.num_classes)
        assert torch.isfinite(logits).all()


def test_logits_shape_for_every_batch_size(model_name):
    model = tiny_model(model_name)
    for batch in (1, 2, 5):
        with torch.no_grad():
            assert model(tiny_input(model, batch)).shape == (batch, model.config.num_classes)


# EM's class logits are λ(β_a − cost) with the cost a sum of log σ², whose float32 rounding differs between batch sizes
# and grows with the logits (a parent that few children reach has a small σ²; the tiny models have small grids):
# measured 6.1e-5 on cifar100-resnet-em's tiny model at T = 2, logits up to 42. The bound is relative for EM; the
# float64 test below shows there is no real dependence.
FLOAT32_BATCH_TOLERANCE = {"em": 1e-5}


@pytest.mark.parametrize("iterations", [1, 2])
def test_a_sample_does_not_depend_on_its_batch(model_name, iterations):
    model = tiny_model(model_name)
    x = tiny_input(model, 8)
    with torch.no_grad():
        together = model(x, iterations=iterations)
        alone = torch.cat([model(x[i : i + 1], iterations=iterations) for i in range(8)])
    tolerance = FLOAT32_BATCH_TOLERANCE.get(model.config.routing_algorithm, 1e-5)
    if model.config.routing_algorithm == "em":
        tolerance *= max(1.0, together.abs().max().item())
    assert (together - alone).abs().max().item() <= tolerance


def test_batch_independence_is_exact_up_to_rounding(model_name):
    """In float32, rounding that differs between batch sizes (BLAS blocking) is amplified by each routing
    iteration (softmax over agreements, LayerNorm): ~3e-5 at T=3 on the CIFAR-100 models. In float64 the
    same comparison shows there is no dependence at all."""
    model = tiny_model(model_name).double()
    x = tiny_input(model, 8).double()
    with torch.no_grad():
        together = model(x, iterations=3)
        alone = torch.cat([model(x[i : i + 1], iterations=3) for i in range(8)])
    assert (together - alone).abs().max().item() <= 1e-10


def test_concurrent_and_sequential_agree_at_one_iteration_only(model_name):
    if capserve.get_config(model_name).routing_algorithm != "attention":
        pytest.skip("only attention routing has a concurrent schedule")
    concurrent = tiny_model(model_name, routing="concurrent")
    sequential = tiny_model(model_name, routing="sequential")
    sequential.load_state_dict(concurrent.state_dict())
    x = tiny_input(concurrent, 4)
    with torch.no_grad():
        torch.testing.assert_close(concurrent(x, iterations=1), sequential(x, iterations=1))
        assert (concurrent(x, iterations=3) - sequential(x, iterations=3)).abs().max() > 1e-4


def full_concurrent_reference(model, x, T):
    """Concurrent routing with every layer updated at every iteration (no update skipped)."""
    poses = [model.primary(model.backbone(x))]
    for layer in model.capsules:
        poses.append(layer(poses[-1])[0])
    for _ in range(T - 1):
        poses = [poses[0]] + [layer(poses[i], poses[i + 1])[0] for i, layer in enumerate(model.capsules)]
    return model.classifier(poses[-1]).squeeze(-1)


@pytest.mark.parametrize("iterations", [1, 2, 3, 4, 5])
def test_skipping_unread_updates_keeps_concurrent_results(iterations):
    model = tiny_model("cifar100-simple")  # three routed layers: the skip matters most
    x = tiny_input(model, 3)
    with torch.no_grad():
        torch.testing.assert_close(model(x, iterations=iterations), full_concurrent_reference(model, x, iterations))


def test_iterations_change_the_result_and_default_comes_from_config():
    model = tiny_model("cifar10-resnet", iterations=3)
    x = tiny_input(model, 2)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, iterations=3))
        assert (model(x, iterations=1) - model(x, iterations=2)).abs().max() > 1e-5


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_bad_iterations_are_rejected(bad):
    model = tiny_model("cifar10-simple")
    with pytest.raises(ValueError, match="iterations"):
        model(tiny_input(model, 1), iterations=bad)


def test_wrong_input_channels_are_rejected():
    model = tiny_model("cifar10-simple")
    with pytest.raises(ValueError, match=r"\(B, 3, H, W\)"):
        model(torch.randn(1, 1, 32, 32, device=DEVICE))


def test_deterministic_under_a_fixed_seed():
    a, b = tiny_model("cifar10-resnet"), tiny_model("cifar10-resnet")
    for pa, pb in zip(a.state_dict().values(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb)
    x = tiny_input(a, 3)
    with torch.no_grad():
        assert torch.equal(a(x, iterations=3), b(x, iterations=3))


def test_trace_matches_forward_and_coefficients_are_distributions(model_name):
    model = tiny_model(model_name)
    x = tiny_input(model, 2)
    for T in (1, 3):
        trace = model.trace(x, iterations=T)
        with torch.no_grad():
            torch.testing.assert_close(trace.logits, model(x, iterations=T))
        assert len(trace.poses) == len(model.capsules) + 1
        assert len(trace.coefficients) == len(model.capsules)
        for coef in trace.coefficients:
            torch.testing.assert_close(coef.sum(-1), torch.ones(coef.shape[:-1], device=DEVICE))
        if T == 1:
            assert torch.allclose(
                trace.coefficients[-1], torch.full_like(trace.coefficients[-1], 1 / model.config.num_classes)
            )


@pytest.mark.parametrize("overrides", [dict(layer_norm=False), dict(activations=True)])
def test_ablations_run_and_differ(overrides):
    base = tiny_model("cifar10-simple")
    ablated = tiny_model("cifar10-simple", **overrides)
    x = tiny_input(base, 2)
    with torch.no_grad():
        out = ablated(x, iterations=2)
        assert out.shape == (2, 10) and torch.isfinite(out).all()
        if "activations" in overrides:
            assert len(list(ablated.parameters())) > len(list(base.parameters()))
        assert (out - base(x, iterations=2)).abs().max() > 1e-4


def test_gradients_reach_every_parameter():
    model = tiny_model("cifar10-resnet", activations=True).train()
    model(tiny_input(model, 2), iterations=3).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_part_whole_parse_is_a_distribution_over_classes(model_name):
    model = tiny_model(model_name)
    trace = model.trace(tiny_input(model, 2), iterations=3)
    parse = trace.part_whole()
    grid = [p for p in trace.poses if p.ndim == 5][-1]
    B, H, W, I = grid.shape[:4]
    assert parse.shape == (B, model.config.num_classes, H, W, I)
    torch.testing.assert_close(parse.sum(1), torch.ones(B, H, W, I, device=DEVICE))
