"""The training loop: a run folder from a ``TrainConfig`` (``train``), one epoch at a time, resumable exactly.

The best epoch is chosen on a validation split carved from the training set, never on the test set, which is
evaluated once at the end on ``best/``. A run folder holds ``last/`` (model, optimizer and trainer state: what
``--resume`` continues from), ``best/`` (a plain model directory), ``metrics.jsonl``, ``curves.png`` and
``summary.json``. The recipe's defaults live in ``capserve.train.config``; docs/training.md is the manual.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from capserve.configs import ModelConfig, get_config
from capserve.data.augment import apply_augment, augment_reason, default_augment
from capserve.data.builtin import Data, dataset_for, load_test, load_training
from capserve.data.own import (
    CACHE_FILE,
    InputSize,
    Manifest,
    build_cache,
    check_data_exists,
    check_training,
    is_own_data,
    scan,
    with_validation,
)
from capserve.data.placement import measure_placement
from capserve.data.preprocess import data_mean_std, normalize
from capserve.data.progress import progress_bar
from capserve.data.splits import Split
from capserve.evaluate.evaluator import predict_logits, store_thresholds
from capserve.evaluate.metrics import fit_thresholds
from capserve.evaluate.plots import plot_curves
from capserve.files import replacing_directory, write_whole
from capserve.model.checkpoint import CONFIG, NOT_LEARNED, save_model
from capserve.model.factory import Model, build_model
from capserve.model.factory import load as load_model
from capserve.routing.losses import training_loss
from capserve.runtime.outputs import multi_label_decisions
from capserve.train.config import AMP, DEFAULT_LR, DEFAULT_VAL_SIZE, TrainConfig, lr_factor, resolve_recipe
from capserve.train.distributed import Dist, setup_distributed
from capserve.train.state import init_from, load_state, provenance, save_state

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- checkpoints


def make_optimizer(model: Model, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The run's optimizer (``cfg`` resolved by ``resolve_recipe``): SGD with momentum (the authors'), Adam (both with
    L2 weight decay) or AdamW (decoupled weight decay, none on biases and normalisation gains: shrinking those only
    costs fit), over the parameters that train (``--freeze backbone`` leaves the backbone's out)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.optimizer == "adamw":
        groups = [
            {"params": [p for p in params if p.ndim > 1], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr)
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    raise ValueError(f"optimizer {cfg.optimizer!r} is not resolved: call resolve_recipe first")


# ------------------------------------------------------------------------------------------------- metrics


def improves(acc: float, loss: float | None, best_acc: float | None, best_loss: float | None) -> bool:
    """Whether an epoch with validation ``acc`` and ``loss`` beats the best so far. A tie in accuracy (a slow learner's
    early epochs stay at 0 % exact match) goes to the lower loss, which every loss computes at its end-of-training
    margin when validating, so that epochs compare."""
    if best_acc is None or acc > best_acc:
        return True
    return acc == best_acc and loss is not None and (best_loss is None or loss < best_loss)


def prior_score(train_targets: Tensor, val_targets: Tensor) -> tuple[float, str]:
    """The validation score of always answering the training split's most common label (or, multi-label, its most
    common label set): what a model that learned nothing from the images reaches. (score, that answer's index)."""
    if train_targets.ndim == 2:  # multi-hot (N, C)
        sets, counts = torch.unique(train_targets.cpu() > 0.5, dim=0, return_counts=True)
        common = sets[counts.argmax()]  # (C,)
        score = ((val_targets.cpu() > 0.5) == common).all(dim=1).float().mean().item()
        return score, ",".join(str(i) for i in common.nonzero().flatten().tolist())
    common = torch.bincount(train_targets.cpu()).argmax()
    return (val_targets.cpu() == common).float().mean().item(), str(common.item())


def standard_error(prior: float, n: int) -> float:
    """The standard error of a score over ``n`` images of a model whose true score is ``prior``."""
    return math.sqrt(max(prior * (1 - prior), 0.0) / max(n, 1))


def learning_bound(prior: float, n: int) -> float:
    """The score over ``n`` validation images that a run must beat to have clearly learned: the ``prior`` score plus
    two standard errors of a score at the prior (a chance difference in a small validation split is not learning)
    and one image."""
    return prior + 2 * standard_error(prior, n) + 1 / max(n, 1)


def chance_level(prior: float, n: int) -> float:
    """The score over ``n`` validation images up to which a run sits at the ``prior``: one standard error and one
    image above it, what the best of a few epochs of a model that learned nothing reaches by chance."""
    return prior + standard_error(prior, n) + 1 / max(n, 1)


def has_learned(best: float, prior: float, n: int) -> bool:
    """Whether a best validation score ``best`` over ``n`` images is clearly above the ``prior`` score
    (``learning_bound``)."""
    return best > learning_bound(prior, n)


@dataclass(frozen=True)
class Verdict:
    """What a run's best validation score says about its learning (``verdict``).

    ``learned``: True, clearly above the label prior (``learning_bound``); False, at the prior (at most
    ``chance_level``): the run fails and ``best/`` is marked; None, between the two, or a split too small for even a
    perfect score to clear the prior's noise: the split cannot tell, and the run does not fail. ``message``: what
    the log says, with the figures and the bounds (empty when the run clearly learned)."""

    learned: bool | None
    message: str


TRY_NEXT = (
    "Try, in order: more --epochs; the default recipe (no --lr, --optimizer, --weight-decay or --augment flags); a "
    "look at a few images of each label (are the labels right, do the images differ?); more images per label"
)


def verdict(best: float, prior: float, n: int, answer: str, metric: str = "top-1", epoch: int | None = None) -> Verdict:
    """The verdict on a best validation ``metric`` of ``best`` (at ``epoch``) over ``n`` images, against ``prior``,
    the score of always giving ``answer`` (the training split's most common label, or label set). Only a run at or
    below the prior is said to be "no better than" it."""
    bound, chance = learning_bound(prior, n), chance_level(prior, n)
    scored = f"its best validation {metric}, {100 * best:.1f} %" + (f" (epoch {epoch})" if epoch is not None else "")
    always = f"always answering {answer} ({100 * prior:.1f} % of the validation images)"
    clears = f"more than {100 * bound:.1f} % (two standard errors and one image above the prior)"
    if best > bound:
        return Verdict(True, "")
    if not has_learned(1.0, prior, n):
        return Verdict(
            None,
            f"the validation split ({n} images) is too small to tell a model that learned from one that did not: "
            f"{scored}, against {always}; even 100 % would not clear that prior's noise on {n} images (it takes "
            f"{clears}). Give --val-size a larger count, or a val/ split",
        )
    if best > chance:
        return Verdict(
            None,
            f"the validation split ({n} images) is too small to tell whether the run learned: {scored}, is above "
            f"{always}, but not clear of chance: on {n} images that takes {clears}. best/ is not marked. To tell, "
            "give --val-size a larger count or a val/ split; more --epochs may also raise the score",
        )
    if best > prior:
        return Verdict(
            False,
            f"the run did not learn: {scored}, is within chance of {always}: on {n} images a model that learned "
            f"nothing reaches up to {100 * chance:.1f} % (one standard error and one image above the prior), and a run "
            f"that learned scores {clears}. best/ is marked as not learned. {TRY_NEXT}",
        )
    return Verdict(
        False,
        f"the run did not learn: {scored}, is no better than {always}. best/ is marked as not learned. {TRY_NEXT}",
    )


ADAM_LR_WARNING = 1e-2  # an Adam(W) lr above this is almost always an SGD lr given by habit

MEMORISING_GAP = 0.3  # train minus validation score above which the log names a run as memorising


def loss_and_hits(logits: Tensor, targets: Tensor, config: ModelConfig, progress: float = 1.0) -> tuple[Tensor, Tensor]:
    """Mean loss (``config``'s routing's own, ``capserve.routing.losses``) and the number of correct images (top-1, or
    exact match under the server's decision rule and the config's thresholds for multi-label); ``progress`` is the
    fraction of training done (for schedules)."""
    logits = logits.float()
    multi_label = config.task == "multi_label"
    loss = training_loss(config)(logits, targets, multi_label, progress)
    if multi_label:
        decided = torch.from_numpy(multi_label_decisions(logits.detach().cpu().numpy(), config.thresholds))
        hits = (decided.to(targets.device) == (targets > 0.5)).all(dim=1).sum()
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


# ------------------------------------------------------------------------------------------------- training


def val_size_of(cfg: TrainConfig, own: bool) -> int | float:
    return cfg.val_size if cfg.val_size is not None else DEFAULT_VAL_SIZE["own" if own else "builtin"]


def model_to_train(cfg: TrainConfig, manifest: Manifest | None = None) -> Model:
    """The model to train: the named config, with the labels, task and input size of a user's data if given."""
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
        )
        data = {"dataset": manifest.kind, "source": str(manifest.source), "val_size": val_size}
    torch.manual_seed(cfg.seed)
    # served answers and exports carry the run's name: two fine-tunes of one config can be told apart
    name = cfg.name or Path(cfg.out).name
    return build_model(dataclasses.replace(config, extra={**config.extra, "data": data, "name": name}))


