"""A run's plan: every choice that depends on the data, made once, before anything is built (``plan_run``).

The recipe (optimizer, lr, weight decay, schedule, label smoothing), the batch size, the augmentation, the mean/std,
the class capsule transforms, and why each was chosen; the model config the run builds its model from, once
(``Plan.build_model``); and the data, decoded at that model's input. ``train_config.json`` records the resolved
``TrainConfig`` with the reasons (``Plan.record``), and ``--resume`` rebuilds the same model from it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from capserve.configs import ModelConfig, get_config
from capserve.data.augment import augment_reason, default_augment
from capserve.data.builtin import Data, dataset_for, load_training
from capserve.data.cache import CACHE_FILE, build_cache
from capserve.data.own import InputSize, Manifest, check_data_exists, check_training, is_own_data, scan, with_validation
from capserve.data.placement import measure_placement
from capserve.data.preprocess import data_mean_std
from capserve.data.splits import Split
from capserve.files import write_whole
from capserve.model.factory import Model, build_model
from capserve.routing.attention import cross_entropy_loss
from capserve.routing.losses import training_loss
from capserve.train.amp import AmpCandidate, run_precision
from capserve.train.class_layer import choose_class_layer, chooses_class_weights
from capserve.train.config import (
    AUTO_BACKBONE_LOSS_GRID,
    AUTO_LABEL_SMOOTHING,
    DEFAULT_LR,
    DEFAULT_VAL_SIZE,
    TrainConfig,
    resolve_recipe,
)
from capserve.train.distributed import Dist
from capserve.train.few_images import few_images, few_images_augment
from capserve.train.state import check_init
from capserve.train.stem import pooled_stem, pooled_stem_backbone_loss, stem_pool

__all__ = [
    "RESUMED",
    "TRAIN_CONFIG",
    "Plan",
    "backbone_depth",
    "class_norm",
    "label_smoothing",
    "model_config",
    "plan_run",
    "val_size_of",
]

log = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.json"

RESUMED = "as the run resumed recorded it"  # a resumed run's choices come from its trainer.json

ADAM_LR_WARNING = 1e-2  # an Adam(W) lr above this is almost always an SGD lr given by habit


@dataclass(frozen=True)
class Plan:
    """Everything a run decided before building anything.

    ``cfg``: the ``TrainConfig`` with no choice left open (recipe, batch size, augmentation, and the class capsule
    transforms in its overrides). ``config``: the model to build, with the data's labels, task, input size and
    mean/std. ``reasons``: why each choice was made, in the words of the run's log. The rest is the data: training
    (and validation), the test split of a user's images, and how many of their files were skipped."""

    cfg: TrainConfig
    config: ModelConfig
    reasons: dict[str, str]
    data: Data
    manifest: Manifest | None = None
    test_split: Split | None = None
    skipped: int = 0

    @property
    def dataset(self) -> str:
        return self.config.extra["data"]["dataset"]

    def build_model(self) -> Model:
        """The run's model, initialised from its seed."""
        torch.manual_seed(self.cfg.seed)
        return build_model(self.config)

    def record(self, out: Path) -> None:
        """``train_config.json``: the resolved ``TrainConfig`` and, under ``reasons``, why each choice was made."""
        recorded = {**dataclasses.asdict(self.cfg), "reasons": self.reasons}
        write_whole(out / TRAIN_CONFIG, json.dumps(recorded, indent=1) + "\n")


def val_size_of(cfg: TrainConfig, own: bool) -> int | float:
    return cfg.val_size if cfg.val_size is not None else DEFAULT_VAL_SIZE["own" if own else "builtin"]


