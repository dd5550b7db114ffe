"""``capserve train``: the authors' recipe by default, shorter schedules, mixed precision, DDP through torchrun.

Defaults reproduce Tsai et al. (2020): SGD lr 0.1, momentum 0.9, weight decay 5e-4, batch 128, 350 epochs, lr ×0.1
at epochs 150 and 250 (``--schedule step``; with other ``--epochs`` the milestones stay at 3/7 and 5/7 of the run),
cross-entropy for single-label data, BCE-with-logits and exact-match accuracy for DiverseMultiMNIST.
``--optimizer adam`` (lr 1e-3 unless ``--lr`` is given) is the optimizer of the dynamic-routing paper (Sabour et al.
2017: Adam with TensorFlow's defaults) and of the EM reproductions, and what the README's short EM and dynamic-routing
runs use.

Unlike the authors (who kept the best *test* epoch), the best epoch is chosen on a validation split carved from the
training set (``--val-size``, fixed seed); the test set is evaluated once, at the end, on the best checkpoint.

Output folder: ``last/`` (every epoch: model + ``optimizer.safetensors`` + ``trainer.json``; ``--resume`` continues
from it exactly), ``best/`` (a plain model directory for ``capserve.load``), ``metrics.jsonl`` (one line per epoch),
``curves.png`` and ``summary.json``.

Schedules: ``step`` (above), ``cosine`` (to 0), ``onecycle`` (linear warm-up from lr/25 over the first 15 %, then
cosine to 0). With ``--time-budget`` the cosine and one-cycle schedules run on max(step progress, wall-clock progress),
so the lr reaches 0 when the budget ends whatever the speed of the machine; the run then stops cleanly and keeps its
best checkpoint. Such a run depends on timing, so only runs without a time budget resume bit-exactly.

Your own images (``--data`` a folder of label folders or a CSV manifest, see ``capserve.userdata``): the model's labels,
task and input size (``--image-size``) come from the data; images are decoded once into a cache in the run folder;
validation is the data's ``val`` split or ``--val-size`` (default 10 %) carved from train; multi-label runs calibrate
per-class thresholds on validation at the end. ``--init MODEL_DIR`` fine-tunes from a trained model.

Multi-GPU / multi-node: ``torchrun --nproc_per_node N -m capserve.cli train ...``. ``--batch-size`` is the global
batch; each of the N processes takes its slice of the same seeded order (NCCL on GPUs, gloo on CPUs).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor

from capserve.checkpoint import load as load_model
from capserve.checkpoint import read_config, save_model
from capserve.configs import ModelConfig, get_config, list_models
from capserve.data import Data, Split, dataset_for, load_test, load_training, parse_val_size, random_crop_flip
from capserve.losses import training_loss
from capserve.model import Model
from capserve.model import build_model as model_from_config
from capserve.preprocess import normalize
from capserve.userdata import (
    CACHE_FILE,
    InputSize,
    Manifest,
    build_cache,
    check_training,
    is_own_data,
    scan,
    with_validation,
)

log = logging.getLogger(__name__)

SCHEDULES = ("step", "cosine", "onecycle")
AMP = {"off": None, "bf16": torch.bfloat16, "fp16": torch.float16}
OPTIMIZERS = ("sgd", "adam")
DEFAULT_LR = {"sgd": 0.1, "adam": 1e-3}
WARMUP = 0.15  # one-cycle warm-up fraction
MILESTONES = (150 / 350, 250 / 350)  # the authors' step epochs as fractions of the run
DEFAULT_VAL_SIZE = {"builtin": 5000, "own": 0.1}  # images for CIFAR/MNIST; a fraction of a user's training images


@dataclass
class TrainConfig:
    """All choices of a training run (saved with every checkpoint, restored by ``--resume``)."""

    model: str
    data: str
    out: str
    overrides: dict[str, Any] = field(default_factory=dict)
    epochs: int = 350
    batch_size: int = 128
    lr: float | None = None  # None: the optimizer's own default (DEFAULT_LR)
    momentum: float | None = None  # SGD only; None: 0.9
    optimizer: str = "sgd"
    weight_decay: float = 5e-4
    schedule: str = "step"
    amp: str = "off"
    channels_last: bool = False
    time_budget: float | None = None
    max_steps: int | None = None
    grad_clip: float | None = None
    val_size: int | float | None = None  # None: DEFAULT_VAL_SIZE
    epoch_size: int | None = None
    seed: int = 0
    eval_batch_size: int = 500
    test: bool = True
    device: str = "auto"
    image_size: int | None = None  # own images: the model's input size (default: the config's)
    init: str | None = None  # a model folder to fine-tune from (shape-matching tensors are loaded)

    def __post_init__(self) -> None:
        if self.model not in list_models():
            raise ValueError(f"unknown model {self.model!r}; choose one of: {', '.join(list_models())}")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be one of {SCHEDULES}, got {self.schedule!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        if self.optimizer == "adam" and self.momentum is not None:
            raise ValueError("--momentum is SGD's; Adam keeps its own moving averages (betas 0.9, 0.999)")
        if self.optimizer == "sgd" and self.momentum is None:
            self.momentum = 0.9
        if self.lr is None:
            self.lr = DEFAULT_LR[self.optimizer]
        if self.amp not in AMP:
            raise ValueError(f"--amp must be one of {tuple(AMP)}, got {self.amp!r}")
        for name in ("epochs", "batch_size", "eval_batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0:
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if self.time_budget is not None and self.time_budget <= 0:
            raise ValueError(f"--time-budget must be positive seconds, got {self.time_budget}")


# ------------------------------------------------------------------------------------------------- schedule


def lr_factor(schedule: str, progress: float, epoch: int, epochs: int) -> float:
    """Multiplier of the base lr at ``progress`` in [0, 1] of the run (``epoch`` counts from 0)."""
    if schedule == "step":
        return 0.1 ** sum(epoch >= round(m * epochs) for m in MILESTONES)
    p = min(max(progress, 0.0), 1.0)
    if schedule == "cosine":
        return 0.5 * (1 + math.cos(math.pi * p))
    if p < WARMUP:  # onecycle
        return 1 / 25 + (1 - 1 / 25) * p / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (p - WARMUP) / (1 - WARMUP)))


# ------------------------------------------------------------------------------------------------- distributed


@dataclass(frozen=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world > 1

    @property
    def main(self) -> bool:
        return self.rank == 0


def setup_distributed(device: str) -> tuple[Dist, torch.device]:
    """Join the torchrun process group if the environment says so; pick this process's device."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    d = Dist(int(os.environ.get("RANK", "0")), world, int(os.environ.get("LOCAL_RANK", "0")))
    cuda = torch.cuda.is_available() if device == "auto" else device.startswith("cuda")
    if device == "auto":
        dev = torch.device(f"cuda:{d.local_rank}" if cuda else "cpu")
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device(f"cuda:{d.local_rank}")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if d.enabled and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    return d, dev


