"""A run's plan: every choice that depends on the data, made once, before anything is built (``plan_run``).

The recipe (optimizer, lr, weight decay, schedule, label smoothing), the batch size, the augmentation, the mean/std,
the class capsule transforms, and why each was chosen; the model config the run builds its model from, once
(``Plan.build_model``); and the data, decoded at that model's input. ``train_config.json`` records the resolved
``TrainConfig`` with the reasons (``Plan.record``), and ``--resume`` rebuilds the same model from it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from capserve.configs import ModelConfig, get_config
from capserve.data.augment import augment_reason, default_augment
from capserve.data.builtin import Data, dataset_for, load_training
from capserve.data.cache import CACHE_FILE, build_cache
from capserve.data.own import InputSize, Manifest, check_data_exists, check_training, is_own_data, scan, with_validation
from capserve.data.placement import Placement, measure_placement
from capserve.data.preprocess import data_mean_std
from capserve.data.splits import Split
from capserve.files import read_cached, write_whole
from capserve.model.checkpoint import read_config
from capserve.model.factory import Model, build_model
from capserve.train import rules
from capserve.train.amp import AmpCandidate, run_precision
from capserve.train.class_layer import choose_class_layer, chooses_class_weights
from capserve.train.config import DEFAULT_LR, DEFAULT_VAL_SIZE, TrainConfig, resolve_recipe
from capserve.train.distributed import Dist
from capserve.train.few_images import few_images
from capserve.train.state import check_init
from capserve.train.stem import pooled_stem, stem_pool

__all__ = [
    "RESUMED",
    "RESUMED_CHOICES",
    "TRAIN_CONFIG",
    "Plan",
    "model_config",
    "new_plan",
    "plan_run",
    "resumed_plan",
    "val_size_of",
]

log = logging.getLogger(__name__)

TRAIN_CONFIG = "train_config.json"

RESUMED = "as the run resumed recorded it"  # every choice of a resumed run (``resumed_plan``)

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
        """``train_config.json``: the resolved ``TrainConfig``, the input its images are decoded at (``input_size``:
        channels, height, width) and, under ``reasons``, why each choice was made."""
        size = [self.config.in_channels, self.config.image_size, self.config.image_size]
        recorded = {**dataclasses.asdict(self.cfg), "input_size": size, "reasons": self.reasons}
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
    ``INIT_CLASSES`` when there are more (docs/research/class-capsules.md); the config's otherwise, with
    ``--init`` (its weights) and as given with ``--set init_classes=N``."""
    if "init_classes" in cfg.overrides or cfg.init or not config.has_routing or config.routing_algorithm != "attention":
        return config.init_classes
    return INIT_CLASSES if classes > INIT_CLASSES else None


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


def from_the_images(
    cfg: TrainConfig, given: TrainConfig, manifest: Manifest, train: Split, placement: Callable[[], Placement], d: Dist
) -> tuple[TrainConfig, ModelConfig, dict[str, str]]:
    """The choices a user's decoded training images make: the recipes for few pictures a class
    (``capserve.train.few_images``), the class capsule layer (a run from scratch of a model that can take either:
    ``capserve.train.class_layer``), on small things anywhere its stem (``capserve.train.stem``), and the mean/std
    (unless ``--init`` keeps its own). ``placement`` measures where things lie in ``train``, once, for whichever
    rule asks first."""
    cfg, reasons = few_images(cfg, given, manifest, train, placement)
    config = model_config(cfg, manifest)
    if chooses_class_weights(cfg, config):
        chosen, found = choose_class_layer(placement(), manifest.task, config.spatial_sizes[-1], cfg.overrides)
        reasons.update(found)
        # recorded in train_config.json's overrides, so that --resume rebuilds the same model
        cfg = dataclasses.replace(cfg, overrides={**cfg.overrides, **chosen})
        cfg, stem = pooled_stem(placement(), cfg, given, config)
        reasons.update(stem)
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
        size = f"{config.in_channels}×{config.image_size}×{config.image_size}"
        log.info("input: %s (%s)", size, plan.reasons["input_size"])
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
    """Every choice of a run resolved from ``cfg`` and its data, with the data loaded; nothing built yet. A new run
    decides (``new_plan``); a resumed one reads what it decided from its record (``resumed_plan``). A ``--data`` or
    ``--init`` that cannot work fails before the run folder exists."""
    check_data_exists(cfg.data)  # before the run folder exists: a typo leaves nothing behind
    if cfg.batch_size is not None and cfg.batch_size % d.world:  # (a new run's default batch: checked resolved)
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {d.world}")
    plan = new_plan(cfg, d, device) if resume is None else resumed_plan(cfg, d, device)
    log_choices(plan, d)
    return plan


