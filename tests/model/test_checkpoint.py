"""Model directories: safetensors + JSON round trip, and clear errors for broken ones."""

from __future__ import annotations

import dataclasses
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


@pytest.mark.parametrize(
    "field, value", [("class_norm", "per_class"), ("backbone_layers", 3), ("backbone_blocks", 0), ("class_grid", None)]
)
def test_a_model_saved_before_a_field_existed_loads_as_it_was_trained(tmp_path, field, value):
    """A config.json without ``class_norm``, ``backbone_layers`` or ``backbone_blocks`` (every model folder written
    before they existed, the own-images model's included) is a model whose class capsules were LayerNorm'd one by one,
    on a backbone of three conv layers and no residual blocks: it loads as such, answers as it did."""
    model = tiny_model("cifar10-conv", **{field: value})
    model.save(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    del data["config"][field]
    (tmp_path / "config.json").write_text(json.dumps(data))
    loaded = capserve.load(tmp_path)
    assert getattr(loaded.config, field) == value
    x = tiny_input(model, 2).cpu()
    with torch.no_grad():
        assert torch.equal(loaded(x), model.cpu()(x))


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


def weights(directory) -> dict:
    return {k: v.clone() for k, v in capserve.load(directory).state_dict().items()}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_a_kill_left_half_written_is_cleared_before_the_next_write(tmp_path):
    """A process killed while writing leaves its hidden partial folder behind (no ``except`` ran): the next write
    starts afresh instead of failing on it, and nothing of the half-written one survives."""
    directory = tmp_path / "last"
    with replacing_directory(directory) as d:
        save_model(tiny_model("cifar10-simple"), d)
    partial, _ = swap_names(directory)
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"\x00" * 64)  # the kill's leftovers
    (partial / "stray.json").write_text("{")
    second = shifted(tiny_model("cifar10-simple"))
    with replacing_directory(directory) as d:
        save_model(second, d)
    assert same(weights(directory), second.state_dict())
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_a_write_after_a_swap_cut_between_its_renames_keeps_the_folder_whole(tmp_path):
    """Killed after setting the old folder aside, before the new one came in: the next write brings the old one
    back first, so that even if it fails too, the folder is there, whole, with the old weights."""
    directory = tmp_path / "last"
    first = tiny_model("cifar10-simple")
    with replacing_directory(directory) as d:
        save_model(first, d)
    _, aside = swap_names(directory)
    directory.rename(aside)  # the kill between the two renames
    with pytest.raises(RuntimeError), replacing_directory(directory) as d:
        save_model(shifted(tiny_model("cifar10-simple")), d)
        raise RuntimeError("killed")  # and the next write fails half-way
    assert same(weights(directory), first.state_dict())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last"]


def test_update_config_rewrites_config_json_alone_and_keeps_its_other_entries(tmp_path):
    """The one editor of a model folder's config.json: a new model config (calibrated thresholds) or entries merged
    into its ``training`` record; the weights stay byte for byte, every other entry stays."""
    model = tiny_model("multimnist-matrix")
    save_model(model, tmp_path, extra={"training": {"epoch": 3}, "metrics": {"val_acc": 0.5}})
    weights = (tmp_path / checkpoint.WEIGHTS).read_bytes()
    checkpoint.update_config(tmp_path, dataclasses.replace(model.config, thresholds=(0.3,) * 10))
    checkpoint.update_config(tmp_path, training={checkpoint.NOT_LEARNED: False})
    assert capserve.read_config(tmp_path).thresholds == (0.3,) * 10
    assert checkpoint.read_extra(tmp_path) == {
        "training": {"epoch": 3, checkpoint.NOT_LEARNED: False},
        "metrics": {"val_acc": 0.5},
    }
    assert (tmp_path / checkpoint.WEIGHTS).read_bytes() == weights
    with pytest.raises(capserve.CheckpointError, match="config.json not found"):
        checkpoint.update_config(tmp_path / "missing", training={"x": 1})