# ------------------------------------------------------------------------------------------------- checkpoints


def make_optimizer(model: Model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """SGD with momentum (the default, the authors'), or Adam; both with L2 weight decay ``cfg.weight_decay``."""
    if cfg.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


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


def read_resume_config(path: str | Path) -> TrainConfig:
    """The ``TrainConfig`` saved in a run folder (or its ``last/``), for ``--resume``."""
    path = Path(path)
    last = path if (path / "trainer.json").is_file() else path / "last"
    if not (last / "trainer.json").is_file():
        raise FileNotFoundError(f"no checkpoint to resume in {path}: expected {path}/last/trainer.json "
                                "(written by `capserve train --out DIR` after each epoch)")  # fmt: skip
    return TrainConfig(**json.loads((last / "trainer.json").read_text())["train_config"])


def _provenance(cfg: TrainConfig, state: dict) -> dict:
    return {"recipe": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("data", "out", "device")},
            "epoch": state["epoch"], "step": state["step"]}  # fmt: skip


# ------------------------------------------------------------------------------------------------- metrics


def improves(acc: float, loss: float | None, best_acc: float | None, best_loss: float | None) -> bool:
    """Whether an epoch with validation ``acc`` and ``loss`` beats the best so far. A tie in accuracy (a slow learner's
    early epochs stay at 0 % exact match) goes to the lower loss, which every loss computes at its end-of-training
    margin when validating, so that epochs compare."""
    if best_acc is None or acc > best_acc:
        return True
    return acc == best_acc and loss is not None and (best_loss is None or loss < best_loss)


def loss_and_hits(logits: Tensor, targets: Tensor, config: ModelConfig, progress: float = 1.0) -> tuple[Tensor, Tensor]:
    """Mean loss (``config``'s routing's own, see ``capserve.losses``) and the number of correct images (top-1, or
    exact match of logits > 0 for multi-label); ``progress`` is the fraction of training done (for schedules)."""
    logits = logits.float()
    multi_label = config.task == "multi_label"
    loss = training_loss(config)(logits, targets, multi_label, progress)
    if multi_label:
        hits = ((logits > 0) == (targets > 0.5)).all(dim=1).sum()
    else:
        hits = (logits.argmax(dim=1) == targets).sum()
    return loss, hits