def model_config(cfg: TrainConfig, manifest: Manifest | None = None) -> ModelConfig:
    """The config of the model to train: the named config, with the labels, task and input size of a user's data if
    given, and the data and name it was trained on in ``extra``."""
    config = get_config(cfg.model, **cfg.overrides)
    val_size = val_size_of(cfg, manifest is not None)
    if manifest is None:
        if cfg.image_size is not None:
            raise ValueError(
                "--image-size works with your own images (a folder or CSV); the built-in datasets have "
                "fixed sizes (use --set image_size=N to change a model config)"
            )
        data = {"dataset": dataset_for(config.labels, config.task, config.image_size), "val_size": val_size}
    else:
        config = dataclasses.replace(
            config,
            labels=manifest.labels,
            task=manifest.task,
            thresholds=None,
            image_size=cfg.image_size or config.image_size,
            stem_pool=stem_pool(cfg, config),
            init_classes=init_classes(cfg, config, len(manifest.labels)),
        )
        data = {"dataset": manifest.kind, "source": str(manifest.source), "val_size": val_size}
    # served answers and exports carry the run's name: two fine-tunes of one config can be told apart
    name = cfg.name or Path(cfg.out).name
    return dataclasses.replace(config, extra={**config.extra, "data": data, "name": name})


# a user's run on more classes starts its class transforms at the authors' init for this many (their CIFAR-10 runs)
INIT_CLASSES = 10


def init_classes(cfg: TrainConfig, config: ModelConfig, classes: int) -> int | None:
    """The class transforms' initial scale for a new run on a user's ``classes`` labels: the authors' init for
    ``INIT_CLASSES`` when there are more (docs/own-data.md, "Capsules beside the CNN"); the config's otherwise, with
    ``--init`` (its weights) and as given with ``--set init_classes=N``."""
    if "init_classes" in cfg.overrides or cfg.init or not config.has_routing or config.routing_algorithm != "attention":
        return config.init_classes
    return INIT_CLASSES if classes > INIT_CLASSES else None


