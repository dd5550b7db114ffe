"""``capserve serve [MODEL] [--port N]``: the HTTP service of an installed capserve, with no checkout needed.

It checks the model and settings first (a mistake is one line and exit status 2, before any server starts), then
replaces itself with the real ``bentoml serve capserve.serving.service:CapsuleService``: the same service as ``make
serve``, its exit status (3 when a model cannot load) and signals (Ctrl-C, SIGTERM) passing straight through.

``bentoml serve`` alone cannot: it takes a service import path, not a model, and finds a bad setting or a missing
model only once its process manager and workers have started.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from collections.abc import Mapping

from capserve.errors import ConfigurationError, UsageError

__all__ = ["SERVICE", "add_arguments", "check", "command", "run", "server_environment"]

SERVICE = "capserve.serving.service:CapsuleService"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model",
        nargs="?",
        help="the single-label model: a folder (config.json, model.onnx), an exported "
        ".onnx file, or NAME[:VERSION] in BentoML's model store (default: $CAPSERVE_MODEL, else "
        "models/cifar10)",
    )
    p.add_argument(
        "--multilabel-model",
        help="the multi-label model for /multilabel, given like MODEL (default: "
        "$CAPSERVE_MULTILABEL_MODEL; none when MODEL is given, else models/multimnist)",
    )
    p.add_argument("--port", type=int, default=3000, help="default 3000")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0: every interface)")
    p.add_argument("--dry-run", action="store_true", help="check the models and settings, print the command, exit")


def server_environment(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, str]:
    """The environment the server runs with: MODEL and --multilabel-model written into ``CAPSERVE_*``; a MODEL given
    alone serves that model alone (no /multilabel) rather than a default multi-label model that may not exist."""
    out = dict(env)
    if args.model:
        out["CAPSERVE_MODEL"] = args.model
        out.setdefault("CAPSERVE_MULTILABEL_MODEL", "none")
    if args.multilabel_model:
        out["CAPSERVE_MULTILABEL_MODEL"] = args.multilabel_model
    return out


def check(env: Mapping[str, str]) -> None:
    """Fail in one line, before a server starts, on bad settings or a model that is neither a folder, a file nor in
    BentoML's model store (loading it is the server's: it exits with status 3 when that fails)."""
    from capserve.pipeline.models import resolve_model
    from capserve.serving.settings import Settings

    try:
        settings = Settings.from_env(env)
    except ConfigurationError as e:
        raise UsageError(str(e)) from None
    specs = [("MODEL", settings.model)]
    if settings.multilabel_model.lower() != "none":
        specs.append(("--multilabel-model", settings.multilabel_model))
    for what, spec in specs:
        if not resolve_model(spec).path.exists():
            raise UsageError(
                f"{what} {spec!r} is not a file, a folder (working directory {os.getcwd()}) or a model "
                "in BentoML's model store: give a folder made by `capserve train`, an exported .onnx "
                "file, or a NAME[:VERSION] saved with `capserve export bentoml DIR --name NAME`"
                + ("; or --multilabel-model none" if what != "MODEL" else "")
            )


def command(args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "bentoml", "serve", SERVICE, "--host", args.host, "--port", str(args.port)]


def run(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("bentoml") is None:
        raise UsageError("capserve serve needs BentoML: pip install 'capserve[serve]' (or capserve[gpu])")
    if not 0 < args.port < 65536:
        raise UsageError(f"--port must be in 1..65535, got {args.port}")
    env = server_environment(args, os.environ)
    # resolving a store tag reads BENTOML_HOME: let it see the same environment the server will
    previous = dict(os.environ)
    os.environ.update(env)
    try:
        check(env)
    finally:
        os.environ.clear()
        os.environ.update(previous)
    cmd = command(args)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, cmd, env)  # the server's exit status and signals become this command's
    return 0  # not reached