@torch.no_grad()
def validate(model: Model, split: Split, cfg: TrainConfig, device: torch.device, d: Dist) -> dict[str, float]:
    """Loss and accuracy over ``split``, sharded over the processes of a DDP run."""
    model.eval()
    c = model.config
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss·n, hits, n
    shard = range(d.rank * cfg.eval_batch_size, len(split), d.world * cfg.eval_batch_size)
    for start in shard:
        x = normalize(split.images[start : start + cfg.eval_batch_size].to(device), c.mean, c.std)
        y = split.targets[start : start + cfg.eval_batch_size].to(device)
        if cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        with _autocast(device, cfg.amp):
            logits = model(x)
        loss, hits = loss_and_hits(logits, y, c)
        sums += torch.stack([loss.double() * len(y), hits.double(), torch.tensor(len(y), device=device).double()])
    if d.enabled:
        dist.all_reduce(sums)
    model.train()
    loss, hits, n = sums.tolist()
    return {"loss": loss / max(n, 1), "acc": hits / max(n, 1)}


def _autocast(device: torch.device, amp: str):  # type: ignore[no-untyped-def]
    dtype = AMP[amp]
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else nullcontext()


class Progress:
    """One status line on stderr, rewritten in place on a terminal, printed every ``every`` seconds otherwise."""

    def __init__(self, enabled: bool, stream: Any = None, every: float = 20.0):
        self.enabled, self.stream = enabled, stream or sys.stderr
        self.tty = self.enabled and hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = 0.5 if self.tty else every
        self.last = 0.0

    def due(self) -> bool:
        return self.enabled and time.perf_counter() - self.last >= self.every

    def show(self, text: str) -> None:
        self.last = time.perf_counter()
        self.stream.write(f"\r{text}\033[K" if self.tty else text + "\n")
        self.stream.flush()

    def end(self) -> None:
        if self.tty:
            self.stream.write("\n")
            self.stream.flush()


def plot_curves(metrics: Path, png: Path) -> Path | None:
    """Loss and accuracy curves from ``metrics.jsonl`` into a PNG (None, with a log line, without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: skipping %s (pip install 'capserve[train]')", png)
        return None
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    epochs = [r["epoch"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in (("loss", a), ("acc", b)):
        ax.plot(epochs, [r[f"train_{key}"] for r in rows], label="train")
        if any(r.get(f"val_{key}") is not None for r in rows):
            ax.plot(epochs, [r.get(f"val_{key}") for r in rows], label="validation")
        ax.set_xlabel("epoch")
        ax.set_ylabel(key)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------------------- training


def val_size_of(cfg: TrainConfig, own: bool) -> int | float:
    return cfg.val_size if cfg.val_size is not None else DEFAULT_VAL_SIZE["own" if own else "builtin"]


def build_model(cfg: TrainConfig, manifest: Manifest | None = None) -> Model:
    """The model to train: the named config, with the labels, task and input size of a user's data if given."""
    config = get_config(cfg.model, **cfg.overrides)
    val_size = val_size_of(cfg, manifest is not None)
    if manifest is None:
        if cfg.image_size is not None:
            raise ValueError("--image-size works with your own images (a folder or CSV); the built-in datasets have "
                             "fixed sizes (use --set image_size=N to change a model config)")  # fmt: skip
        data = {"dataset": dataset_for(config.labels, config.task, config.image_size), "val_size": val_size}
    else:
        config = dataclasses.replace(config, labels=manifest.labels, task=manifest.task, thresholds=None,
                                     image_size=cfg.image_size or config.image_size)  # fmt: skip
        data = {"dataset": manifest.kind, "source": str(manifest.source), "val_size": val_size}
    torch.manual_seed(cfg.seed)
    return model_from_config(dataclasses.replace(config, extra={**config.extra, "data": data}))


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


def load_own_training(manifest: Manifest, model: Model, out: Path, d: Dist,
                      device: torch.device) -> tuple[Data, Split | None, int]:  # fmt: skip
    """A user's data decoded at the model's input (through the run folder's cache): training data, test, skipped."""
    c = model.config
    if d.enabled and not d.main:
        dist.barrier()  # rank 0 decodes and writes the cache first; the others read it
    own = build_cache(manifest, c.labels, InputSize(c.in_channels, c.image_size), out / CACHE_FILE)
    if d.enabled and d.main:
        dist.barrier()
    train, val, test = (own.splits.get(s) for s in ("train", "val", "test"))
    if train is None or not len(train):
        raise ValueError(f"no readable training images in {manifest.source}")
    val = val.to(device) if val is not None and len(val) else None
    return Data(manifest.kind, train.to(device), None, val, len(train)), test, own.skipped


