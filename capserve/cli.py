"""capserve: capsule networks with inverted dot-product attention routing, from training to an HTTP service.

Train a model on CIFAR-10, MultiMNIST or your own images, evaluate it per routing iteration count, export it to
ONNX or TensorRT, check the export against PyTorch, and serve it over HTTP (BentoML). `capserve COMMAND --help`
says more about each command.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from typing import TYPE_CHECKING

from capserve.errors import UsageError

if TYPE_CHECKING:
    from capserve.configs import ModelConfig

# subcommand → (module, help[, its functions' prefix]); a module's ``add_arguments`` and ``run`` (or, with a
# prefix P, ``add_P_arguments`` and ``run_P``) are imported only when their command runs
COMMANDS = {
    "train": ("capserve.train.cli", "train a model (single GPU/CPU, or torchrun for DDP)"),
    "evaluate": ("capserve.evaluate.cli", "accuracy of a checkpoint on a test set, per routing iteration count"),
    "export": ("capserve.export.cli", "export a checkpoint to ONNX, or an ONNX file to a TensorRT engine"),
    "verify": ("capserve.export.cli", "compare an exported artifact with eager PyTorch", "verify"),
    "serve": ("capserve.serving.cli", "serve a model over HTTP (bentoml serve of capserve's service)"),
    "tune": ("capserve.serving.tune", "measure the serving choices on this machine; serve then uses them"),
    "predict": ("capserve.predict.cli", "the service's answers for files, folders or CSVs, without a server"),
    "familiarity": (
        "capserve.evaluate.familiar",
        "fit what a model folder calls familiar on its data: answers then say when an image is unlike it",
    ),
    "models": ("capserve.cli", "list the named model configurations with their parameter counts"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:  # the `models` command
    pass


def parameter_count(config: ModelConfig) -> int:
    """Trainable parameters of the model ``config`` describes, counted on a model built on the meta device (shapes
    only: no memory, no initialisation)."""
    import torch

    from capserve.model.factory import build_model

    with torch.device("meta"):
        model = build_model(config)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def kind(config: ModelConfig) -> str:
    """What follows the backbone: the routing algorithm and poses, or the CNN's read-out."""
    if config.has_routing:
        return f"{config.routing_algorithm} routing, {config.pose} poses"
    return f"CNN, {config.head} head"


def run(args: argparse.Namespace) -> int:
    from capserve.configs import MODELS

    print(f"{'name':<30}{'task':<14}{'classes':>7}  {'model':<34}{'backbone':<10}{'parameters':>12}")
    for name, config in sorted(MODELS.items()):
        print(
            f"{name:<30}{config.task:<14}{config.num_classes:>7}  {kind(config):<34}{config.backbone:<10}"
            f"{parameter_count(config):>12,}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="capserve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else argv
    parsers = {}
    for name, (module, help_text, *prefix) in COMMANDS.items():
        parsers[name] = p = sub.add_parser(name, help=help_text, description=help_text)
        # only the chosen command's module is imported (keeps `capserve models` free of onnx/tensorrt)
        if name in argv:
            add = f"add_{prefix[0]}_arguments" if prefix else "add_arguments"
            getattr(importlib.import_module(module), add)(p)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the command's own parser, with its usage (the top-level one would show capserve's)
        parsers[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        module, _, *prefix = COMMANDS[args.command]
        run = getattr(importlib.import_module(module), f"run_{prefix[0]}" if prefix else "run")
        return int(run(args) or 0)
    except (UsageError, ValueError, FileNotFoundError, TypeError) as e:
        print(f"capserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