def chooses_class_weights(cfg: TrainConfig, config: ModelConfig, resume: str | Path | None) -> bool:
    """Whether a run picks its class capsule transforms from its data (``capserve.data.placement``): a new run from
    scratch on a user's images, of an attention capsule model whose class layer reads a grid, without
    ``--set class_weights=...``."""
    return (
        resume is None
        and not cfg.init
        and "class_weights" not in cfg.overrides
        and config.has_routing
        and config.routing_algorithm == "attention"
        and (not config.capsules or config.capsules[-1].kind == "conv")
    )


def load_own_training(
    manifest: Manifest, model: Model, out: Path, d: Dist, device: torch.device
) -> tuple[Data, Split | None, int]:
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


@dataclass
class Run:
    """What a training run holds between its steps: the model and its optimizer, the data, the counters that
    ``last/`` saves (``state``), and the wall clock of this process's part of the run."""

    cfg: TrainConfig
    d: Dist
    device: torch.device
    out: Path
    model: Model
    net: torch.nn.Module  # the model, or its DDP wrapper
    opt: torch.optim.Optimizer
    scaler: Any
    data: Data
    dataset: str
    state: dict[str, Any]
    manifest: Manifest | None = None
    test_split: Split | None = None
    skipped: int = 0
    init: dict[str, Any] | None = None
    resumed_elapsed: float = 0.0  # training seconds of the pieces before this one (--resume)
    started: float = field(default_factory=time.perf_counter)
    steps_this_run: int = 0

    @property
    def steps_per_epoch(self) -> int:
        return self.data.epoch_size // self.cfg.batch_size

    def elapsed(self) -> float:
        """Training seconds of the whole run, resumed pieces included."""
        return self.resumed_elapsed + time.perf_counter() - self.started