def train(cfg: TrainConfig, resume: str | Path | None = None) -> dict[str, Any]:
    """Run training as ``cfg`` says (continuing from ``resume``'s ``last/`` if given); return the summary."""
    d, device = setup_distributed(cfg.device)
    try:
        return _train(cfg, resume, d, device)
    finally:
        if d.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _train(cfg: TrainConfig, resume: str | Path | None, d: Dist, device: torch.device) -> dict[str, Any]:
    wall0 = time.perf_counter()
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {d.world}")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    out = Path(cfg.out)
    manifest = None
    if is_own_data(cfg.data):
        manifest = scan(cfg.data)
        check_training(manifest)
        manifest, carved = with_validation(manifest, val_size_of(cfg, own=True))
        if carved:
            log.info("validation: %d images carved from %s's training images (seed 0)", carved, manifest.source)
    model = build_model(cfg, manifest)
    c = model.config
    dataset = c.extra["data"]["dataset"]
    init = init_from(model, cfg.init) if cfg.init and resume is None else None
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
    skipped, test_split = 0, None
    if manifest is not None:
        data, test_split, skipped = load_own_training(manifest, model, out, d, device)
    else:
        data = load_training(dataset, cfg.data, val_size_of(cfg, own=False), cfg.epoch_size, device)
    steps_per_epoch = data.epoch_size // cfg.batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the {data.epoch_size} training images per epoch")
    total_steps = cfg.epochs * steps_per_epoch
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    net: torch.nn.Module = model
    if d.enabled:
        net = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda"
                                                        else None)  # fmt: skip
    opt = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    state: dict[str, Any] = {"epoch": 0, "batch": 0, "step": 0, "elapsed": 0.0, "best_acc": None, "best_epoch": None}
    if resume is not None:
        last = Path(resume) if (Path(resume) / "trainer.json").is_file() else Path(resume) / "last"
        state = _load_state(last, model, opt, scaler, device)
        log.info("resumed from %s at epoch %d, step %d", last, state["epoch"] + 1, state["step"])
    if d.main:
        (out / "train_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
        log.info("%s on %s: %d train images/epoch, %d validation, %d steps/epoch, %d parameters", cfg.model,
                 device, data.epoch_size, len(data.val) if data.val else 0, steps_per_epoch,
                 sum(p.numel() for p in model.parameters()))  # fmt: skip
    multi = c.task == "multi_label"
    local = cfg.batch_size // d.world
    progress = Progress(d.main)
    start_elapsed, t0 = state["elapsed"], time.perf_counter()
    steps_this_run = 0
    stop = False
    net.train()
    while state["epoch"] < cfg.epochs and not stop:
        epoch = state["epoch"]
        ep = data.epoch(epoch, cfg.seed, device)
        sums = torch.zeros(3, device=device)  # loss·n, hits, n
        t_epoch, images0 = time.perf_counter(), 0
        for b in range(state["batch"], steps_per_epoch):
            lo = b * cfg.batch_size + d.rank * local
            x, y = ep.images[lo : lo + local], ep.targets[lo : lo + local]
            if dataset != "multimnist":  # the authors' CIFAR augmentation; DiverseMultiMNIST shifts are built in
                g = torch.Generator(device=device).manual_seed(cfg.seed * 7_919 + epoch * 100_003 + b)
                x = random_crop_flip(x, max(1, c.image_size // 8), g)  # padding 4 at 32×32
            x = normalize(x, c.mean, c.std)
            if cfg.channels_last:
                x = x.contiguous(memory_format=torch.channels_last)
            elapsed = start_elapsed + time.perf_counter() - t0
            p = state["step"] / total_steps
            if cfg.time_budget is not None and cfg.schedule != "step":
                p = max(p, elapsed / cfg.time_budget)
            lr = cfg.lr * lr_factor(cfg.schedule, p, epoch, cfg.epochs)
            for group in opt.param_groups:
                group["lr"] = lr
            with _autocast(device, cfg.amp):
                logits = net(x)
            loss, hits = loss_and_hits(logits, y, c, p)
            opt.zero_grad(set_to_none=True)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
            else:
                loss.backward()
            if cfg.grad_clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if scaler is not None:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            sums += torch.stack([loss.detach() * len(y), hits.float(), torch.tensor(float(len(y)), device=device)])
            state["step"] += 1
            state["batch"] = b + 1
            steps_this_run += 1
            images0 += len(y) * d.world
            stop = _should_stop(cfg, steps_this_run, start_elapsed + time.perf_counter() - t0, d, device)
            if progress.due() or stop:
                n = max(sums[2].item(), 1)
                rate = images0 / max(time.perf_counter() - t_epoch, 1e-9)
                progress.show(f"epoch {epoch + 1}/{cfg.epochs} [{b + 1}/{steps_per_epoch}] loss "
                              f"{sums[0].item() / n:.4f} acc {100 * sums[1].item() / n:.2f}% lr {lr:.4g} "
                              f"{rate:.0f} img/s")  # fmt: skip
            if stop:
                break
        progress.end()
        epoch_done = state["batch"] >= steps_per_epoch
        if d.enabled:
            dist.all_reduce(sums)
        n = max(sums[2].item(), 1)
        record = {"epoch": epoch + 1, "step": state["step"], "lr": lr, "train_loss": sums[0].item() / n,
                  "train_acc": sums[1].item() / n, "images_per_s": images0 / max(time.perf_counter() - t_epoch, 1e-9),
                  "epoch_complete": epoch_done}  # fmt: skip
        if data.val is not None:
            v = validate(model, data.val, cfg, device, d)
            record.update(val_loss=v["loss"], val_acc=v["acc"])
        if epoch_done:
            state["epoch"], state["batch"] = epoch + 1, 0
        state["elapsed"] = start_elapsed + time.perf_counter() - t0
        record["elapsed_s"] = state["elapsed"]
        score = record.get("val_acc", record["train_acc"] if data.val is None else None)
        loss = record.get("val_loss")
        improved = improves(score, loss, state["best_acc"], state.get("best_loss"))
        if improved:
            state["best_acc"], state["best_loss"], state["best_epoch"] = score, loss, epoch + 1
        if d.main:
            with open(out / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            val = f" | val loss {record['val_loss']:.4f} acc {100 * record['val_acc']:.2f}%" if data.val else ""
            log.info("epoch %d/%d: train loss %.4f acc %.2f%%%s | %.0f img/s | %.0f s%s", epoch + 1, cfg.epochs,
                     record["train_loss"], 100 * record["train_acc"], val, record["images_per_s"], state["elapsed"],
                     " (best)" if improved else "")  # fmt: skip
            if improved:
                save_model(model, out / "best", extra={"training": _provenance(cfg, state),
                                                       "metrics": {"val_acc": record.get("val_acc")}})  # fmt: skip
            _save_state(out / "last", model, opt, scaler, state, cfg)
        if d.enabled:
            dist.barrier()
    summary: dict[str, Any] = {"model": cfg.model, "dataset": dataset, "best_epoch": state["best_epoch"],
                               "best_val_acc": state["best_acc"] if data.val is not None else None,
                               "steps": state["step"], "train_seconds": state["elapsed"],
                               "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                               "processes": d.world}  # fmt: skip
    if manifest is not None:
        summary.update(labels=list(c.labels), task=c.task, skipped_images=skipped)
    if init is not None:
        summary["init"] = {"from": init["from"], "loaded": len(init["loaded"]), "new": init["new"]}
    if data.val is None and d.main:
        log.warning("no validation split (--val-size 0): best/ is the epoch with the best training accuracy")
    if multi and data.val is not None and state["best_epoch"] is not None and d.main:
        summary["thresholds"] = calibrate_best(out / "best", data.val, cfg.eval_batch_size, device)
    if cfg.test and state["best_epoch"] is not None and d.main:
        if manifest is None:
            test_split = load_test(dataset, cfg.data)
        if test_split is None or not len(test_split):
            log.info("no test split in %s (a test/ folder or rows with split test): skipping the test evaluation",
                     cfg.data)  # fmt: skip
        else:
            best = load_model(out / "best", device)
            test = validate(best, test_split, cfg, device, Dist())
            summary["test_acc"] = test["acc"]
            log.info("test accuracy (best epoch %d, evaluated once): %.2f%%", state["best_epoch"], 100 * test["acc"])
    summary["wall_seconds"] = time.perf_counter() - wall0
    if d.main:
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        if (out / "metrics.jsonl").is_file():
            plot_curves(out / "metrics.jsonl", out / "curves.png")
    return summary


def calibrate_best(best_dir: Path, val: Split, batch_size: int, device: torch.device) -> list[float]:
    """Multi-label: per-class thresholds fitted on the validation split, stored in ``best_dir``'s config."""
    from capserve.evaluate import fit_thresholds, predict_logits, store_thresholds

    best = load_model(best_dir, device)
    thresholds = fit_thresholds(predict_logits(best, val, None, batch_size, device), val.targets.cpu())
    store_thresholds(best_dir, best, thresholds)
    log.info("thresholds calibrated on the validation split (stored in %s): %s", best_dir,
             ", ".join(f"{lab} {t:.2f}" for lab, t in zip(best.config.labels, thresholds, strict=True)))  # fmt: skip
    return list(thresholds)


def _should_stop(cfg: TrainConfig, steps: int, elapsed: float, d: Dist, device: torch.device) -> bool:
    stop = (cfg.max_steps is not None and steps >= cfg.max_steps) or (
        cfg.time_budget is not None and elapsed >= cfg.time_budget
    )
    if d.enabled and cfg.time_budget is not None:  # rank 0's clock decides for everyone
        flag = torch.tensor([float(stop)], device=device)
        dist.broadcast(flag, 0)
        stop = bool(flag.item())
    return stop


# ------------------------------------------------------------------------------------------------- CLI


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
    p.add_argument("--model", help=f"model name: {', '.join(list_models())} (default with --init: its model's)")
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
        "tensor whose shape matches; the class layer starts afresh when the labels differ)",
    )
    p.add_argument("--out", help="output folder (checkpoints, metrics, plot)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model config override (JSON)")
    p.add_argument("--resume", metavar="DIR", help="continue the run saved in DIR (its last/ checkpoint)")
    p.add_argument("--epochs", type=int, default=350)
    p.add_argument("--batch-size", type=int, default=128, help="global batch size (all processes together)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="sgd", help="sgd (with momentum, default) or adam")
    p.add_argument("--lr", type=float, help="base learning rate (default: 0.1 for SGD, 1e-3 for Adam)")
    p.add_argument("--momentum", type=float, help="SGD momentum (default 0.9; Adam takes none)")
    p.add_argument("--weight-decay", type=float, default=5e-4)
    p.add_argument("--schedule", choices=SCHEDULES, default="step")
    p.add_argument("--amp", choices=tuple(AMP), default="off", help="autocast dtype (bf16 works on CPU too)")
    p.add_argument("--channels-last", action="store_true")
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


def run(args: argparse.Namespace) -> int:
    resume = args.resume
    if resume:
        saved = read_resume_config(resume)
        keep = {"data": args.data, "out": args.out, "time_budget": args.time_budget, "device": args.device}
        cfg = dataclasses.replace(saved, **{k: v for k, v in keep.items() if v not in (None, "auto")})
        if not args.out:
            cfg = dataclasses.replace(cfg, out=str(Path(resume) if (Path(resume) / "last").is_dir()
                                                   else Path(resume).parent))  # fmt: skip
    else:
        model, overrides = args.model, _parse_set(args.set)
        if args.init and not args.model:
            model, architecture = init_architecture(args.init)
            overrides = {**architecture, **overrides}
        missing = [f"--{k}" for k, v in (("model", model), ("data", args.data), ("out", args.out)) if not v]
        if missing:
            raise ValueError(f"missing {', '.join(missing)} (or give --resume DIR)")
        cfg = TrainConfig(model=model, data=args.data, out=args.out, overrides=overrides, optimizer=args.optimizer,
                          epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, momentum=args.momentum,
                          weight_decay=args.weight_decay, schedule=args.schedule, amp=args.amp,
                          channels_last=args.channels_last, time_budget=args.time_budget, max_steps=args.max_steps,
                          grad_clip=args.grad_clip, val_size=args.val_size, epoch_size=args.epoch_size,
                          seed=args.seed, eval_batch_size=args.eval_batch_size, test=not args.no_test,
                          device=args.device, image_size=args.image_size, init=args.init)  # fmt: skip
        get_config(cfg.model, **cfg.overrides)  # fail early on a bad --set
    if resume:  # a step limit applies to one invocation, never to the resumed one
        cfg = dataclasses.replace(cfg, max_steps=args.max_steps)
    summary = train(cfg, resume=resume)
    if int(os.environ.get("RANK", "0")) == 0:
        print(json.dumps(summary, indent=1))
    return 0
