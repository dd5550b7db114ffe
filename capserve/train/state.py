"""A run's state on disk: resumable checkpoints (model, optimizer, scaler, counters) and ``--init`` from another
model directory."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file
from torch import Tensor

from capserve.configs import get_config, list_models
from capserve.files import recover_directory, replacing_directory
from capserve.model.checkpoint import read_config, save_model, save_tensors
from capserve.model.factory import Model
from capserve.model.factory import load as load_model
from capserve.train.config import TrainConfig

__all__ = [
    "check_init",
    "init_architecture",
    "init_from",
    "load_state",
    "parse_label_map",
    "provenance",
    "renamed_labels",
    "save_state",
]

log = logging.getLogger(__name__)

BACKBONE_HEAD = "backbone_head"  # its tensors' prefix in last/optimizer.safetensors


def save_state(
    directory: Path,
    model: Model,
    opt: torch.optim.Optimizer,
    scaler: Any,
    state: dict,
    cfg: TrainConfig,
    backbone_head: torch.nn.Module | None = None,
) -> None:
    """``last/``: model dir + optimizer tensors (safetensors) + everything else as JSON. No pickle. Written aside and
    swapped in whole (``replacing_directory``): a run killed while saving resumes from the ``last/`` before. A
    ``--backbone-loss`` classifier's weights go with the optimizer's tensors, never into the model."""
    with replacing_directory(directory) as tmp:
        save_model(model, tmp, extra={"training": provenance(cfg, state)})
        tensors: dict[str, Tensor] = {}
        meta: dict[str, Any] = {}
        sd = opt.state_dict()
        for idx, entries in sd["state"].items():
            for key, value in entries.items():
                if isinstance(value, Tensor):
                    tensors[f"state.{idx}.{key}"] = value.detach().cpu().contiguous()
                else:
                    meta[f"{idx}.{key}"] = value
        if backbone_head is not None:
            for key, value in backbone_head.state_dict().items():
                tensors[f"{BACKBONE_HEAD}.{key}"] = value.detach().cpu().contiguous()
        tensors["rng.cpu"] = torch.get_rng_state()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng.cuda.{i}"] = s
        save_tensors(tensors, tmp / "optimizer.safetensors")
        trainer = {
            "train_config": dataclasses.asdict(cfg),
            "state": state,
            "param_groups": sd["param_groups"],
            "optimizer_scalars": meta,
            "scaler": scaler.state_dict() if scaler is not None else None,
        }
        (tmp / "trainer.json").write_text(json.dumps(trainer, indent=1) + "\n")


def load_state(
    directory: Path,
    model: Model,
    opt: torch.optim.Optimizer,
    scaler: Any,
    device: torch.device,
    backbone_head: torch.nn.Module | None = None,
) -> dict:
    """Everything ``save_state`` wrote into ``directory``, loaded in place; returns the trainer's counters."""
    recover_directory(directory)
    trainer = json.loads((directory / "trainer.json").read_text())
    weights = load_model(directory, device)
    model.load_state_dict(weights.state_dict())
    tensors = load_file(str(directory / "optimizer.safetensors"))
    if backbone_head is not None:
        prefix = f"{BACKBONE_HEAD}."
        head = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
        if not head:
            raise ValueError(f"{directory} holds no backbone classifier, and its run trained with one")
        backbone_head.load_state_dict(head)
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


def provenance(cfg: TrainConfig, state: dict) -> dict:
    return {
        "recipe": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("data", "out", "device")},
        "epoch": state["epoch"],
        "step": state["step"],
    }


def parse_label_map(items: list[str] | None) -> dict[str, str]:
    """``--label-map OLD=NEW`` (repeatable) → {OLD: NEW}; labels may hold spaces (the first ``=`` splits)."""
    out: dict[str, str] = {}
    for item in items or []:
        old, sep, new = item.partition("=")
        old, new = old.strip(), new.strip()
        if not sep or not old or not new:
            raise ValueError(
                f"--label-map takes OLD=NEW (a label of the --init model, then its name in your data), got {item!r}"
            )
        if old in out:
            raise ValueError(f"--label-map names {old!r} twice")
        out[old] = new
    return out


def _class_dim(leaf: str, routing: bool, ndim: int) -> int | None:
    """The dimension of a class-layer tensor that indexes the classes (None: shared by every class).

    Class capsules: ``weight`` (N, J, X, Y), EM's ``beta_v``/``beta_a`` (J,) and a joint LayerNorm's ``norm.weight``
    and ``norm.bias`` (J, D) (``class_norm="joint"``); a LayerNorm of each pose alone (D,) is shared. A CNN's
    classifier: ``weight`` (C, F) and ``bias`` (C,)."""
    if not routing:
        return 0
    if leaf in ("norm.weight", "norm.bias"):
        return 0 if ndim == 2 else None
    return {"weight": 1, "beta_v": 0, "beta_a": 0}.get(leaf)


