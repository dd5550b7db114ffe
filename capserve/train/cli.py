"""``capserve train``: the command line over ``capserve.train.train``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

from capserve.configs import get_config, list_models
from capserve.data.augment import AUGMENTATIONS
from capserve.data.own import is_own_data
from capserve.data.splits import parse_val_size
from capserve.train.config import AMP_CHOICES, FREEZE, OPTIMIZERS, SCHEDULES, TrainConfig, read_resume_config
from capserve.train.loop import train
from capserve.train.state import init_architecture, parse_label_map

__all__ = ["DEFAULT_OWN_MODEL", "RESUME_TAKES", "add_arguments", "ignored_on_resume", "run"]

log = logging.getLogger(__name__)

# ------------------------------------------------------------------------------------------------- CLI

# the model of a run on your own images without --model: a small capsule network that trains on a CPU
DEFAULT_OWN_MODEL = "cifar10-conv"


def _parse_set(items: list[str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--set expects key=value (a model config field), got {item!r}")
        try:
            overrides[key] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key] = value
    return overrides


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``capserve train``'s flags, in the order ``--help`` lists them."""
    _add_model_and_data(p)
    _add_recipe(p)
    _add_run_controls(p)


def _add_model_and_data(p: argparse.ArgumentParser) -> None:
    """What is trained on what, and where it goes."""
    p.add_argument(
        "--model",
        help=f"model name: {', '.join(list_models())} (default with --init: its model's; for "
        f"your own images: {DEFAULT_OWN_MODEL})",
    )
    p.add_argument(
        "--data",
        help="your images: a folder DIR/<label>/<images> (or DIR/train|val|test/<label>/...) "
        "or a CSV (image,labels[,split]); or the folder with the CIFAR/MNIST files (see capserve.data)",
    )
    p.add_argument(
        "--image-size", type=int, metavar="N", help="your images: the model's input side (default: the config's)"
    )
    p.add_argument(
        "--init",
        metavar="MODEL_DIR",
        help="fine-tune: start from this model folder's weights (every "
        "tensor whose shape matches; in the class layer, every label it also has keeps its class capsule, and only "
        "new labels start afresh)",
    )
    p.add_argument(
        "--label-map",
        action="append",
        metavar="OLD=NEW",
        help="with --init: the --init model's label "
        "OLD is called NEW in your data, and keeps what it learnt (repeat for more)",
    )
    p.add_argument("--name", help="the model's name in served answers and exports (default: the --out folder's name)")
    p.add_argument(
        "--label-separator",
        metavar="SEP",
        help="a CSV's labels column: labels separated by SEP (e.g. ';' "
        "or '|', for label names with spaces; default: spaces)",
    )
    p.add_argument(
        "--augment",
        choices=AUGMENTATIONS,
        help="training augmentation: none, shift (random translation up to 1/8 of the side) or crop-flip "
        "(shift + random mirror, the CIFAR recipe). Default: crop-flip for CIFAR, none for DiverseMultiMNIST and "
        "for your own images (docs/own-data.md says why; give crop-flip for photographs in a long run), but "
        "crop-flip for a capsule network on fewer than 64 of your images a class whose labels follow where "
        "things lie and survive a mirror (both measured); recorded in train_config.json",
    )
    p.add_argument(
        "--freeze",
        choices=FREEZE,
        help="keep the --init model's backbone as it is and train only the capsule layers (faster; small data sets)",
    )
    p.add_argument("--out", help="output folder (checkpoints, metrics, plot)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model config override (JSON)")
    p.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR (its last/ checkpoint)")


def _add_recipe(p: argparse.ArgumentParser) -> None:
    """How long and how it learns: epochs, batch, optimizer, lr, weight decay and schedule."""
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument(
        "--batch-size",
        type=int,
        help="global batch size, all processes together (default: 128 for CIFAR "
        "and DiverseMultiMNIST, 32 for your own images, 16 for a capsule network on your own multi-label images)",
    )
    p.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="auto",
        help="auto (default: sgd for CIFAR and "
        "DiverseMultiMNIST, the authors' recipe; adamw for your own images), sgd (momentum 0.9), adam, "
        "adamw",
    )
    p.add_argument(
        "--lr",
        type=float,
        help="base learning rate (default: 0.1 for sgd, 1e-3 for adam, 2e-3 for adamw; half that for a capsule "
        "network on your own multi-label images, with its batch of 16)",
    )
    p.add_argument(
        "--capsule-lr-scale",
        type=float,
        metavar="K",
        help="a capsule network's capsule layers (primary, routed, read-out) train at K times the backbone's lr "
        "(default 1; 2 helped short runs on many classes, docs/own-data.md)",
    )
    p.add_argument(
        "--backbone-loss",
        type=float,
        metavar="W",
        help="a capsule network's backbone also learns from a linear classifier on its pooled features, its loss "
        "weighted W beside the capsules' (training only: the saved model is the capsule network alone). Default: 1 "
        "for your own images (2 on small things anywhere, with the max-pooled stem), 0 (off) for the built-in data "
        "sets (docs/own-data.md)",
    )
    p.add_argument(
        "--backbone-loss-grid",
        type=int,
        metavar="N",
        help="that classifier reads the backbone's map average-pooled to N×N cells, N at most the map's side. "
        "Default: 4 where the class capsule transforms are per position (the labels follow where things lie), 1 (a "
        "global average) where they are shared (docs/own-data.md)",
    )
    p.add_argument(
        "--label-smoothing",
        type=float,
        metavar="EPS",
        help="single-label cross-entropy against targets smoothed by EPS (1 - EPS on the label, EPS spread over all "
        "classes). Default: 0.1 for a capsule network on your own images, 0 for a CNN and for the built-in data sets; "
        "multi-label data and dynamic or EM routing take none (docs/own-data.md)",
    )
    p.add_argument("--momentum", type=float, help="SGD momentum (default 0.9; Adam and AdamW take none)")
    p.add_argument(
        "--weight-decay",
        type=float,
        help="weight decay (default: 5e-4 for sgd and adam, coupled L2; 5e-2 for adamw, decoupled)",
    )
    p.add_argument(
        "--schedule",
        choices=SCHEDULES,
        help="lr schedule (default: step for CIFAR and DiverseMultiMNIST, onecycle for your own images)",
    )


