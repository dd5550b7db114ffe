"""A model's unfamiliarity calibration (``capserve.runtime.familiarity``), fitted on its own training and validation
images: after a run trains (``calibrate_familiarity``, its ``best/``) and for any model folder, the shipped ones
included, with ``capserve familiarity MODEL --data DATA``.

The means and covariance come from up to ``FIT_IMAGES`` training images (every one when there are fewer; else a
seeded draw), the threshold from the validation split the run carved or was given (``FAMILIAR_SHARE`` of it stays
familiar): the images the model learned from, and images of the same kind it did not.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from capserve.configs import ModelConfig
from capserve.data.builtin import dataset_for, load_training
from capserve.data.own import (
    FailureLog,
    Sample,
    check_data_exists,
    check_labels,
    is_own_data,
    iter_decoded,
    scan,
    targets_for,
)
from capserve.data.preprocess import normalize
from capserve.data.splits import Split
from capserve.errors import DataError, UsageError
from capserve.evaluate.evaluator import own_samples
from capserve.model.checkpoint import CONFIG
from capserve.model.factory import Model, load
from capserve.runtime.familiarity import FAMILIAR_SHARE, Familiarity, fit_familiarity

__all__ = ["FIT_IMAGES", "add_arguments", "calibrate_familiarity", "class_poses", "fit_model", "run"]

log = logging.getLogger(__name__)

FIT_IMAGES = 5000
FEW_VALIDATION_IMAGES = 100  # below this many, the 95th percentile that sets the threshold moves by an image or two


@torch.no_grad()
def class_poses(model: Model, images: Tensor, batch_size: int = 250, device: str | torch.device = "cpu") -> np.ndarray:
    """The class capsules (N, C, D) of uint8 images (N, C_in, H, W), after the model's routing iterations."""
    model.eval()
    c = model.config
    out = []
    for start in range(0, len(images), batch_size):
        x = normalize(images[start : start + batch_size].to(device), c.mean, c.std)  # (b, C_in, H, W)
        poses, _ = model.route(x, model.resolve_iterations(None), keep_coefficients=False)
        out.append(poses[-1].float().cpu().numpy())  # (b, C, D)
    return np.concatenate(out)


def fit_model(
    model: Model, train: Split, validation: Split, batch_size: int = 250, device: str | torch.device = "cpu", **fitted
) -> Familiarity:
    """``fit_familiarity`` on a model's class capsules: up to ``FIT_IMAGES`` of ``train`` (a seeded draw) and all of
    ``validation``."""
    if not model.config.has_routing:
        raise UsageError(f"{model.config.name} is a CNN: it has no class capsules for an unfamiliarity score")
    if not len(validation):
        raise DataError("no validation images: the threshold needs images of the same kind the model did not learn")
    pick = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))[:FIT_IMAGES]
    images, targets = train.images[pick.to(train.images.device)], train.targets[pick.to(train.targets.device)]
    labels = None if model.config.task == "multi_label" else targets.cpu().numpy()
    return fit_familiarity(
        class_poses(model, images, batch_size, device),
        labels,
        class_poses(model, validation.images, batch_size, device),
        **fitted,
    )


def calibrate_familiarity(best_dir: Path, train: Split, validation: Split | None, device: torch.device) -> None:
    """After training: fit ``best_dir``'s calibration on the run's training and validation images and write it
    there; a run without validation images (``--val-size 0``) says how to fit one later."""
    model = load(best_dir, device)
    if not model.config.has_routing:
        return
    if validation is None or not len(validation):
        log.warning(
            "no validation split: answers from %s carry no unfamiliarity; fit one with "
            "`capserve familiarity %s --data DATA` on data with validation images",
            best_dir,
            best_dir,
        )
        return
    familiarity = fit_model(model, train, validation, device=device)
    path = familiarity.save(best_dir)
    if len(validation) < FEW_VALIDATION_IMAGES:
        log.warning(
            "the unfamiliarity threshold rests on %d validation images: a rough one (give --val-size %d or more)",
            len(validation),
            FEW_VALIDATION_IMAGES,
        )
    log.info(
        "unfamiliarity calibrated on %d training and %d validation images (%.0f %% of them familiar): %s",
        familiarity.fitted["train_images"],
        familiarity.fitted["validation_images"],
        100 * FAMILIAR_SHARE,
        path,
    )


# ------------------------------------------------------------------------------------------ the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="a model folder (config.json, model.safetensors), e.g. models/cifar10 or RUN/best")
    p.add_argument(
        "--data",
        required=True,
        help="the data it was trained on: a folder or CSV of your images (its training and validation images), or "
        "the folder with the CIFAR/MNIST files",
    )
    p.add_argument("--label-separator", metavar="SEP", help="a CSV's labels column: labels separated by SEP")
    p.add_argument("--batch-size", type=int, default=250)
    p.add_argument("--device", default="cpu")


def run(args: argparse.Namespace) -> int:
    """Fit the model folder's unfamiliarity calibration on its data and write it into the folder."""
    folder = Path(args.model)
    if not (folder / CONFIG).is_file():
        raise UsageError(f"{folder} is not a model folder ({CONFIG} missing): give e.g. models/cifar10 or RUN/best")
    check_data_exists(args.data)
    model = load(folder, args.device)
    train, validation = splits(model, args.data, args.label_separator)
    familiarity = fit_model(model, train, validation, args.batch_size, args.device, data=Path(args.data).name)
    path = familiarity.save(folder)
    print(
        f"unfamiliarity calibrated on {familiarity.fitted['train_images']} training and "
        f"{familiarity.fitted['validation_images']} validation images ({100 * FAMILIAR_SHARE:.0f} % of them "
        f"familiar): {path}; answers served from {folder} now carry it"
    )
    return 0


def splits(model: Model, data: str, label_separator: str | None) -> tuple[Split, Split]:
    """The training images (a seeded draw of at most ``FIT_IMAGES``) and the validation split the model's run used."""
    c = model.config
    info = c.extra.get("data", {})
    if not is_own_data(data):
        dataset = info.get("dataset") or dataset_for(c.labels, c.task, c.image_size)
        loaded = load_training(dataset, data, info.get("val_size") or 5000, FIT_IMAGES, "cpu")
        if loaded.val is None:
            raise DataError(f"{c.name} was trained without a validation split (--val-size 0): nothing to set it on")
        return loaded.epoch(0, 0, torch.device("cpu")), loaded.val  # DiverseMultiMNIST: FIT_IMAGES generated
    manifest = scan(data, label_separator)
    check_labels(manifest, c.labels, "the model's labels", ("train", "val"))
    return _decoded(manifest.splits["train"][: FIT_IMAGES * 4], c, manifest.source), _decoded(
        own_samples(manifest, "val", info.get("val_size")), c, manifest.source
    )


def _decoded(samples: list[Sample], config: ModelConfig, source: Path) -> Split:
    """``samples`` decoded at ``config``'s input (unreadable files skipped and counted, as training does)."""
    failures = FailureLog(len(samples), source)
    images, kept = [], []
    for batch, index in iter_decoded(samples, config, failures, 250):
        images.append(torch.from_numpy(batch))
        kept.extend(index)
    if not kept:
        raise DataError(f"no readable images in {source}")
    targets = targets_for([samples[i] for i in kept], config.labels, config.task == "multi_label")
    return Split(torch.cat(images), targets)
