"""The shipped models (``models/cifar10``, ``models/multimnist``: what ``make serve`` serves) on real images.

Their weights are the ones their ONNX files were exported from (the SHA-256 the metadata records), and they score
the committed real-image fixture (tests/support/real_images.py, with the measured figures) through eager torch and ONNX
Runtime. The real server scores the same images in tests/serving/test_service_paths.py.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest
from support import real_images

import capserve
from capserve.data.preprocess import normalize_images
from capserve.runtime import load_runtime

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"cifar10": ROOT / "models" / "cifar10", "multimnist": ROOT / "models" / "multimnist"}
# the INT8 graph each ships: the multi-label model's fails its gate with the class capsules' read-out in float
INT8 = {"cifar10": ("model-int8.onnx",), "multimnist": ()}

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shipped_weights_are_the_ones_the_onnx_files_were_exported_from(name):
    directory = MODELS[name]
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    config = capserve.read_config(directory)
    for artifact in ("model.onnx", "model-explain.onnx", *INT8[name]):
        meta = load_runtime(directory / artifact).metadata  # the INT8 graph re-checked on this CPU as it opens
        assert meta.weights_sha256 == digest, f"{artifact} was exported from other weights than model.safetensors"
        assert (meta.name, meta.labels, meta.iterations, meta.thresholds) == (
            config.name,
            tuple(config.labels),
            config.iterations,
            config.thresholds,
        )
        assert (meta.mean, meta.std, meta.image_size) == (tuple(config.mean), tuple(config.std), config.image_size)


def scores(name: str, runtime) -> float:
    meta = runtime.metadata
    if name == "cifar10":
        pixels, labels = real_images.cifar10()
        return float((runtime.predict(normalize_images(pixels, meta)).argmax(1) == labels).mean())
    pixels, targets = real_images.multimnist()
    probabilities = 1 / (1 + np.exp(-runtime.predict(normalize_images(pixels, meta))))
    return real_images.exact_match(probabilities, meta.thresholds, targets)


BOUNDS = {"cifar10": real_images.CIFAR10_MIN_TOP1, "multimnist": real_images.MULTIMNIST_MIN_EXACT_MATCH}


@pytest.mark.parametrize(
    ("name", "artifact"), [(name, a) for name in sorted(MODELS) for a in ("torch", "model.onnx", *INT8[name])]
)
def test_shipped_models_score_real_test_images(name, artifact):
    runtime = load_runtime(MODELS[name] if artifact == "torch" else MODELS[name] / artifact)
    assert scores(name, runtime) >= BOUNDS[name]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_shipped_explain_graph_agrees_with_the_plain_graph(name):
    """``/explain`` answers from model-explain.onnx: on real images its logits are the plain graph's."""
    pixels = (real_images.cifar10() if name == "cifar10" else real_images.multimnist())[0][:32]
    plain = load_runtime(MODELS[name] / "model.onnx")
    explain = load_runtime(MODELS[name] / "model-explain.onnx")
    x = normalize_images(pixels, plain.metadata)
    explanation = explain.explain(x)
    np.testing.assert_allclose(explanation.logits, plain.predict(x), atol=1e-4)
    parse = explanation.part_whole  # (B, C, H, W, I): each grid capsule's routing over the classes sums to 1
    np.testing.assert_allclose(parse.sum(axis=1), np.ones_like(parse[:, 0]), atol=1e-4)


@pytest.mark.parametrize("name", [name for name in sorted(MODELS) if INT8[name]])
def test_the_shipped_int8_graphs_passed_their_gates_without_being_forced(name):
    """The INT8 graph a server may choose at start-up (``capserve.serving.runtimes``) was written by the export's
    gates as they stand: agreement with fp32 and accuracy lost within their bounds, faster than fp32 where it was
    exported, nothing forced."""
    from capserve.export.int8 import read_summary

    summary = read_summary(MODELS[name] / "model-int8.onnx")
    assert not summary.forced and not summary.kept_slow
    assert summary.agreement >= summary.bound and summary.gate_images >= 1000
    assert summary.fp32_accuracy - summary.int8_accuracy <= summary.max_accuracy_loss + 1e-9
    assert summary.speedup >= summary.min_speedup
    assert summary.calibration.startswith("DATA/")  # no host path in a shipped file


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_shipped_models_carry_their_unfamiliarity_calibration(name):
    """Fitted on each model's training images with its threshold on the validation split (``capserve familiarity``):
    the real test images of its own kind are mostly familiar, and the INT8 graph says so as the fp32 one does."""
    from capserve.runtime.familiarity import FAMILIAR_SHARE, read_familiarity

    familiarity = read_familiarity(MODELS[name])
    assert familiarity is not None and familiarity.fitted["validation_images"] >= 1000
    pixels = (real_images.cifar10() if name == "cifar10" else real_images.multimnist())[0]
    graphs = [load_runtime(MODELS[name] / graph) for graph in ("model.onnx", *INT8[name])]
    x = normalize_images(pixels, graphs[0].metadata)
    a, *others = (familiarity.scores(runtime.infer(x)[1]) for runtime in graphs)
    assert np.mean(a <= 1) >= FAMILIAR_SHARE - 0.1  # test images, not the validation ones: a little less
    for b in others:  # the INT8 graph's capsules are read out in float: it says what fp32 says
        assert np.mean((a > 1) == (b > 1)) >= 0.95