def new_plan(cfg: TrainConfig, d: Dist, device: torch.device) -> Plan:
    """A new run's choices, each rule (``capserve.train.rules``, then those the decoded images make,
    ``from_the_images``) called once, in order."""
    given, manifest = cfg, read_manifest(cfg)
    own = manifest is not None
    multi_label_capsules = own and manifest.task == "multi_label" and get_config(cfg.model, **cfg.overrides).has_routing
    cfg = resolve_recipe(cfg, own, multi_label_capsules)  # recorded in train_config.json as resolved
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {d.world}")
    cfg, norm_reason = rules.class_norm(cfg, manifest)
    cfg, depth_reason = rules.backbone_depth(cfg, manifest)
    config = model_config(cfg, manifest)
    if cfg.init:
        check_init(cfg.init, config.labels, cfg.label_map)
    reasons = rules.recipe_reasons(given, cfg, own, multi_label_capsules)
    reasons["input_size"] = rules.input_size(cfg, config, manifest)
    cfg, no_backbone_loss = rules.backbone_loss(cfg, config, given)
    reasons["backbone_loss"] = no_backbone_loss or reasons["backbone_loss"]
    cfg, reasons["label_smoothing"] = rules.label_smoothing(cfg, config, own)
    out = Path(cfg.out)
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        start_afresh(out)
    skipped, test_split = 0, None
    if manifest is not None:
        data, test_split, skipped = load_own_training(manifest, config, out, d, device)
        train = data.train
        placement = functools.cache(functools.partial(measure_placement, train.images, train.targets, cfg.seed))
        cfg, config, found = from_the_images(cfg, given, manifest, train, placement, d)
        depth_reason = found.pop("backbone_depth", depth_reason)
        reasons.update(found)
    else:
        data = load_training(
            config.extra["data"]["dataset"], cfg.data, val_size_of(cfg, own=False), cfg.epoch_size, device
        )
    cfg, fitted = rules.fit_batch(cfg, data, given.batch_size is not None, d)
    reasons["batch_size"] = fitted or reasons["batch_size"]
    if cfg.augment is None:  # recorded in train_config.json (and every checkpoint) as resolved
        dataset = config.extra["data"]["dataset"]
        cfg = dataclasses.replace(cfg, augment=default_augment(dataset))
        reasons["augment"] = augment_reason(dataset)
    reasons.setdefault("augment", "given")
    given_weights = {"class_weights", "class_grid"} & cfg.overrides.keys()
    reasons.setdefault("class_weights", "given" if given_weights else "the model config's")
    reasons.setdefault("pose", "given" if "pose" in given.overrides else "the model config's")
    reasons["class_norm"] = norm_reason
    reasons["backbone_depth"] = depth_reason
    cfg, reasons["backbone_loss_grid"] = rules.backbone_loss_grid(cfg, config)
    chosen, reasons["amp"] = run_precision(cfg, config, d, device)
    cfg = dataclasses.replace(cfg, amp=chosen.amp, channels_last=chosen.channels_last)
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
    return Plan(cfg, config, reasons, data, manifest, test_split, skipped)


# the choices every resumed run's log names (others, such as the stem's, where its record has them)
RESUMED_CHOICES = (
    "optimizer",
    "schedule",
    "batch_size",
    "capsule_lr_scale",
    "backbone_loss",
    "backbone_loss_grid",
    "label_smoothing",
    "augment",
    "input_size",
    "class_weights",
    "pose",
    "class_norm",
    "backbone_depth",
    "mean_std",
    "amp",
)


def resumed_plan(cfg: TrainConfig, d: Dist, device: torch.device) -> Plan:
    """A resumed run's plan, read from its record, in this one place: the ``TrainConfig`` it recorded (``cfg``, from
    ``last/trainer.json``), the model its ``last/`` checkpoint was built as (``last/config.json``: every override,
    the input size and the mean/std), and each choice's reason ``RESUMED`` (those ``train_config.json`` names, and
    ``RESUMED_CHOICES``). Nothing is decided again; only the data is read, at that model's input."""
    out = Path(cfg.out)
    config = read_config(out / "last")
    manifest = read_manifest(cfg)
    if manifest is not None:  # --resume may be given the data where it now lies
        data_record = {**config.extra["data"], "source": str(manifest.source)}
        config = dataclasses.replace(config, extra={**config.extra, "data": data_record})
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    skipped, test_split = 0, None
    if manifest is not None:
        data, test_split, skipped = load_own_training(manifest, config, out, d, device)
    else:
        dataset = config.extra["data"]["dataset"]
        data = load_training(dataset, cfg.data, val_size_of(cfg, own=False), cfg.epoch_size, device)
    recorded = read_cached(out / TRAIN_CONFIG).get("reasons")
    names = (*RESUMED_CHOICES, *(recorded if isinstance(recorded, dict) else ()))
    return Plan(cfg, config, dict.fromkeys(names, RESUMED), data, manifest, test_split, skipped)
