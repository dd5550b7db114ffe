"""What a run records of its choices, and how a resumed run reads them: the input size its images are decoded at and
why, in the log and ``train_config.json``; the rules deciding for new runs only (none takes ``resume``); a resumed
run's plan read from its record, deciding nothing again, in one place (``capserve.train.plan.resumed_plan``)."""

from __future__ import annotations

import inspect
import json
import logging
from pathlib import Path

import torch
from PIL import Image
from support.models import own_config

import capserve
import capserve.train.class_layer as class_layer
import capserve.train.few_images as few_images
import capserve.train.plan as plan_module
import capserve.train.rules as rules
import capserve.train.stem as stem
from capserve.train.config import read_resume_config
from capserve.train.distributed import Dist
from capserve.train.loop import train
from capserve.train.plan import RESUMED, plan_run


def grown(folder: Path, out: Path, side: int) -> Path:
    """``folder``'s images resized to ``side`` pixels a side, in a folder of the same labels."""
    for path in folder.rglob("*.png"):
        target = out / path.relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        Image.open(path).resize((side, side)).save(target)
    return out


# ------------------------------------------------------------------------------------------ the input size


def test_the_log_and_the_record_say_the_input_size_and_why(marks, tmp_path, caplog):
    """A 64-pixel folder trained at the model's 32 pixels says so, with the flag that trains at its size; given,
    the size says it was given; the record holds the size as channels, height, width."""
    large = grown(marks, tmp_path / "large", 64)
    with caplog.at_level(logging.INFO, logger="capserve"):
        train(own_config(large, tmp_path / "run", max_steps=1))
    why = (
        "the model config's 32×32: your images are 64×64 and are resized down to it (--image-size 64 trains at their "
        'size, slower; docs/own-data.md, "Larger images")'
    )
    assert f"input: 3×32×32 ({why})" in caplog.text
    recorded = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert recorded["input_size"] == [3, 32, 32] and recorded["reasons"]["input_size"] == why
    plan = plan_run(own_config(large, tmp_path / "given", image_size=64), None, Dist(), torch.device("cpu"))
    assert plan.reasons["input_size"] == "given (--image-size 64)" and plan.config.image_size == 64
    plan = plan_run(own_config(marks, tmp_path / "small"), None, Dist(), torch.device("cpu"))
    assert plan.reasons["input_size"] == "the model config's 32×32: your images are 24×24 and are resized up to it"


def test_builtin_data_is_decoded_at_its_own_size(tmp_path):
    from capserve.configs import get_config

    config = get_config("cifar10-simple")
    assert rules.input_size(own_config(tmp_path, tmp_path / "run"), config, None) == "the data set's"


# ------------------------------------------------------------------------------------------ resume


RULE_MODULES = (rules, few_images, class_layer, stem)


def test_no_rule_takes_resume():
    """The rules decide for new runs only; a resumed run reads its choices from its record in one place."""
    for module in RULE_MODULES:
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__:
                assert "resume" not in inspect.signature(function).parameters, f"{module.__name__}.{name}"


def test_a_resumed_run_decides_nothing_and_reads_its_choices_from_its_record(marks, tmp_path, monkeypatch, caplog):
    """With every rule (and every measurement of the images) failing, a resumed run plans all the same: its model is
    the one its last checkpoint was built as, its recipe the recorded one, each reason ``RESUMED``."""
    out = tmp_path / "run"
    train(own_config(marks, out, epochs=2, max_steps=1))
    recorded = json.loads((out / "train_config.json").read_text())

    def decides(*args, **kwargs):
        raise AssertionError("a resumed run decided a choice again")

    for module in RULE_MODULES:
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__:
                monkeypatch.setattr(module, name, decides)
    for name in ("from_the_images", "measure_placement", "run_precision", "resolve_recipe", "new_plan"):
        monkeypatch.setattr(plan_module, name, decides)
    with caplog.at_level(logging.INFO, logger="capserve"):
        plan = plan_run(read_resume_config(out), out, Dist(), torch.device("cpu"))
    assert plan.config == capserve.read_config(out / "last")
    assert set(plan.reasons) >= set(recorded["reasons"]) and set(plan.reasons.values()) == {RESUMED}
    assert "input: 3×32×32 (as the run resumed recorded it)" in caplog.text
    assert plan.cfg.overrides == recorded["overrides"] and plan.cfg.augment == recorded["augment"]


def test_a_run_calibrates_what_its_model_calls_familiar(marks, tmp_path):
    """A run on a user's images writes its ``best/``'s unfamiliarity calibration without a flag: fitted on its
    training images, its threshold set on the validation images it carved."""
    from capserve.runtime.familiarity import FAMILIARITY_FILE, read_familiarity

    out = tmp_path / "run"
    train(own_config(marks, out, max_steps=2))
    familiarity = read_familiarity(out / "best")
    assert familiarity is not None and (out / "best" / FAMILIARITY_FILE).is_file()
    assert familiarity.fitted["train_images"] == 27 and familiarity.fitted["validation_images"] == 3  # 30 marks
