"""Model directories: safetensors + JSON round trip, and clear errors for broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from support.models import tiny_input, tiny_model

import capserve


def test_save_load_round_trip(tmp_path, model_name):
    model = tiny_model(model_name, iterations=3)
    model.save(tmp_path / "m")
    loaded = capserve.load(tmp_path / "m")
    assert loaded.config == model.config
    assert not loaded.training
    x = tiny_input(model, 2).cpu()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.cpu()(x))
    assert sorted(p.name for p in (tmp_path / "m").iterdir()) == ["config.json", "model.safetensors"]


def test_config_json_is_plain_data(tmp_path):
    tiny_model("multimnist-matrix", thresholds=(0.4,) * 10).save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    assert data["config"]["task"] == "multi_label"
    assert data["config"]["thresholds"] == [0.4] * 10
    assert data["config"]["labels"] == [str(d) for d in range(10)]


def test_missing_directory_or_file(tmp_path):
    with pytest.raises(capserve.CheckpointError, match="config.json"):
        capserve.load(tmp_path)
    tiny_model("cifar10-simple").save(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(capserve.CheckpointError, match="model.safetensors"):
        capserve.load(tmp_path)


def test_truncated_weights(tmp_path):
    tiny_model("cifar10-simple").save(tmp_path)
    w = tmp_path / "model.safetensors"
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(capserve.CheckpointError, match="truncated"):
        capserve.load(tmp_path)


def test_weights_that_do_not_match_the_config(tmp_path):
    tiny_model("cifar10-simple").save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data["config"]["primary_types"] = 6
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(capserve.CheckpointError, match="does not match"):
        capserve.load(tmp_path)


@pytest.mark.parametrize("content", ["not json", '{"format_version": 1, "config": {"nme": "x"}}', "[]"])
def test_bad_config_json(tmp_path, content):
    tiny_model("cifar10-simple").save(tmp_path)
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(capserve.CheckpointError):
        capserve.load(tmp_path)


def test_saving_the_same_weights_twice_gives_identical_files(tmp_path):
    """Exports record the weights file's hash; it must not change when the same model is saved again."""
    model = tiny_model("cifar10-simple")
    for name in ("a", "b", "c"):
        model.save(tmp_path / name)
    files = {(tmp_path / n / "model.safetensors").read_bytes() for n in ("a", "b", "c")}
    assert len(files) == 1