def set_up(cfg: TrainConfig, resume: str | Path | None, d: Dist, device: torch.device) -> Run:
    """The data (built-in or the user's own), the model (``--init`` applied), its optimizer, and the state to start
    from (``--resume``)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    check_data_exists(cfg.data)  # before the run folder exists: a typo leaves nothing behind
    out = Path(cfg.out)
    manifest = None
    if is_own_data(cfg.data):
        manifest = scan(cfg.data, cfg.label_separator)
        check_training(manifest)
        manifest, carved = with_validation(manifest, val_size_of(cfg, own=True))
        if carved:
            log.info("validation: %d images carved from %s's training images (seed 0)", carved, manifest.source)
    elif cfg.label_separator is not None:
        raise ValueError(f"--label-separator is for a CSV of your own images; {cfg.data} holds built-in dataset files")
    batch_given = cfg.batch_size is not None
    cfg = resolve_recipe(cfg, own_data=manifest is not None)  # recorded in train_config.json as resolved
    if cfg.batch_size % d.world:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes {d.world}")
    model = model_to_train(cfg, manifest)
    dataset = model.config.extra["data"]["dataset"]
    init = init_from(model, cfg.init, cfg.label_map) if cfg.init and resume is None else None
    if d.main:
        out.mkdir(parents=True, exist_ok=True)
        if resume is None:
            start_afresh(out)
    skipped, test_split = 0, None
    if manifest is not None:
        data, test_split, skipped = load_own_training(manifest, model, out, d, device)
        if chooses_class_weights(cfg, model.config, resume):
            placement = measure_placement(data.train.images, data.train.targets, cfg.seed)
            # recorded in train_config.json's overrides, so that --resume rebuilds the same model
            cfg = dataclasses.replace(cfg, overrides={**cfg.overrides, "class_weights": placement.class_weights})
            model = model_to_train(cfg, manifest)
            if d.main:
                log.info("class capsule transforms: %s (%s)", placement.class_weights, placement.reason())
    else:
        data = load_training(dataset, cfg.data, val_size_of(cfg, own=False), cfg.epoch_size, device)
    if data.epoch_size < cfg.batch_size and not batch_given and data.epoch_size >= d.world:
        # a default batch never refuses a small data set: one batch of all its images (a multiple of the processes)
        cfg = dataclasses.replace(cfg, batch_size=data.epoch_size // d.world * d.world)
    if data.epoch_size < cfg.batch_size:
        raise ValueError(f"--batch-size {cfg.batch_size} exceeds the {data.epoch_size} training images per epoch")
    augment_why = "given"
    if cfg.augment is None:  # recorded in train_config.json (and every checkpoint) as resolved
        cfg = dataclasses.replace(cfg, augment=default_augment(dataset))
        augment_why = augment_reason(dataset)
    if d.main:
        log.info("augmentation: %s (%s)", cfg.augment, augment_why)
        log.info(
            "recipe: %s lr %g, weight decay %g, %s schedule, batch %d",
            cfg.optimizer,
            cfg.lr,
            cfg.weight_decay,
            cfg.schedule,
            cfg.batch_size,
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
    if manifest is not None and not cfg.init:  # --init keeps the mean/std its weights were trained with
        model.config = dataclasses.replace(model.config, **data_mean_std(data.train.images))
        log.info("mean/std from the %d training images: %s / %s", len(data.train), model.config.mean, model.config.std)
    if cfg.freeze == "backbone":
        model.backbone.requires_grad_(False)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    net: torch.nn.Module = model
    if d.enabled:
        net = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    opt = make_optimizer(model, cfg)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    state: dict[str, Any] = {"epoch": 0, "batch": 0, "step": 0, "elapsed": 0.0, "best_acc": None, "best_epoch": None}
    if resume is not None:
        last = Path(resume) if (Path(resume) / "trainer.json").is_file() else Path(resume) / "last"
        state = load_state(last, model, opt, scaler, device)
        if d.main:
            drop_unsaved_epochs(out / "metrics.jsonl", state["epoch"])
        if state["epoch"] >= cfg.epochs:  # a finished run (learned or not) is summed up again, never trained further
            log.warning(
                "%s already trained its %d epochs: --resume has nothing left to train, and sums the run up again "
                "from best/ (the verdict on learning, multi-label thresholds, the test figure, summary.json). To "
                "train further, start a new run from its weights: --init %s --epochs N",
                out,
                cfg.epochs,
                out / "best",
            )
        else:
            log.info("resumed from %s at epoch %d, step %d", last, state["epoch"] + 1, state["step"])
    run = Run(
        cfg,
        d,
        device,
        out,
        model,
        net,
        opt,
        scaler,
        data,
        dataset,
        state,
        manifest,
        test_split,
        skipped,
        init,
        resumed_elapsed=state["elapsed"],
    )
    if d.main:
        write_whole(out / "train_config.json", json.dumps(dataclasses.asdict(cfg), indent=1) + "\n")
        log.info(
            "%s on %s: %d train images/epoch, %d validation, %d steps/epoch, %d parameters",
            cfg.model,
            device,
            data.epoch_size,
            len(data.val) if data.val else 0,
            run.steps_per_epoch,
            sum(p.numel() for p in model.parameters()),
        )
    return run


def start_afresh(out: Path) -> None:
    """A new run in the folder of an earlier one (without ``--resume``) logs and sums up only itself: the earlier
    run's metrics, curves and summary go, and its ``best/`` and ``last/`` are replaced as this run saves."""
    earlier = [out / name for name in ("metrics.jsonl", "curves.png", "summary.json") if (out / name).is_file()]
    if earlier:
        log.warning("%s holds an earlier run: this one starts afresh and replaces it (--resume continues it)", out)
    for path in earlier:
        path.unlink()


