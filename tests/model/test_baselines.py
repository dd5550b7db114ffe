"""Baseline CNNs (heads "avgpool" and "fc", the resnet18 backbone) and `capserve models`: parameter counts against
arithmetic done here, the capsule layers' neurons, no routing anywhere (iterations refused with a clear message),
save/load, ONNX parity and the export CLI, training and evaluate, and the service (in-process torch and real HTTP)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from support.data import cfg, write_easy_cifar10, write_mnist
from support.models import CNN_MODELS, tiny_input, tiny_model, tiny_overrides
from support.server import eager_logits, encode, error_of, random_png, softmax, start_server, stop, upload, wait_ready

import capserve
from capserve.cli import main, parameter_count
from capserve.runtime import load_runtime
from capserve.train.loop import train

# one of each structure: fc head (multi-label), avgpool head with an fc layer, the resnet18 backbone
REPRESENTATIVE = ["multimnist-cnn-fc-small", "cifar100-simple-cnn", "cifar10-resnet18"]


# ---------------------------------------------------------------------------------------- parameter counts


def conv(c_in: int, c_out: int, k: int, bias: bool = False) -> int:
    return c_in * c_out * k * k + (c_out if bias else 0)


def bn(c: int) -> int:
    return 2 * c


def linear(n_in: int, n_out: int) -> int:
    return n_in * n_out + n_out


def basic_block(c_in: int, c_out: int, stride: int) -> int:
    shortcut = conv(c_in, c_out, 1) + bn(c_out) if stride != 1 or c_in != c_out else 0
    return conv(c_in, c_out, 3) + bn(c_out) + conv(c_out, c_out, 3) + bn(c_out) + shortcut


def resnet18(classes: int) -> int:
    total, c_in = conv(3, 64, 3) + bn(64), 64
    for width, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        total += basic_block(c_in, width, stride) + basic_block(width, width, 1)
        c_in = width
    return total + linear(512, classes)


def multimnist_cnn(channels: int, pose_dim: int, head: str) -> int:
    """36×36 → backbone conv 3×3/2 → 18 → primary conv 3×3/2 pad 1 → 9 → conv 3×3/1 → 7, 16 types × pose_dim
    channels; then the read-out, the fc layer of 10 types × pose_dim units, and the classifier."""
    width = 16 * pose_dim
    convs = conv(3, channels, 3, bias=True) + conv(channels, width, 3) + bn(width) + conv(width, width, 3) + bn(width)
    readout = width * 7 * 7 if head == "fc" else width
    return convs + linear(readout, 10 * pose_dim) + linear(10 * pose_dim, 10)


def cifar10_simple_capsules() -> int:
    """32 → conv 3×3/2 → 16 (128 ch.) → primary 1×1: 32 types of 4×4 → conv caps 3×3/2 → 7 → conv caps 3×3/1 → 5."""
    backbone = conv(3, 128, 3, bias=True)
    primary = conv(128, 32 * 16, 1) + 2 * 16  # bias-free conv, one LayerNorm(16)
    conv_caps = 3 * 3 * 32 * 32 * 4 * 4 + 2 * 16  # (k·k·I) × J transforms of 4×4, LayerNorm
    class_caps = 5 * 5 * 32 * 10 * 4 * 4 + 2 * 16  # every child capsule × 10 classes
    return backbone + primary + 2 * conv_caps + class_caps + linear(16, 1)


def cifar10_simple_cnn() -> int:
    """cifar10-simple's sizes: 128 backbone channels, 32 types × 16 = 512 channels, average pooling."""
    convs = conv(3, 128, 3, bias=True) + conv(128, 512, 1) + bn(512) + 2 * (conv(512, 512, 3) + bn(512))
    return convs + linear(512, 10)


