"""ONNX Runtime runs a large batch in chunks sized from a memory budget, with the results of one whole run.

An exported graph routes the whole batch at once (every vote of a routed layer in one tensor), so the runtime
wrapper bounds memory by splitting the batch; the chunk size comes from the architecture recorded in the file.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from support.models import tiny_input, tiny_model

import capserve
from capserve.configs import ModelConfig
from capserve.errors import InputError, RuntimeLoadError
from capserve.routing import attention
from capserve.routing.attention import routing_step
from capserve.runtime.metadata import CONFIG_KEY
from capserve.runtime.onnx_backend import VOTE_COPIES, OnnxRuntime, vote_bytes_per_image

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from capserve.export.onnx import export_onnx  # noqa: E402

NAME = "cifar10-simple"
T = 3  # the last conv capsule layer and the class layer route with attention


def recorded_vote_bytes(model: capserve.CapsNet, iterations: int, monkeypatch) -> int:
    """Votes per image (float32 bytes) of every layer whose attention step the model actually runs."""
    routed = {}
    step = routing_step

    def recording_step(children, weight, parents, *args, **kwargs):
        _, P, N, _ = children.shape
        routed[weight.data_ptr()] = P * N * weight.shape[1] * parents.shape[-1] * 4
        return step(children, weight, parents, *args, **kwargs)

    monkeypatch.setattr(attention, "routing_step", recording_step)
    with torch.no_grad():
        model(tiny_input(model, 1), iterations=iterations)
    return sum(routed.values())


@pytest.mark.parametrize("routing_order", ["concurrent", "sequential"])
def test_vote_bytes_follow_the_layers_the_model_routes(monkeypatch, model_name, routing_order):
    if capserve.get_config(model_name).routing_algorithm != "attention":
        pytest.skip("attention routing's steps (dynamic, EM and CNNs: the test below)")
    model = tiny_model(model_name, routing=routing_order)
    for iterations in range(1, 6):
        expected = recorded_vote_bytes(model, iterations, monkeypatch)
        assert vote_bytes_per_image(model.config, iterations) == expected, iterations
    assert vote_bytes_per_image(model.config, 1) == 0  # uniform routing only: no votes


def test_vote_bytes_of_the_other_routings_and_of_cnns():
    """By hand, per layer: positions × children × parent types × D values of 4 bytes."""
    dynamic = capserve.get_config("multimnist-capsnet-small")  # grids 9 → 7 (conv 3×3/1, 8 types), 8-d vectors
    by_hand = 7**2 * (3 * 3 * 8) * 8 * 8 + (8 * 7**2) * 10 * 8 + 10 * 10 * 8
    assert [vote_bytes_per_image(dynamic, T) for T in (1, 2, 5)] == [0, 4 * by_hand, 4 * by_hand]  # T = 1: uniform
    em = capserve.get_config("multimnist-em-small")  # grids 9 → 4 (conv 3×3/2, 8 types) → 10 classes, 4×4 poses
    by_hand = 4**2 * (3 * 3 * 8) * 8 * 16 + (8 * 4**2) * 10 * 16
    assert [vote_bytes_per_image(em, T) for T in (1, 2, 5)] == [4 * by_hand] * 3  # EM's M-step reads votes at T = 1
    assert vote_bytes_per_image(capserve.get_config("multimnist-cnn-fc-small"), None) == 0


@pytest.fixture(scope="module")
def model():
    return tiny_model(NAME)


@pytest.fixture(scope="module")
def explain_file(model, tmp_path_factory):
    return export_onnx(model, tmp_path_factory.mktemp("chunks") / "model.onnx", T, explain=True)


def budget_for(model: capserve.CapsNet, images: int) -> float:
    """The memory budget (MB) that holds exactly ``images`` images per chunk."""
    return images * VOTE_COPIES * vote_bytes_per_image(model.config, T) / 2**20


def test_export_records_the_architecture(explain_file, model):
    props = {p.key: p.value for p in onnx.load(str(explain_file)).metadata_props}
    config = ModelConfig.from_dict(json.loads(props[CONFIG_KEY]))
    assert config == model.config
    assert config.extra == {}  # training provenance stays out of the artifact


def test_chunked_batches_equal_one_whole_run(explain_file, model):
    whole = OnnxRuntime(explain_file, memory_budget_mb=None)
    chunked = OnnxRuntime(explain_file, memory_budget_mb=budget_for(model, 2))
    assert whole.chunk_size is None and chunked.chunk_size == 2
    x = tiny_input(model, 5).numpy()  # chunks of 2, 2, 1
    np.testing.assert_allclose(chunked.predict(x), whole.predict(x), rtol=0, atol=1e-6)
    got, expected = chunked.explain(x), whole.explain(x)
    np.testing.assert_allclose(got.logits, expected.logits, rtol=0, atol=1e-6)
    np.testing.assert_allclose(got.part_whole, expected.part_whole, rtol=0, atol=1e-6)
    assert got.logits.shape == (5, model.config.num_classes)
    assert chunked.predict(x[:2]).shape == (2, model.config.num_classes)  # one chunk exactly
    with torch.no_grad():
        eager = model(torch.from_numpy(x), iterations=T).numpy()
    np.testing.assert_allclose(chunked.predict(x), eager, rtol=0, atol=1e-4)


def test_default_budget_and_bad_inputs(explain_file, model):
    runtime = OnnxRuntime(explain_file)
    per_image = VOTE_COPIES * vote_bytes_per_image(model.config, T)
    assert runtime.chunk_size == 512 * 2**20 // per_image
    small = OnnxRuntime(explain_file, memory_budget_mb=1e-6)
    assert small.chunk_size == 1  # never less than one image
    size = model.config.image_size
    with pytest.raises(InputError, match="B >= 1"):
        small.predict(np.zeros((0, 3, size, size), np.float32))
    with pytest.raises(InputError, match="float32"):
        small.predict(np.zeros((3, 3, size, size), np.float64))
    with pytest.raises(InputError, match="shape"):
        small.explain(np.zeros((3, 3, size + 1, size), np.float32))
    with pytest.raises(ValueError, match="memory_budget_mb"):
        OnnxRuntime(explain_file, memory_budget_mb=0)


def test_files_without_the_architecture(explain_file, model, tmp_path, caplog):
    proto = onnx.load(str(explain_file))
    props = {p.key: p.value for p in proto.metadata_props}

    def save(name: str, **changes: str) -> str:
        del proto.metadata_props[:]
        for key, value in {**props, **changes}.items():
            if value is not None:
                entry = proto.metadata_props.add()
                entry.key, entry.value = key, value
        onnx.save(proto, str(tmp_path / name))
        return str(tmp_path / name)

    # exported before the key existed: a named config is read from the registry (its full size here)
    registered = OnnxRuntime(save("old.onnx", **{CONFIG_KEY: None}))
    full = capserve.get_config(NAME)
    assert registered.chunk_size == 512 * 2**20 // (VOTE_COPIES * vote_bytes_per_image(full, T))
    # an unknown architecture runs whole batches, and says so
    metadata = json.loads(props["capserve.metadata"])
    unknown = save("unknown.onnx", **{CONFIG_KEY: None, "capserve.metadata": json.dumps({**metadata, "name": "x"})})
    assert OnnxRuntime(unknown).chunk_size is None
    assert "records no model config" in caplog.text
    with pytest.raises(RuntimeLoadError, match="not a valid model config"):
        OnnxRuntime(save("bad.onnx", **{CONFIG_KEY: json.dumps({"name": NAME, "layers": 3})}))