def class_norm(cfg: TrainConfig, manifest: Manifest | None, resume: str | Path | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the class capsules' LayerNorm chosen (and why). A new run from scratch on a user's images, of an
    attention capsule model with LayerNorm, normalises its class capsules together where one label answers
    (single-label: the classes compete for it, as the softmax over their logits does) and each alone where every
    label answers on its own (multi-label), recorded in ``overrides`` so that ``--resume`` rebuilds the same model
    (docs/own-data.md, "The class capsules under one LayerNorm"). Otherwise the config's: as given with ``--set
    class_norm=...``, ``--init``'s model's, a resumed run's record, and on the built-in data sets."""
    if "class_norm" in cfg.overrides:
        return cfg, RESUMED if resume is not None else "given"
    config = get_config(cfg.model, **cfg.overrides)
    attention = config.has_routing and config.routing_algorithm == "attention" and config.layer_norm
    if manifest is None or resume is not None or cfg.init or not attention:
        return cfg, "the model config's"
    if manifest.task == "multi_label":
        norm, why = "per_class", "multi-label: each label answers on its own, so each class capsule is normalised alone"
    else:
        norm, why = "joint", "single-label: the class capsules compete for one answer, under one LayerNorm"
    return dataclasses.replace(cfg, overrides={**cfg.overrides, "class_norm": norm}), why


# a user's capsule model on the conv backbone: its first two conv layers, then two residual blocks at the second's grid
OWN_BACKBONE = {"backbone_layers": 2, "backbone_blocks": 2}


def backbone_depth(cfg: TrainConfig, manifest: Manifest | None, resume: str | Path | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the conv backbone's depth chosen (and why). A new run from scratch on a user's images, of a
    capsule model on the conv backbone, puts two residual blocks after its first two conv layers in place of the third
    (``OWN_BACKBONE``): only the class layer routes, so the capsules add little that is not linear to what the backbone
    made of the image (docs/own-data.md, "Residual blocks in front of the capsules"). Recorded in ``overrides`` so
    that ``--resume`` rebuilds the same model. Otherwise the config's: as given with ``--set backbone_layers=N`` or
    ``backbone_blocks=N``, ``--init``'s model's, a resumed run's record, a CNN's, and on the built-in data sets."""
    if OWN_BACKBONE.keys() & cfg.overrides.keys():
        return cfg, RESUMED if resume is not None else "given"
    config = get_config(cfg.model, **cfg.overrides)
    if manifest is None or resume is not None or cfg.init or config.backbone != "conv" or not config.has_routing:
        return cfg, "the model config's"
    why = "your own images: residual blocks in place of a third conv layer"
    return dataclasses.replace(cfg, overrides={**cfg.overrides, **OWN_BACKBONE}), why


def read_manifest(cfg: TrainConfig) -> Manifest | None:
    """A user's data with its validation split (carved from its training images when it names none); None for the
    built-in data sets."""
    if not is_own_data(cfg.data):
        if cfg.label_separator is not None:
            raise ValueError(
                f"--label-separator is for a CSV of your own images; {cfg.data} holds built-in dataset files"
            )
        return None
    manifest = scan(cfg.data, cfg.label_separator)
    check_training(manifest)
    manifest, carved = with_validation(manifest, val_size_of(cfg, own=True))
    if carved:
        log.info("validation: %d images carved from %s's training images (seed 0)", carved, manifest.source)
    return manifest


def start_afresh(out: Path) -> None:
    """A new run in the folder of an earlier one (without ``--resume``) logs and sums up only itself: the earlier
    run's metrics, curves and summary go, and its ``best/`` and ``last/`` are replaced as this run saves."""
    earlier = [out / name for name in ("metrics.jsonl", "curves.png", "summary.json") if (out / name).is_file()]
    if earlier:
        log.warning("%s holds an earlier run: this one starts afresh and replaces it (--resume continues it)", out)
    for path in earlier:
        path.unlink()


def load_own_training(
    manifest: Manifest, config: ModelConfig, out: Path, d: Dist, device: torch.device
) -> tuple[Data, Split | None, int]:
    """A user's data decoded at the model's input (through the run folder's cache): training data, test, skipped."""
    if d.enabled and not d.main:
        dist.barrier()  # rank 0 decodes and writes the cache first; the others read it
    own = build_cache(manifest, config.labels, InputSize(config.in_channels, config.image_size), out / CACHE_FILE)
    if d.enabled and d.main:
        dist.barrier()
    train, val, test = (own.splits.get(s) for s in ("train", "val", "test"))
    if train is None or not len(train):
        raise ValueError(f"no readable training images in {manifest.source}")
    val = val.to(device) if val is not None and len(val) else None
    return Data(manifest.kind, train.to(device), None, val, len(train)), test, own.skipped


def recipe_reasons(
    given: TrainConfig, cfg: TrainConfig, own: bool, multi_label_capsules: bool, resume: str | Path | None
) -> dict[str, str]:
    """Why the optimizer, schedule and batch size of ``cfg`` (``given``, resolved) are what they are."""
    if resume is not None:
        return dict.fromkeys(
            (
                "optimizer",
                "schedule",
                "batch_size",
                "capsule_lr_scale",
                "backbone_loss",
                "backbone_loss_grid",
                "class_weights",
                "augment",
            ),
            RESUMED,
        )
    data = "your own images" if own else "the built-in data sets"
    batch = "a capsule network on your own multi-label images" if multi_label_capsules else data
    return {
        "optimizer": "given" if given.optimizer != "auto" else f"the default for {data}",
        "schedule": "given" if given.schedule is not None else f"the default for {data}",
        "batch_size": "given" if given.batch_size is not None else f"the default for {batch}",
        "capsule_lr_scale": "given" if given.capsule_lr_scale is not None else f"the default for {data}",
        "backbone_loss": "given" if given.backbone_loss is not None else f"the default for {data}",
    }


def backbone_loss(cfg: TrainConfig, config: ModelConfig, given: TrainConfig) -> tuple[TrainConfig, str | None]:
    """``cfg`` without a backbone loss where it cannot work (and why): a CNN (its classifier already reads its
    backbone), or a frozen backbone. Given for either, it is a mistake the user hears about."""
    if not cfg.backbone_loss:
        return cfg, None
    if not config.has_routing:
        why = f"{config.name} is a CNN: its own classifier reads its backbone"
    elif cfg.freeze == "backbone":
        why = "--freeze backbone: the backbone does not train"
    else:
        return cfg, None
    if given.backbone_loss is not None:
        raise ValueError(f"--backbone-loss trains a capsule network's backbone, and {why}: drop --backbone-loss")
    return dataclasses.replace(cfg, backbone_loss=0.0), why


def label_smoothing(
    cfg: TrainConfig, config: ModelConfig, own: bool, resume: str | Path | None
) -> tuple[TrainConfig, str]:
    """``cfg`` with the label smoothing resolved (and why): as given, or a capsule network's ``AUTO_LABEL_SMOOTHING``
    for the data (a CNN: none); none where the targets are not one label's or the loss is not a cross-entropy. Given
    for either, it is a mistake the user hears about."""
    if resume is not None:
        return cfg, RESUMED
    if config.task == "multi_label":
        why_not = "multi-label targets say of each label on its own whether it is there"
    elif training_loss(config) is not cross_entropy_loss:
        why_not = f"{config.routing_algorithm} routing trains with its own paper's loss"
    else:
        why_not = None
    if why_not is not None:
        if cfg.label_smoothing:
            raise ValueError(f"--label-smoothing softens one label's cross-entropy, and {why_not}: drop it")
        return dataclasses.replace(cfg, label_smoothing=0.0), why_not
    if cfg.label_smoothing is not None:
        return cfg, "given"
    if not config.has_routing:
        return dataclasses.replace(
            cfg, label_smoothing=0.0
        ), f"{config.name} is a CNN: smoothing helped the capsules on the battery, not it"
    data = "your own images" if own else "the built-in data sets"
    return dataclasses.replace(cfg, label_smoothing=AUTO_LABEL_SMOOTHING["own" if own else "builtin"]), (
        f"the default for {data}"
    )


def backbone_loss_grid(cfg: TrainConfig, config: ModelConfig, resume: str | Path | None) -> tuple[TrainConfig, str]:
    """``cfg`` with the backbone classifier's pooling grid resolved (and why): as given, or by the run's class capsule
    transforms (``AUTO_BACKBONE_LOSS_GRID``); 1 where there is no backbone loss. Given to a run without one, it is a
    mistake the user hears about."""
    if resume is not None:
        return cfg, RESUMED
    if not cfg.backbone_loss:
        if cfg.backbone_loss_grid is not None:
            raise ValueError("--backbone-loss-grid pools the backbone loss's classifier, and this run has none")
        return dataclasses.replace(cfg, backbone_loss_grid=1), "no backbone loss"
    if cfg.backbone_loss_grid is not None:
        if cfg.backbone_loss_grid > config.feature_size:
            raise ValueError(
                f"--backbone-loss-grid {cfg.backbone_loss_grid} is finer than the backbone's "
                f"{config.feature_size}×{config.feature_size} map: give at most {config.feature_size}"
            )
        return cfg, "given"
    grid = min(AUTO_BACKBONE_LOSS_GRID[config.class_weights], config.feature_size)
    where = "per position" if config.class_weights == "per_position" else "shared"
    if config.class_weights == "per_position" and config.class_grid == 1:
        where += " in one cell, one per type wherever it lies"
    return dataclasses.replace(cfg, backbone_loss_grid=grid), f"the class layer's transforms are {where}"


def fit_batch(cfg: TrainConfig, data: Data, given: bool, d: Dist) -> tuple[TrainConfig, str | None]:
    """``cfg`` with a batch the data can fill (and why, when it changed): a default batch never refuses a small data
    set, it takes one batch of all its images (a multiple of the processes); a given one does."""
    if data.epoch_size < cfg.batch_size and not given and data.epoch_size >= d.world:
        batch = data.epoch_size // d.world * d.world
        reason = f"one batch of all {data.epoch_size} training images (fewer than the default {cfg.batch_size})"
        return dataclasses.replace(cfg, batch_size=batch), reason
    if data.epoch_size < cfg.batch_size:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the {data.epoch_size} training images per epoch")
    return cfg, None


def from_the_images(
    cfg: TrainConfig, manifest: Manifest, train: Split, resume: str | Path | None, d: Dist
) -> tuple[TrainConfig, ModelConfig, dict[str, str]]:
    """The choices a user's decoded training images make: the class capsule layer (a new run from scratch of a model
    that can take either: ``capserve.train.class_layer``), on small things anywhere its stem (``pooled_stem``), and
    the mean/std (unless ``--init`` keeps its own)."""
    reasons: dict[str, str] = {}
    config = model_config(cfg, manifest)
    if chooses_class_weights(cfg, config, resume):
        placement = measure_placement(train.images, train.targets, cfg.seed)
        chosen, found = choose_class_layer(placement, manifest.task, config.spatial_sizes[-1], cfg.overrides)
        stem, stem_reason = pooled_stem(placement, config, cfg.overrides)
        reasons.update(found)
        if stem_reason:
            reasons["stem_pool"] = stem_reason
        # recorded in train_config.json's overrides, so that --resume rebuilds the same model
        cfg = dataclasses.replace(cfg, overrides={**cfg.overrides, **chosen, **stem})
        if d.main:
            log.info("class capsule transforms: %s (%s)", chosen["class_weights"], reasons["class_weights"])
    config = model_config(cfg, manifest)
    if not cfg.init:  # --init keeps the mean/std its weights were trained with
        config = dataclasses.replace(config, **data_mean_std(train.images))
        reasons["mean_std"] = f"from the {len(train)} training images"
    return cfg, config, reasons


def log_choices(plan: Plan, d: Dist) -> None:
    """The run's log of what it chose, and a warning for an Adam step an SGD habit gave."""
    cfg, config = plan.cfg, plan.config
    if d.main:
        log.info("augmentation: %s (%s)", cfg.augment, plan.reasons["augment"])
        scaled = (
            f" (capsule layers ×{cfg.capsule_lr_scale:g})" if config.has_routing and cfg.capsule_lr_scale != 1 else ""
        )
        log.info(
            "recipe: %s lr %g%s, weight decay %g, %s schedule, batch %d, label smoothing %g (%s)",
            cfg.optimizer,
            cfg.lr,
            scaled,
            cfg.weight_decay,
            cfg.schedule,
            cfg.batch_size,
            cfg.label_smoothing,
            plan.reasons["label_smoothing"],
        )
        if cfg.backbone_loss:
            log.info(
                "backbone loss: a classifier on the backbone features pooled to %d×%d (%s) trains beside the "
                "capsules, weight %g (%s; training only, not in the saved model; --backbone-loss 0 turns it off)",
                cfg.backbone_loss_grid,
                cfg.backbone_loss_grid,
                plan.reasons["backbone_loss_grid"],
                cfg.backbone_loss,
                plan.reasons["backbone_loss"],
            )
        if cfg.optimizer in ("adam", "adamw") and cfg.lr > ADAM_LR_WARNING:
            log.warning(
                "--lr %g is an SGD-sized step; %s usually diverges or stalls above %g (its default is %g): "
                "drop --lr, or give --optimizer sgd",
                cfg.lr,
                cfg.optimizer,
                ADAM_LR_WARNING,
                DEFAULT_LR[cfg.optimizer],
            )
    if "few_images" in plan.reasons and d.main:
        log.info("many classes from few images: %s (docs/own-data.md)", plan.reasons["few_images"])
    if "stem_pool" in plan.reasons and d.main:
        log.info("stem: %s", plan.reasons["stem_pool"])
    if "init_classes" in plan.reasons and d.main:
        log.info("class capsule init: %s", plan.reasons["init_classes"])
    if config.backbone == "conv" and d.main:
        n = config.backbone_blocks
        blocks = f" + {n} residual block{'s' * (n > 1)}" if n else ""
        log.info("backbone: %d conv layers%s (%s)", config.backbone_layers, blocks, plan.reasons["backbone_depth"])
    if config.has_routing and d.main:
        log.info("capsule poses: %s (%s)", config.pose, plan.reasons["pose"])
        log.info("class capsule norm: %s (%s)", config.class_norm, plan.reasons["class_norm"])
    if plan.manifest is not None and not cfg.init and d.main:
        log.info("mean/std from the %d training images: %s / %s", len(plan.data.train), config.mean, config.std)
    if d.main:
        log.info("precision: %s (%s)", AmpCandidate(cfg.amp, cfg.channels_last).label(), plan.reasons["amp"])


def plan_run(cfg: TrainConfig, resume: str | Path | None, d: Dist, device: torch.device) -> Plan:
    """Every choice of a run resolved from ``cfg`` and its data (``--resume``: as recorded), with the data loaded;
    nothing built yet. A ``--data`` or ``--init`` that cannot work fails before the run folder exists."""
    check_data_exists(cfg.data)  # before the run folder exists: a typo leaves nothing behind
    given, manifest = cfg, read_manifest(cfg)
    multi_label = manifest is not None and manifest.task == "multi_label"
    multi_label_capsules = multi_label and get_config(cfg.model, **cfg.overrides).has_routing
    cfg = resolve_recipe(cfg, manifest is not None, multi_label_capsules)  # recorded in train_config.json as resolved
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {d.world}")
    cfg, norm_reason = class_norm(cfg, manifest, resume)
    cfg, depth_reason = backbone_depth(cfg, manifest, resume)
    config = model_config(cfg, manifest)
    dataset = config.extra["data"]["dataset"]
    if cfg.init and resume is None:
        check_init(cfg.init, config.labels, cfg.label_map)
    reasons = recipe_reasons(given, cfg, manifest is not None, multi_label_capsules, resume)
    cfg, no_backbone_loss = backbone_loss(cfg, config, given)
    reasons["backbone_loss"] = no_backbone_loss or reasons["backbone_loss"]
    cfg, reasons["label_smoothing"] = label_smoothing(cfg, config, manifest is not None, resume)
    cfg, few = few_images(cfg, given, manifest, resume)
    if few:
        config = model_config(cfg, manifest)
        depth_reason = few.pop("backbone_depth", depth_reason)
        reasons.update(few)
    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if resume is None:
            start_afresh(out)
    skipped, test_split = 0, None
    if manifest is not None:
        data, test_split, skipped = load_own_training(manifest, config, out, d, device)
        cfg, config, found = from_the_images(cfg, manifest, data.train, resume, d)
        reasons.update(found)
        if "stem_pool" in found:
            cfg, heavier = pooled_stem_backbone_loss(cfg, given)
            reasons["backbone_loss"] = heavier or reasons["backbone_loss"]
        cfg, mirrored = few_images_augment(cfg, config, manifest, data.train, resume)
        reasons.update(mirrored)
    else:
        data = load_training(dataset, cfg.data, val_size_of(cfg, own=False), cfg.epoch_size, device)
    cfg, fitted = fit_batch(cfg, data, given.batch_size is not None, d)
    reasons["batch_size"] = fitted or reasons["batch_size"]
    if cfg.augment is None:  # recorded in train_config.json (and every checkpoint) as resolved
        cfg = dataclasses.replace(cfg, augment=default_augment(dataset))
        reasons["augment"] = augment_reason(dataset)
    reasons.setdefault("augment", "given")
    given_weights = {"class_weights", "class_grid"} & cfg.overrides.keys()
    reasons.setdefault("class_weights", "given" if given_weights else "the model config's")
    reasons.setdefault(
        "pose", RESUMED if resume is not None else "given" if "pose" in given.overrides else "the model config's"
    )
    reasons["class_norm"] = norm_reason
    reasons["backbone_depth"] = depth_reason
    cfg, reasons["backbone_loss_grid"] = backbone_loss_grid(cfg, config, resume)
    chosen, why = run_precision(cfg, config, d, device)
    cfg = dataclasses.replace(cfg, amp=chosen.amp, channels_last=chosen.channels_last)
    reasons["amp"] = RESUMED if resume is not None else why
    reasons.setdefault("mean_std", "kept with --init (the model config's)" if cfg.init else "the model config's")
    if config.stem_pool > 1 and "stem_pool" not in cfg.overrides:
        reasons["stem_pool"] = (
            f"--image-size {config.image_size}: a max-pool by {config.stem_pool} after the first layer keeps the "
            f"capsule grid of a {config.image_size // config.stem_pool}-pixel input (--set stem_pool=1 lets it grow)"
        )
    if config.init_classes is not None and "init_classes" not in cfg.overrides:
        reasons["init_classes"] = (
            f"{len(config.labels)} classes: the class capsule transforms start at the authors' init for "
            f"{config.init_classes} (--set init_classes={len(config.labels)} for theirs)"
        )
    plan = Plan(cfg, config, reasons, data, manifest, test_split, skipped)
    log_choices(plan, d)
    return plan