def drop_unsaved_epochs(metrics: Path, saved_epochs: int) -> None:
    """Forget the records of whole epochs after the last saved one, and a last line a kill cut short: a run killed
    after logging an epoch but before saving it runs that epoch again on ``--resume``, which logs it again."""
    if not metrics.is_file():
        return
    kept = []
    for line in metrics.read_text().splitlines(keepends=True):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not (record["epoch_complete"] and record["epoch"] > saved_epochs):
            kept.append(line)
    write_whole(metrics, "".join(kept))


def augment(run: Run, x: Tensor, epoch: int, batch: int) -> Tensor:
    """A training batch as the network sees it: augmented (uint8, ``--augment``), then normalised with the model's
    mean/std."""
    cfg, c = run.cfg, run.model.config
    if cfg.augment not in (None, "none"):
        g = torch.Generator(device=run.device).manual_seed(cfg.seed * 7_919 + epoch * 100_003 + batch)
        x = apply_augment(cfg.augment, x, g)  # shifts of up to 4 pixels at 32×32
    x = normalize(x, c.mean, c.std)
    return x.contiguous(memory_format=torch.channels_last) if cfg.channels_last else x


def train_step(run: Run, x: Tensor, y: Tensor, progress: float) -> tuple[Tensor, Tensor, float]:
    """One optimizer step at ``progress`` through the schedule: (loss, hits, lr)."""
    cfg, opt, scaler = run.cfg, run.opt, run.scaler
    lr = cfg.lr * lr_factor(cfg.schedule, progress, run.state["epoch"], cfg.epochs)
    for group in opt.param_groups:
        group["lr"] = lr
    with _autocast(run.device, cfg.amp):
        logits = run.net(x)
    loss, hits = loss_and_hits(logits, y, run.model.config, progress)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
    else:
        loss.backward()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_(run.model.parameters(), cfg.grad_clip)
    if scaler is not None:
        scaler.step(opt)
        scaler.update()
    else:
        opt.step()
    return loss.detach(), hits, lr


