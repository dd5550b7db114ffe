"""A run's state on disk: resumable checkpoints (model, optimizer, scaler, counters) and ``--init`` from another
model directory."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from capserve.configs import get_config, list_models
from capserve.model.checkpoint import read_config, save_model
from capserve.model.factory import Model
from capserve.model.factory import load as load_model
from capserve.train.config import TrainConfig

log = logging.getLogger(__name__)


def _save_state(directory: Path, model: Model, opt: torch.optim.Optimizer, scaler: Any, state: dict,
                cfg: TrainConfig) -> None:  # fmt: skip
    """``last/``: model dir + optimizer tensors (safetensors) + everything else as JSON. No pickle."""
    tmp = directory.with_name(directory.name + ".tmp")
    save_model(model, tmp, extra={"training": _provenance(cfg, state)})
    tensors: dict[str, Tensor] = {}
    meta: dict[str, Any] = {}
    sd = opt.state_dict()
    for idx, entries in sd["state"].items():
        for key, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
            else:
                meta[f"{idx}.{key}"] = value
    tensors["rng.cpu"] = torch.get_rng_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng.cuda.{i}"] = s
    save_file(tensors, str(tmp / "optimizer.safetensors"))
    trainer = {"train_config": dataclasses.asdict(cfg), "state": state, "param_groups": sd["param_groups"],
               "optimizer_scalars": meta, "scaler": scaler.state_dict() if scaler is not None else None}  # fmt: skip
    (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1) + "\n")
    if directory.exists():
        for f in directory.iterdir():
            f.unlink()
        directory.rmdir()
    tmp.rename(directory)


def _load_state(directory: Path, model: Model, opt: torch.optim.Optimizer, scaler: Any, device: torch.device) -> dict:
    trainer = json.loads((directory / "trainer.json").read_text())
    weights = load_model(directory, device)
    model.load_state_dict(weights.state_dict())
    tensors = load_file(str(directory / "optimizer.safetensors"))
    state: dict[int, dict[str, Any]] = {}
    for key, value in tensors.items():
        if key.startswith("state."):
            _, idx, name = key.split(".", 2)
            state.setdefault(int(idx), {})[name] = value.to(device)
    for key, value in trainer["optimizer_scalars"].items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = value
    opt.load_state_dict({"state": state, "param_groups": trainer["param_groups"]})
    if scaler is not None and trainer["scaler"]:
        scaler.load_state_dict(trainer["scaler"])
    torch.set_rng_state(tensors["rng.cpu"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("rng.cuda."))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    return trainer["state"]


def _provenance(cfg: TrainConfig, state: dict) -> dict:
    return {"recipe": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("data", "out", "device")},
            "epoch": state["epoch"], "step": state["step"]}  # fmt: skip


def init_from(model: Model, directory: str | Path) -> dict[str, Any]:
    """Load every tensor of the model folder ``directory`` whose name and shape match ``model``'s (fine-tuning).

    The class layer (class capsules, or a CNN's classifier) starts afresh when the labels differ, even where its
    shapes happen to match.
    Returns ``{"from", "loaded", "new"}`` with the tensor names.
    """
    directory = Path(directory)
    source_model = load_model(directory)  # a clear CheckpointError for a folder that is not a model
    source, weights = source_model.config, source_model.state_dict()
    # the layer whose outputs are the classes: the class capsules, or a CNN's linear classifier
    class_layer = f"capsules.{len(model.capsules) - 1}." if model.config.has_routing else "classifier."
    relabelled = tuple(source.labels) != tuple(model.config.labels)
    loaded, new = {}, []
    for name, tensor in model.state_dict().items():
        match = weights.get(name)
        if match is not None and match.shape == tensor.shape and not (relabelled and name.startswith(class_layer)):
            loaded[name] = match
        else:
            new.append(name)
    model.load_state_dict(loaded, strict=False)
    values = sum(t.numel() for t in loaded.values())
    log.info("--init %s (%s): loaded %d tensors (%s values), new %d%s", directory, source.name, len(loaded),
             f"{values:,}", len(new), f": {', '.join(new)}" if new else "")  # fmt: skip
    if relabelled:
        log.info("labels differ from %s's: the class layer (%s*) starts afresh", directory, class_layer)
    return {"from": str(directory), "loaded": sorted(loaded), "new": new}


def init_architecture(directory: str | Path) -> tuple[str, dict[str, Any]]:
    """The named config and the overrides that rebuild the architecture of the model in ``directory``."""
    source = read_config(directory)
    if source.name not in list_models():
        raise ValueError(f"{directory} holds a {source.name!r} model, not a named config: pass --model too")
    named = get_config(source.name).to_dict()
    skip = {"name", "labels", "task", "thresholds", "extra"}  # these come from the data, not the architecture
    return source.name, {k: v for k, v in source.to_dict().items() if k not in skip and v != named[k]}