def _add_run_controls(p: argparse.ArgumentParser) -> None:
    """Precision, limits, validation and test, seed and device."""
    p.add_argument(
        "--amp",
        choices=AMP_CHOICES,
        default="auto",
        help="autocast dtype: auto (default: bf16 where a few measured training steps of the run's model are clearly "
        "faster in bf16 than in fp32 on this CPU or GPU, with channels-last where that is faster still; fp32 on a "
        "CPU without native bf16), off (fp32), bf16 or fp16; recorded in train_config.json",
    )
    p.add_argument(
        "--channels-last",
        action="store_true",
        default=None,
        help="channels-last memory format (default: measured with --amp auto, otherwise off)",
    )
    p.add_argument("--time-budget", type=float, metavar="SECONDS", help="stop cleanly after this much training")
    p.add_argument("--max-steps", type=int, help="stop cleanly after this many steps in this run")
    p.add_argument("--grad-clip", type=float, metavar="NORM")
    p.add_argument(
        "--val-size",
        type=parse_val_size,
        help="validation images carved from the training set where "
        "the data has no val split: a count (500) or a fraction (0.1); default 5000 for CIFAR/MNIST, "
        "0.1 for your own images",
    )
    p.add_argument("--epoch-size", type=int, help="DiverseMultiMNIST: generated images per epoch (default 60000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-batch-size", type=int, default=500)
    p.add_argument("--no-test", action="store_true", help="skip the final test-set evaluation")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:1, ...")


# what --resume takes from its command line; everything else comes from the run's record, fixed for the whole run
RESUME_TAKES = ("resume", "data", "out", "time_budget", "device", "max_steps")


def ignored_on_resume(args: argparse.Namespace) -> list[str]:
    """The flags given beside ``--resume`` that it does not take (``RESUME_TAKES``), as the user typed them."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    given = [name for name, default in defaults.items() if getattr(args, name, default) != default]
    return [f"--{name.replace('_', '-')}" for name in given if name not in RESUME_TAKES]


def run(args: argparse.Namespace) -> int:
    resume = args.resume
    if resume and (ignored := ignored_on_resume(args)):
        log.warning(
            "--resume continues %s with the recipe, epochs and schedule it recorded: ignoring %s (to train on with "
            "other settings, start a new run with --init %s/best)",
            resume,
            ", ".join(ignored),
            resume,
        )
    if resume:
        saved = read_resume_config(resume)
        keep = {"data": args.data, "out": args.out, "time_budget": args.time_budget, "device": args.device}
        cfg = dataclasses.replace(saved, **{k: v for k, v in keep.items() if v not in (None, "auto")})
        if not args.out:
            cfg = dataclasses.replace(
                cfg, out=str(Path(resume) if (Path(resume) / "last").is_dir() else Path(resume).parent)
            )
    else:
        model, overrides = args.model, _parse_set(args.set)
        if args.init and not args.model:
            model, architecture = init_architecture(args.init)
            overrides = {**architecture, **overrides}
        if not model and args.data and is_own_data(args.data):
            model = DEFAULT_OWN_MODEL
        missing = [f"--{k}" for k, v in (("model", model), ("data", args.data), ("out", args.out)) if not v]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (or give --resume DIR)")
        cfg = TrainConfig(
            model=model,
            data=args.data,
            out=args.out,
            overrides=overrides,
            optimizer=args.optimizer,
            epochs=args.epochs,
            batch_size=args.batch_size,
            lr=args.lr,
            capsule_lr_scale=args.capsule_lr_scale,
            backbone_loss=args.backbone_loss,
            backbone_loss_grid=args.backbone_loss_grid,
            label_smoothing=args.label_smoothing,
            momentum=args.momentum,
            weight_decay=args.weight_decay,
            schedule=args.schedule,
            amp=args.amp,
            channels_last=args.channels_last,
            time_budget=args.time_budget,
            max_steps=args.max_steps,
            grad_clip=args.grad_clip,
            val_size=args.val_size,
            epoch_size=args.epoch_size,
            seed=args.seed,
            eval_batch_size=args.eval_batch_size,
            test=not args.no_test,
            device=args.device,
            image_size=args.image_size,
            init=args.init,
            label_map=parse_label_map(args.label_map),
            name=args.name,
            label_separator=args.label_separator,
            augment=args.augment,
            freeze=args.freeze,
        )
        get_config(cfg.model, **cfg.overrides)  # fail early on a bad --set
    if resume:  # a step limit applies to one invocation, never to the resumed one
        cfg = dataclasses.replace(cfg, max_steps=args.max_steps)
    summary = train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 1 if summary.get("learned") is False else 0  # a run that did not learn fails, for scripts and CI