def train_epoch(run: Run) -> tuple[dict[str, Any], bool]:
    """The rest of the current epoch (from ``state["batch"]`` on a resumed run): its training record, and whether
    the run must stop (``--max-steps`` or ``--time-budget`` reached)."""
    cfg, d, state, device = run.cfg, run.d, run.state, run.device
    epoch, steps = state["epoch"], run.steps_per_epoch
    ep = run.data.epoch(epoch, cfg.seed, device)
    local = cfg.batch_size // d.world
    sums = torch.zeros(3, device=device)  # loss·n, hits, n
    t_epoch, images, lr, stop = time.perf_counter(), 0, cfg.lr, False
    run.net.train()
    if cfg.freeze == "backbone":  # its BatchNorm keeps the --init model's statistics
        run.model.backbone.eval()
    desc = f"epoch {epoch + 1}/{cfg.epochs}"
    with progress_bar(steps, desc, unit="step", initial=state["batch"], disable=not d.main, leave=False) as bar:
        for b in range(state["batch"], steps):
            lo = b * cfg.batch_size + d.rank * local
            x, y = augment(run, ep.images[lo : lo + local], epoch, b), ep.targets[lo : lo + local]
            p = state["step"] / (cfg.epochs * steps)
            if cfg.time_budget is not None and cfg.schedule != "step":
                p = max(p, run.elapsed() / cfg.time_budget)
            loss, hits, lr = train_step(run, x, y, p)
            sums += torch.stack([loss * len(y), hits.float(), torch.tensor(float(len(y)), device=device)])
            state["step"], state["batch"] = state["step"] + 1, b + 1
            run.steps_this_run += 1
            images += len(y) * d.world
            stop = _should_stop(cfg, run.steps_this_run, run.elapsed(), d, device)
            bar.update()
            if d.main and (stop or time.perf_counter() - bar.last_print_t >= bar.mininterval):
                n = max(sums[2].item(), 1)
                bar.set_postfix_str(f"loss {sums[0].item() / n:.4f} acc {100 * sums[1].item() / n:.2f}% lr {lr:.4g}")
            if stop:
                break
    if d.enabled:
        dist.all_reduce(sums)
    n = max(sums[2].item(), 1)
    record = {
        "epoch": epoch + 1,
        "step": state["step"],
        "lr": lr,
        "train_loss": sums[0].item() / n,
        "train_acc": sums[1].item() / n,
        "images_per_s": images / max(time.perf_counter() - t_epoch, 1e-9),
        "epoch_complete": state["batch"] >= steps,
    }
    return record, stop