EXPECTED_PARAMETERS = {
    "cifar10-resnet18": resnet18(10),  # 11,173,962: the usual CIFAR ResNet-18 figure
    "cifar100-resnet18": resnet18(100),
    "multimnist-cnn-fc": multimnist_cnn(1024, 64, "fc"),  # 51.03 M; the paper's fc CNN has 42.49 M
    "multimnist-cnn-avgpool": multimnist_cnn(1024, 64, "avgpool"),
    "multimnist-cnn-fc-small": multimnist_cnn(256, 16, "fc"),
    "multimnist-cnn-avgpool-small": multimnist_cnn(256, 16, "avgpool"),
    "cifar10-simple-cnn": cifar10_simple_cnn(),
    "cifar10-simple": cifar10_simple_capsules(),
}


def test_parameter_counts_match_arithmetic_and_capserve_models_prints_them(capsys):
    assert EXPECTED_PARAMETERS["cifar10-resnet18"] == 11_173_962
    for name, expected in EXPECTED_PARAMETERS.items():
        assert parameter_count(capserve.get_config(name)) == expected, name
    assert main(["models"]) == 0
    lines = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:]}
    assert sorted(lines) == capserve.list_models()
    for name, expected in EXPECTED_PARAMETERS.items():
        assert lines[name].endswith(f"{expected:,}"), lines[name]
    assert "CNN, fc head" in lines["multimnist-cnn-fc"] and "resnet18" in lines["cifar10-resnet18"]
    assert "attention routing, matrix poses" in lines["cifar10-simple"]


def test_counts_are_those_of_a_built_model():
    model = tiny_model("multimnist-cnn-avgpool-small")
    assert parameter_count(model.config) == sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------------------------------- the models


@pytest.mark.parametrize("name", [n for n in CNN_MODELS if "resnet18" not in n])
def test_each_conv_layer_has_the_neurons_of_the_capsule_layer_it_replaces(name):
    cnn = tiny_model(name)
    capsules = tiny_model(name, head="capsules")
    x = tiny_input(cnn, 2)
    every = capsules.trace(x).poses  # primary, conv capsule layers (B, H, W, I, D); fc layers, classes (B, J, D)
    poses = [p for p in every if p.ndim == 5]
    features = cnn.backbone(x)
    for block, pose in zip(cnn.convs, poses, strict=True):
        features = block(features)  # (B, I·D, H, W)
        B, H, W, I, D = pose.shape
        assert features.shape == (B, I * D, H, W)
    fc_units = [m.out_features for m in cnn.head if isinstance(m, torch.nn.Linear)]
    assert fc_units == [p.shape[1] * p.shape[2] for p in every[len(poses) : -1]]
    assert cnn.classifier.out_features == cnn.config.num_classes


@pytest.mark.parametrize("name", CNN_MODELS)
def test_create_load_round_trip_and_batch_independence(name, tmp_path):
    model = tiny_model(name)
    assert isinstance(model, capserve.CNN) and not model.config.has_routing
    x = tiny_input(model, 5)
    with torch.no_grad():
        logits = model(x)
        assert logits.shape == (5, model.config.num_classes)
        torch.testing.assert_close(model(x[2:3]), logits[2:3], atol=1e-5, rtol=1e-5)
        loaded = capserve.load(model.save(tmp_path / name))
        assert isinstance(loaded, capserve.CNN) and loaded.config == model.config
        torch.testing.assert_close(loaded(x), logits, atol=0, rtol=0)


def test_routing_iterations_are_refused_with_a_clear_message(tmp_path):
    model = tiny_model("cifar10-resnet18")
    x = tiny_input(model, 2)
    for T in (1, 3):
        with pytest.raises(ValueError, match="without routing: routing iterations do not apply"):
            model(x, iterations=T)
    assert not hasattr(model, "trace")
    model.save(tmp_path / "m")
    runtime = load_runtime(tmp_path / "m")
    assert runtime.metadata.iterations is None
    with pytest.raises(NotImplementedError, match="without routing"):
        runtime.explain(x.numpy())
    with pytest.raises(ValueError, match="without routing"):
        load_runtime(tmp_path / "m", iterations=2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(head="maxpool"), "head must be one of"),
        (dict(backbone="resnet18"), "resnet18 backbone is a complete CNN"),
        (dict(backbone="resnet34", head="avgpool"), "backbone must be one of"),
    ],
)
def test_bad_configs_fail_at_construction(overrides, message):
    with pytest.raises(ValueError, match=message):
        capserve.create_model("cifar10-simple", **overrides)


