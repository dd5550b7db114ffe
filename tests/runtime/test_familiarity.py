"""The unfamiliarity score (``capserve.runtime.familiarity``): its threshold marks the share of validation images it
promises familiar, it is the same on every runtime, it travels with the model folder and its exports, and every
answer path carries it (``/classify`` alone and in adaptive batches, ``/classify_batch``, ``/multilabel``,
``/explain``, ``capserve predict``), null where the model has none or the server turned it off."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from support.models import tiny_model
from support.server import encode, export, random_png

from capserve.data.splits import Split
from capserve.evaluate.familiar import class_poses, fit_model
from capserve.export.onnx import export_checkpoint
from capserve.runtime import load_runtime
from capserve.runtime.familiarity import FAMILIAR_SHARE, FAMILIARITY_FILE, fit_familiarity, read_familiarity
from capserve.serving import Capsules, Settings


def noise(n: int, seed: int, shape=(3, 32, 32), low: int = 0, high: int = 256) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(low, high, (n, *shape), dtype=np.uint8))


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """A tiny capsule model folder with its graphs and a calibration fitted on dim noise (pixels 0-99): bright
    noise (156-255) is what it has not seen."""
    model = tiny_model("cifar10-resnet")
    out = export(model, tmp_path_factory.mktemp("familiar") / "model", explain=True)
    train = Split(noise(200, 0, high=100), torch.from_numpy(np.arange(200) % 10))
    validation = Split(noise(100, 1, high=100), torch.from_numpy(np.arange(100) % 10))
    fit_model(model, train, validation).save(out)
    return out


def settings(folder: Path, **changes) -> Settings:
    env = {"CAPSERVE_MODEL": str(folder), "CAPSERVE_MULTILABEL_MODEL": "none", "CAPSERVE_THREADS": "1"}
    return dataclasses.replace(Settings.from_env(env), **changes)


# ------------------------------------------------------------------------------------------ the score


def test_the_threshold_marks_the_promised_share_of_validation_images_familiar(tmp_path):
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(10, 3, 4))  # ten classes of (C=3, D=4) capsules
    labels = rng.integers(0, 10, 2000)
    train = centres[labels] + 0.1 * rng.normal(size=(2000, 3, 4))
    validation = centres[labels[:1000]] + 0.1 * rng.normal(size=(1000, 3, 4))
    familiarity = fit_familiarity(train, labels, validation)
    assert np.mean(familiarity.scores(validation) <= 1) == pytest.approx(FAMILIAR_SHARE, abs=0.001)
    far = rng.normal(size=(500, 3, 4))  # capsules of no class
    assert np.mean(familiarity.scores(far) > 1) > 0.9
    familiarity.save(tmp_path)
    again = read_familiarity(tmp_path)
    np.testing.assert_array_equal(again.scores(far), familiarity.scores(far))
    assert again.fitted["train_images"] == 2000 and again.fitted["validation_images"] == 1000
    one_mean = fit_familiarity(train, None, validation)  # multi-label models: one mean for every image
    assert one_mean.means.shape == (1, 12) and np.mean(one_mean.scores(validation) <= 1) >= FAMILIAR_SHARE
    (tmp_path / FAMILIARITY_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="is not a familiarity file capserve wrote"):
        read_familiarity(tmp_path)
    assert read_familiarity(tmp_path / "elsewhere") is None


def test_every_runtime_computes_the_same_score(folder):
    """Torch and ONNX Runtime give the same class capsules, so the same score; the logits beside them are
    ``predict``'s."""
    from capserve.data.preprocess import normalize_images

    meta = load_runtime(folder).metadata
    batch = normalize_images(np.concatenate([noise(4, 5, high=100).numpy(), noise(4, 6, low=156).numpy()]), meta)
    familiarity = read_familiarity(folder)
    scores = {}
    for name, runtime in {"torch": load_runtime(folder, "torch"), "onnx": load_runtime(folder / "model.onnx")}.items():
        logits, poses = runtime.infer(batch)
        np.testing.assert_allclose(logits, runtime.predict(batch), atol=1e-5)
        scores[name] = familiarity.scores(poses)
    np.testing.assert_allclose(scores["onnx"], scores["torch"], rtol=1e-3, atol=1e-3)
    assert (scores["torch"][:4] < scores["torch"][4:].min()).all()  # the bright noise is further from the dim


# ------------------------------------------------------------------------------------------ the answers


def noise_png(seed: int, low: int = 0, high: int = 100) -> bytes:
    """A 32×32 PNG of noise: dim (as the calibration's training images) or, with ``low`` 156, bright."""
    return encode(noise(1, seed, low=low, high=high)[0].permute(1, 2, 0).numpy())


def test_every_answer_carries_the_unfamiliarity_and_its_flag(folder):
    capsules = Capsules(settings(folder))
    dim, bright = noise_png(10), noise_png(11, low=156, high=256)

    async def answers():
        alone = await capsules.classify(bright)
        together = await asyncio.gather(*(capsules.classify(image) for image in [bright, dim] * 4))  # batched
        batch = await capsules.classify_batch([bright, dim])
        explained = await capsules.explain(bright, 3)
        return alone, together, batch, explained

    alone, together, batch, explained = asyncio.run(answers())
    assert alone.unfamiliar is True and alone.unfamiliarity > 1
    assert [a.unfamiliar for a in together] == [True, False] * 4
    assert [a.unfamiliarity for a in together[::2]] == pytest.approx([alone.unfamiliarity] * 4, rel=1e-4)
    assert [a.unfamiliar for a in batch] == [True, False]
    assert batch[0].unfamiliarity == pytest.approx(alone.unfamiliarity, rel=1e-4)
    assert explained.unfamiliar is True and explained.unfamiliarity == pytest.approx(alone.unfamiliarity, rel=1e-4)
    assert list(json.loads(alone.model_dump_json()))[-2:] == ["unfamiliarity", "unfamiliar"]  # added, not changed


def test_a_setting_turns_it_off_and_a_model_without_calibration_answers_null(folder, tmp_path):
    image = random_png(2)
    off = Capsules(settings(folder, unfamiliar=False))
    answer = asyncio.run(off.classify(image))
    assert answer.unfamiliarity is None and answer.unfamiliar is None
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / FAMILIARITY_FILE).unlink()
    answer = asyncio.run(Capsules(settings(bare)).classify(image))
    assert answer.unfamiliarity is None and answer.unfamiliar is None and answer.predictions


def test_the_calibration_travels_with_a_graph_exported_elsewhere(folder, tmp_path):
    """A graph exported into another folder takes the calibration along, and a server of that file reads it."""
    out = tmp_path / "export" / "model.onnx"
    out.parent.mkdir()
    export_checkpoint(folder, out)
    assert (out.parent / FAMILIARITY_FILE).read_bytes() == (folder / FAMILIARITY_FILE).read_bytes()
    answer = asyncio.run(Capsules(settings(out)).classify(random_png(3)))
    assert answer.unfamiliarity is not None


def test_class_poses_are_the_models_own(folder):
    import capserve

    model = capserve.load(folder)
    images = noise(3, 9)
    poses = class_poses(model, images)
    assert poses.shape[:2] == (3, len(model.config.labels))