def end_epoch(run: Run, record: dict[str, Any]) -> None:
    """Validation, the best epoch so far (``best/``), ``metrics.jsonl`` and the resumable ``last/``."""
    cfg, d, state, data = run.cfg, run.d, run.state, run.data
    epoch = record["epoch"] - 1
    if data.val is not None:
        v = validate(run.model, data.val, cfg, run.device, d)
        record.update(val_loss=v["loss"], val_acc=v["acc"])
    if record["epoch_complete"]:
        state["epoch"], state["batch"] = epoch + 1, 0
    state["elapsed"] = record["elapsed_s"] = run.elapsed()
    score = record.get("val_acc", record["train_acc"] if data.val is None else None)
    loss = record.get("val_loss")
    improved = improves(score, loss, state["best_acc"], state.get("best_loss"))
    if improved:
        state["best_acc"], state["best_loss"], state["best_epoch"] = score, loss, epoch + 1
    if d.main:
        with open(run.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")
        val = f" | val loss {record['val_loss']:.4f} acc {100 * record['val_acc']:.2f}%" if data.val else ""
        log.info(
            "epoch %d/%d: train loss %.4f acc %.2f%%%s | %.0f img/s | %.0f s%s",
            epoch + 1,
            cfg.epochs,
            record["train_loss"],
            100 * record["train_acc"],
            val,
            record["images_per_s"],
            state["elapsed"],
            " (best)" if improved else "",
        )
        if improved:  # swapped in whole: evaluate, export and serve never read half a best/
            with replacing_directory(run.out / "best") as best:
                extra = {"training": provenance(cfg, state), "metrics": {"val_acc": record.get("val_acc")}}
                save_model(run.model, best, extra=extra)
        save_state(run.out / "last", run.model, run.opt, run.scaler, state, cfg)
    if d.enabled:
        dist.barrier()


def finish(run: Run) -> dict[str, Any]:
    """After the last epoch: thresholds for multi-label models, the one test evaluation of ``best/``, and the
    summary (``summary.json``, ``curves.png``)."""
    cfg, d, state, data, c = run.cfg, run.d, run.state, run.data, run.model.config
    device = run.device
    summary: dict[str, Any] = {
        "model": cfg.model,
        "dataset": run.dataset,
        "best_epoch": state["best_epoch"],
        "best_val_acc": state["best_acc"] if data.val is not None else None,
        "steps": state["step"],
        "train_seconds": state["elapsed"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "processes": d.world,
        "augment": cfg.augment,
    }
    if run.manifest is not None:
        summary.update(labels=list(c.labels), task=c.task, skipped_images=run.skipped)
    if run.init is not None:
        summary["init"] = {
            "from": run.init["from"],
            "loaded": len(run.init["loaded"]),
            "new": run.init["new"],
            "kept_labels": run.init["kept_labels"],
            "new_labels": run.init["new_labels"],
        }
    if data.val is None and d.main:
        log.warning("no validation split (--val-size 0): best/ is the epoch with the best training accuracy")
    learned = check_learned(run) if d.main else None
    if learned is not None:
        summary.update(learned=learned["learned"], prior_val_acc=learned["prior"])
    if (
        c.task == "multi_label"
        and data.val is not None
        and state["best_epoch"] is not None
        and d.main
        and summary.get("learned", True)
    ):
        summary["thresholds"] = calibrate_best(run.out / "best", data.val, cfg.eval_batch_size, device)
    if cfg.test and state["best_epoch"] is not None and d.main:
        test_split = run.test_split if run.manifest is not None else load_test(run.dataset, cfg.data)
        if test_split is None or not len(test_split):
            log.info(
                "no test split in %s (a test/ folder or rows with split test): skipping the test evaluation", cfg.data
            )
        else:
            best = load_model(run.out / "best", device)
            test = validate(best, test_split, cfg, device, Dist())
            summary["test_acc"] = test["acc"]
            log.info("test accuracy (best epoch %d, evaluated once): %.2f%%", state["best_epoch"], 100 * test["acc"])
    return summary


def _train(cfg: TrainConfig, resume: str | Path | None, d: Dist, device: torch.device) -> dict[str, Any]:
    wall0 = time.perf_counter()
    run = set_up(cfg, resume, d, device)
    stop = False
    while run.state["epoch"] < cfg.epochs and not stop:
        record, stop = train_epoch(run)
        end_epoch(run, record)
    summary = finish(run)
    summary["wall_seconds"] = time.perf_counter() - wall0
    if d.main:
        write_whole(run.out / "summary.json", json.dumps(summary, indent=1) + "\n")
        if (run.out / "metrics.jsonl").is_file():
            plot_curves(run.out / "metrics.jsonl", run.out / "curves.png")
    return summary


def check_learned(run: Run) -> dict[str, Any] | None:
    """After the last epoch: the ``verdict`` on the best epoch against the label prior on validation, and whether the
    run memorised. A run that did not learn says so loudly, and ``best/`` is marked ``"learned": false`` in its
    config (export and serve warn about such a model); a run above the prior that its split cannot tell from chance
    gets a warning with the figures and the bound. None without a validation split or a best epoch."""
    data, state, c = run.data, run.state, run.model.config
    if data.val is None or not len(data.val) or state["best_epoch"] is None:
        return None
    train_targets = data.train.targets if data.train is not None else data.val.targets
    prior, answer = prior_score(train_targets, data.val.targets)
    key = "exact match" if c.task == "multi_label" else "top-1"
    names = [c.labels[int(i)] for i in answer.split(",") if i]
    said = verdict(
        state["best_acc"], prior, len(data.val), " + ".join(names) if names else "no label", key, state["best_epoch"]
    )
    records = [json.loads(line) for line in (run.out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    last = records[-1] if records else {}
    gap = last.get("train_acc", 0.0) - last.get("val_acc", 0.0)
    if gap > MEMORISING_GAP:
        log.warning(
            "the run memorised its training images: %s %.1f %% on them against %.1f %% on validation in the "
            "last epoch; more images, --augment shift (if position varies), or a larger --weight-decay "
            "usually help",
            key,
            100 * last["train_acc"],
            100 * last["val_acc"],
        )
    if said.learned is False:
        log.error("%s", said.message)
        mark_not_learned(run.out / "best", state["best_acc"], prior)
    elif said.learned is None:
        log.warning("%s", said.message)
    return {"learned": said.learned, "prior": prior}


def mark_not_learned(best_dir: Path, best: float, prior: float) -> None:
    """Record in ``best_dir``'s config.json that its model did not beat the label prior (``NOT_LEARNED``)."""
    payload = json.loads((best_dir / CONFIG).read_text())
    payload.setdefault("training", {}).update({NOT_LEARNED: False, "best_val": best, "prior_val": prior})
    write_whole(best_dir / CONFIG, json.dumps(payload, indent=2) + "\n")  # a full disk leaves the old one whole


def calibrate_best(best_dir: Path, val: Split, batch_size: int, device: torch.device) -> list[float]:
    """Multi-label: per-class thresholds fitted on the validation split, stored in ``best_dir``'s config."""

    best = load_model(best_dir, device)
    thresholds = fit_thresholds(predict_logits(best, val, None, batch_size, device), val.targets.cpu())
    store_thresholds(best_dir, best, thresholds)
    log.info(
        "thresholds calibrated on the validation split (stored in %s): %s",
        best_dir,
        ", ".join(f"{lab} {t:.2f}" for lab, t in zip(best.config.labels, thresholds, strict=True)),
    )
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