def test_resnet18_with_capsule_layers_is_refused():
    with pytest.raises(ValueError, match="no capsule layers"):
        capserve.get_config("cifar10-simple", backbone="resnet18", head="avgpool")


# ---------------------------------------------------------------------------------------- export


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("cnn")
    return {name: tiny_model(name).save(folder / name) for name in REPRESENTATIVE}


@pytest.mark.parametrize("name", REPRESENTATIVE)
def test_onnx_export_matches_eager_and_verify_passes(checkpoints, name, tmp_path, capsys):
    pytest.importorskip("onnxruntime")
    onnx_path = tmp_path / "model.onnx"
    assert main(["export", "onnx", str(checkpoints[name]), "-o", str(onnx_path)]) == 0
    runtime = load_runtime(onnx_path)
    assert runtime.metadata.iterations is None and runtime.metadata.name == name
    model = capserve.load(checkpoints[name])
    for B in (1, 3, 17):
        x = tiny_input(model, B, seed=B)
        with torch.no_grad():
            expected = model(x).numpy()
        np.testing.assert_allclose(runtime.predict(x.numpy()), expected, atol=1e-4, rtol=0)
    capsys.readouterr()
    assert main(["verify", str(onnx_path), "--against", str(checkpoints[name]), "--batch-sizes", "1,5"]) == 0
    out = capsys.readouterr().out
    assert "no routing (CNN)" in out and "passed" in out


def test_export_options_that_need_routing_are_usage_errors(checkpoints, tmp_path, capsys):
    checkpoint = str(checkpoints["cifar10-resnet18"])
    assert main(["export", "onnx", checkpoint, "-o", str(tmp_path / "a.onnx"), "-T", "2"]) == 2
    assert "without routing: routing iterations do not apply" in capsys.readouterr().err
    assert main(["export", "onnx", checkpoint, "-o", str(tmp_path / "b.onnx"), "--explain"]) == 2
    assert "no part-whole parse to export; drop --explain" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.onnx"))


# ---------------------------------------------------------------------------------------- train and evaluate