def renamed_labels(
    source_labels: Sequence[str], labels: Sequence[str], directory: str | Path, label_map: dict[str, str] | None = None
) -> list[str]:
    """The labels of the ``--init`` model in ``directory`` after ``label_map``'s renames ({OLD: NEW}), checked
    against the data's ``labels``: every OLD is its label, every NEW one of the data's, and no two classes share
    one."""
    label_map = dict(label_map or {})
    unknown = [old for old in label_map if old not in source_labels]
    if unknown:
        raise ValueError(
            f"--label-map: {', '.join(map(repr, unknown))} is not a label of {directory} (its labels: "
            f"{', '.join(source_labels)})"
        )
    absent = [new for new in label_map.values() if new not in labels]
    if absent:
        raise ValueError(
            f"--label-map: {', '.join(map(repr, absent))} is not a label of your data (its labels: {', '.join(labels)})"
        )
    renamed = [label_map.get(label, label) for label in source_labels]
    clash = sorted({label for label in renamed if renamed.count(label) > 1})
    if clash:
        raise ValueError(f"--label-map gives two classes of {directory} the label {', '.join(map(repr, clash))}")
    return renamed


def check_init(directory: str | Path, labels: Sequence[str], label_map: dict[str, str] | None = None) -> None:
    """Fail before anything is built or written for an ``--init`` that is no model folder (``CheckpointError``) or a
    ``--label-map`` that does not fit it and the data's ``labels``."""
    renamed_labels(read_config(directory).labels, labels, directory, label_map)


def _class_layer(model: Model) -> str:
    """The prefix of the layer whose outputs are the classes: the class capsules, or a CNN's linear classifier."""
    return f"capsules.{len(model.capsules) - 1}." if model.config.has_routing else "classifier."


def _match_tensors(
    model: Model, weights: dict[str, Tensor], pairs: list[tuple[int, int]], same_classes: bool
) -> tuple[dict[str, Tensor], list[str], list[str]]:
    """The tensors of ``weights`` that fit ``model``: (name → tensor to load, names loaded for the kept classes only,
    names left as initialised). ``pairs``: (target class, source class) for each label both models have."""
    class_layer, routing = _class_layer(model), model.config.has_routing
    loaded, partial, new = {}, [], []
    for name, tensor in model.state_dict().items():
        match = weights.get(name)
        dim = _class_dim(name[len(class_layer) :], routing, tensor.ndim) if name.startswith(class_layer) else None
        if match is None:
            new.append(name)
        elif dim is None or same_classes:
            if match.shape == tensor.shape:
                loaded[name] = match
            else:
                new.append(name)
        elif pairs and _drop(match.shape, dim) == _drop(tensor.shape, dim):
            merged = tensor.detach().clone()  # the new classes keep their fresh initialisation
            for j, i in pairs:
                merged.select(dim, j).copy_(match.select(dim, i))
            loaded[name] = merged
            partial.append(name)
        else:
            new.append(name)
    return loaded, partial, new


def init_from(model: Model, directory: str | Path, label_map: dict[str, str] | None = None) -> dict[str, Any]:
    """Load every tensor of the model folder ``directory`` whose name and shape match ``model``'s (fine-tuning).

    In the class layer (class capsules, or a CNN's classifier), each class whose label the source model also has
    keeps its trained slice, wherever it sits; only labels new to it start afresh. ``label_map`` renames source
    labels first ({OLD: NEW}: a class renamed in the data keeps what it learnt).
    Returns ``{"from", "loaded", "new", "partial", "kept_labels", "new_labels"}``: tensor names loaded whole, left
    as initialised, and loaded for the kept classes only; the labels that kept their class capsules, and the rest.
    """
    directory = Path(directory)
    source_model = load_model(directory)  # a clear CheckpointError for a folder that is not a model
    source, labels = source_model.config, model.config.labels
    renamed = renamed_labels(source.labels, labels, directory, label_map)
    # target class j ← source class i, for every label both models have (after the renames)
    pairs = [(j, renamed.index(label)) for j, label in enumerate(labels) if label in renamed]
    same_classes = renamed == list(labels)
    loaded, partial, new = _match_tensors(model, source_model.state_dict(), pairs, same_classes)
    model.load_state_dict(loaded, strict=False)
    kept = [labels[j] for j, _ in pairs] if partial or same_classes else []
    fresh = [label for label in labels if label not in kept]
    log.info(
        "--init %s (%s): loaded %d tensors (%s values), new %d%s",
        directory,
        source.name,
        len(loaded),
        f"{sum(t.numel() for t in loaded.values()):,}",
        len(new),
        f": {', '.join(new)}" if new else "",
    )
    if not same_classes:
        log.info(
            "class layer (%s*): %d labels keep what %s learnt%s; %d start afresh%s",
            _class_layer(model),
            len(kept),
            directory,
            f" ({', '.join(kept)})" if kept else "",
            len(fresh),
            f" ({', '.join(fresh)})" if fresh else "",
        )
    return {
        "from": str(directory),
        "loaded": sorted(set(loaded) - set(partial)),
        "new": new,
        "partial": partial,
        "kept_labels": kept,
        "new_labels": fresh,
    }


def _drop(shape: torch.Size, dim: int) -> tuple[int, ...]:
    return tuple(n for k, n in enumerate(shape) if k != dim)


def init_architecture(directory: str | Path) -> tuple[str, dict[str, Any]]:
    """The named config and the overrides that rebuild the architecture of the model in ``directory``."""
    source = read_config(directory)
    if source.name not in list_models():
        raise ValueError(f"{directory} holds a {source.name!r} model, not a named config: pass --model too")
    named = get_config(source.name).to_dict()
    skip = {"name", "labels", "task", "thresholds", "extra"}  # these come from the data, not the architecture
    return source.name, {k: v for k, v in source.to_dict().items() if k not in skip and v != named[k]}
