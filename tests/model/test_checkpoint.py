"""Model directories: safetensors + JSON round trip, and clear errors for broken ones."""

from __future__ import annotations

import json

import pytest
import torch
from support.models import tiny_input, tiny_model

import capserve
from capserve.files import recover_directory, replacing_directory, swap_names
from capserve.model import checkpoint
from capserve.model.checkpoint import save_model


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


def shifted(model):
    """The model with other weights (every parameter + 1)."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1)
    return model


def test_a_save_that_fails_half_way_leaves_the_model_directory_as_it_was(tmp_path):
    """A process killed (here: an error) while a model directory is rewritten leaves the old one whole, and no
    hidden half-written folder beside it."""
    directory = tmp_path / "best"
    first, second = tiny_model("cifar10-simple"), shifted(tiny_model("cifar10-simple"))
    with replacing_directory(directory) as d:
        save_model(first, d)
    before = (directory / "model.safetensors").read_bytes()
    with pytest.raises(RuntimeError), replacing_directory(directory) as d:
        save_model(second, d)
        raise RuntimeError("killed")
    assert (directory / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]
    with replacing_directory(directory) as d:
        save_model(second, d)
    assert (directory / "model.safetensors").read_bytes() != before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def test_a_swap_cut_between_its_two_renames_is_finished_on_the_next_use(tmp_path):
    directory = tmp_path / "last"
    save_model(tiny_model("cifar10-simple"), directory)
    _, aside = swap_names(directory)
    directory.rename(aside)  # killed after setting the old one aside, before the new one came in
    recover_directory(directory)
    assert capserve.load(directory) is not None and not aside.exists()
    save_model(tiny_model("cifar10-simple"), aside)  # killed after the new one came in, before the old one went
    recover_directory(directory)
    assert directory.is_dir() and not aside.exists()


def test_save_model_replaces_each_file_whole(tmp_path, monkeypatch):
    directory = save_model(tiny_model("cifar10-simple"), tmp_path / "m")
    before = {p.name: p.read_bytes() for p in directory.iterdir()}

    def killed(tensors, path, metadata=None):  # half the file written, then the disk is full
        path.write_bytes(b"\x00" * 64)
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "save_tensors", killed)
    with pytest.raises(OSError):
        save_model(shifted(tiny_model("cifar10-simple")), directory)
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before  # no partial file, nothing changed