def test_a_cnn_learns_and_evaluate_reports_it_without_iterations(tmp_path, capsys):
    cifar = write_easy_cifar10(tmp_path / "cifar")
    out = tmp_path / "run"
    overrides = {**tiny_overrides("cifar10-simple"), "head": "avgpool"}  # a CNN on the simple backbone: fast
    summary = train(
        cfg("cifar10-simple", cifar, out, overrides=overrides, epochs=6, batch_size=8, lr=0.1, schedule="cosine")
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["train_loss"] < 0.7 * rows[0]["train_loss"], rows
    assert summary["test_acc"] >= 0.5, summary  # colour-coded classes (chance 0.1)
    capsys.readouterr()
    assert main(["evaluate", str(out / "best"), "--data", str(cifar)]) == 0
    printed = capsys.readouterr().out
    assert "a CNN (avgpool head): no routing iterations" in printed
    assert re.search(r"^\s+- +\d+\.\d\d% +\d+\.\d\d%$", printed, re.M), printed  # one row, T shown as "-"
    assert main(["evaluate", str(out / "best"), "--data", str(cifar), "--iterations", "2"]) == 2
    assert "without routing: --iterations does not apply; drop it" in capsys.readouterr().err


def test_multilabel_cnn_trains_on_diverse_multimnist(tmp_path):
    mnist = write_mnist(tmp_path / "mnist", n_train=120, n_test=40)
    name = "multimnist-cnn-fc-small"
    summary = train(cfg(name, mnist, tmp_path / "mm", epochs=1, epoch_size=32, val_size=40, test=False))
    model = capserve.load(tmp_path / "mm" / "best")
    assert isinstance(model, capserve.CNN) and model.config.name == name and 0 <= summary["best_val_acc"] <= 1


def test_fine_tuning_a_cnn_restarts_its_classifier_when_the_labels_differ(tmp_path):
    from capserve.train.state import init_from

    tiny_model("cifar10-simple-cnn").save(tmp_path / "source")
    target = tiny_model("cifar10-simple-cnn", labels=tuple("abcdefghij"))  # same shapes, other labels
    info = init_from(target, tmp_path / "source")
    assert sorted(info["new"]) == ["classifier.bias", "classifier.weight"] and "convs.0.0.weight" in info["loaded"]


# ---------------------------------------------------------------------------------------- the service


def test_service_torch_backend_serves_a_cnn_and_explain_says_why_not(checkpoints, tmp_path):
    from capserve.errors import ConfigurationError
    from capserve.pipeline.errors import ErrorKind, RequestError
    from capserve.serving.app import Capsules
    from capserve.serving.settings import Settings

    single, multi = checkpoints["cifar10-resnet18"], checkpoints["multimnist-cnn-fc-small"]
    settings = Settings(
        model=str(single), multilabel_model=str(multi), backend="torch", precision="fp32", max_batch_size=1
    )
    capsules = Capsules(settings, error=lambda e: e)  # RequestErrors raised as they are
    assert capsules.explainer is None
    image = tmp_path / "image.png"
    image.write_bytes(random_png(0))
    body = asyncio.run(capsules.classify(image, 10))
    assert body.iterations is None and body.model == "cifar10-resnet18"
    got = np.zeros(10)
    for p in body.predictions:
        got[p.index] = p.probability
    np.testing.assert_allclose(got, softmax(eager_logits(capserve.load(single), random_png(0))), atol=1e-5)
    assert asyncio.run(capsules.multilabel(image, None)).iterations is None
    with pytest.raises(RequestError, match="is a CNN without routing") as error:
        asyncio.run(capsules.explain(image, 5))
    assert error.value.kind is ErrorKind.UNAVAILABLE  # a 501 over HTTP
    with pytest.raises(ConfigurationError, match="without routing: routing iterations do not apply"):
        Capsules(Settings(model=str(single), multilabel_model="none", backend="torch", iterations=3))


def test_service_over_http_serves_cnns(checkpoints, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("bentoml")
    from capserve.export.onnx import export_checkpoint

    for name in ("cifar10-resnet18", "multimnist-cnn-fc-small"):
        export_checkpoint(checkpoints[name], checkpoints[name] / "model.onnx")
    proc, url, log = start_server(
        tmp_path,
        CAPSERVE_MODEL=str(checkpoints["cifar10-resnet18"]),
        CAPSERVE_MULTILABEL_MODEL=str(checkpoints["multimnist-cnn-fc-small"]),
    )
    try:
        wait_ready(proc, url, log)
        with httpx.Client(base_url=url, timeout=60) as client:
            r = client.post("/classify", **upload(random_png(1)), data={"top_k": "3"})
            assert r.status_code == 200, r.text
            assert r.json()["iterations"] is None and len(r.json()["predictions"]) == 3
            expected = softmax(eager_logits(capserve.load(checkpoints["cifar10-resnet18"]), random_png(1)))
            assert r.json()["predictions"][0]["index"] == int(expected.argmax())
            digits = encode(np.random.default_rng(2).integers(0, 256, (36, 36), dtype=np.uint8))
            r = client.post("/multilabel", **upload(digits))
            assert r.status_code == 200, r.text
            assert r.json()["iterations"] is None and r.json()["model"] == "multimnist-cnn-fc-small"
            r = client.post("/explain", **upload(random_png(1)))
            assert r.status_code == 501 and "is a CNN without routing" in error_of(r)
            described = client.get("/model").json()
            assert described["single_label"]["iterations"] is None and described["explain"] is None
        assert "model-explain.onnx" not in log.read_text()  # no advice to export an explanation graph
    finally:
        stop(proc)
