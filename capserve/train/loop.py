"""The training loop: a run folder from a ``TrainConfig`` (``train``), one epoch at a time, resumable exactly.

The best epoch is chosen on a validation split carved from the training set, never on the test set, which is
evaluated once at the end on ``best/``. A run folder holds ``last/`` (model, optimizer and trainer state: what
``--resume`` continues from), ``best/`` (a plain model directory), ``metrics.jsonl``, ``curves.png`` and
``summary.json``. Every choice the data decides is made before the loop starts (``capserve.train.plan``); the
recipe's defaults live in ``capserve.train.config``; docs/training.md is the manual.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from capserve.configs import ModelConfig
from capserve.data.augment import apply_augment
from capserve.data.builtin import Data, load_test
from capserve.data.preprocess import normalize
from capserve.data.progress import progress_bar
from capserve.data.splits import Split
from capserve.evaluate.evaluator import predict_logits, store_thresholds
from capserve.evaluate.familiar import calibrate_familiarity
from capserve.evaluate.metrics import fit_thresholds
from capserve.evaluate.plots import plot_curves
from capserve.files import replacing_directory, write_whole
from capserve.model.checkpoint import save_model
from capserve.model.factory import Model
from capserve.model.factory import load as load_model
from capserve.routing.losses import training_loss
from capserve.runtime.outputs import multi_label_decisions
from capserve.train.amp import deterministic_kernels
from capserve.train.backbone_loss import BackboneClassifier, backbone_classifier
from capserve.train.config import AMP, TrainConfig, lr_factor
from capserve.train.distributed import Dist, setup_distributed
from capserve.train.optimizer import make_optimizer
from capserve.train.plan import Plan, plan_run
from capserve.train.state import init_from, load_state, provenance, save_state
from capserve.train.verdict import check_learned

__all__ = [
    "Run",
    "calibrate_best",
    "drop_unsaved_epochs",
    "improves",
    "loss_and_hits",
    "set_up",
    "train",
    "validate",
]

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------- metrics


def improves(acc: float, loss: float | None, best_acc: float | None, best_loss: float | None) -> bool:
    """Whether an epoch with validation ``acc`` and ``loss`` beats the best so far. A tie in accuracy (a slow learner's
    early epochs stay at 0 % exact match) goes to the lower loss, which every loss computes at its end-of-training
    margin when validating, so that epochs compare."""
    if best_acc is None or acc > best_acc:
        return True
    return acc == best_acc and loss is not None and (best_loss is None or loss < best_loss)


def loss_and_hits(
    logits: Tensor, targets: Tensor, config: ModelConfig, progress: float = 1.0, label_smoothing: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Mean loss (``config``'s routing's own, ``capserve.routing.losses``; a training step's with its targets smoothed
    by ``label_smoothing``, validation's without) and the number of correct images (top-1, or exact match under the
    server's decision rule and the config's thresholds for multi-label); ``progress`` is the fraction of training
    done (for schedules)."""
    logits = logits.float()
    multi_label = config.task == "multi_label"
    loss = training_loss(config, label_smoothing)(logits, targets, multi_label, progress)
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


def train(cfg: TrainConfig, resume: str | Path | None = None) -> dict[str, Any]:
    """Run training as ``cfg`` says (continuing from ``resume``'s ``last/`` if given); return the summary."""
    d, device = setup_distributed(cfg.device)
    try:
        with deterministic_kernels(device):
            return _train(cfg, resume, d, device)
    finally:
        if d.enabled and dist.is_initialized():
            dist.destroy_process_group()


@dataclass
class Run:
    """What a training run holds between its steps: its plan (the resolved choices and the data), the model and its
    optimizer, the counters that ``last/`` saves (``state``), and the wall clock of this process's part of the run."""

    plan: Plan
    d: Dist
    device: torch.device
    out: Path
    model: Model
    net: torch.nn.Module  # the model, or its DDP wrapper
    opt: torch.optim.Optimizer
    scaler: Any
    state: dict[str, Any]
    init: dict[str, Any] | None = None
    backbone_head: BackboneClassifier | None = None  # --backbone-loss: training only, saved in last/ alone
    resumed_elapsed: float = 0.0  # training seconds of the pieces before this one (--resume)
    started: float = field(default_factory=time.perf_counter)
    steps_this_run: int = 0

    @property
    def cfg(self) -> TrainConfig:
        return self.plan.cfg

    @property
    def data(self) -> Data:
        return self.plan.data

    @property
    def steps_per_epoch(self) -> int:
        return self.data.epoch_size // self.cfg.batch_size

    def elapsed(self) -> float:
        """Training seconds of the whole run, resumed pieces included."""
        return self.resumed_elapsed + time.perf_counter() - self.started


def place(model: Model, cfg: TrainConfig, d: Dist, device: torch.device) -> torch.nn.Module:
    """``model`` on ``device`` in the memory format ``cfg`` asks for, its frozen part frozen; returns what the steps
    call: the model, or its DDP wrapper."""
    if cfg.freeze == "backbone":
        model.backbone.requires_grad_(False)
    model.to(device)
    if cfg.channels_last:
        model.to(memory_format=torch.channels_last)
    if not d.enabled:
        return model
    return torch.nn.parallel.DistributedDataParallel(
        model, device_ids=[device.index] if device.type == "cuda" else None
    )


def continue_from(run: Run, saved: str | Path) -> None:
    """Continue the run saved in ``saved`` (its ``last/``): its model, optimizer, scaler and counters as they were;
    ``metrics.jsonl`` forgets the epochs after that save."""
    cfg, out = run.cfg, run.out
    last = Path(saved) if (Path(saved) / "trainer.json").is_file() else Path(saved) / "last"
    run.state = load_state(last, run.model, run.opt, run.scaler, run.device, run.backbone_head)
    run.resumed_elapsed = run.state["elapsed"]
    if run.d.main:
        drop_unsaved_epochs(out / "metrics.jsonl", run.state["epoch"])
    if run.state["epoch"] >= cfg.epochs:  # a finished run (learned or not) is summed up again, never trained further
        log.warning(
            "%s already trained its %d epochs: --resume has nothing left to train, and sums the run up again "
            "from best/ (the verdict on learning, multi-label thresholds, the test figure, summary.json). To "
            "train further, start a new run from its weights: --init %s --epochs N",
            out,
            cfg.epochs,
            out / "best",
        )
    else:
        log.info("resumed from %s at epoch %d, step %d", last, run.state["epoch"] + 1, run.state["step"])


def set_up(cfg: TrainConfig, resume: str | Path | None, d: Dist, device: torch.device) -> Run:
    """The run's plan (every choice made, the data loaded: ``plan_run``), then its model, built once from the plan
    (``--init`` applied), the optimizer, and the state to start from (``--resume``)."""
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.set_float32_matmul_precision("high")
    plan = plan_run(cfg, resume, d, device)
    cfg, out = plan.cfg, Path(plan.cfg.out)
    model = plan.build_model()
    init = init_from(model, cfg.init, cfg.label_map) if cfg.init and resume is None else None
    net = place(model, cfg, d, device)
    head = backbone_classifier(
        model, cfg.backbone_loss, cfg.backbone_loss_grid
    )  # built after the model: its weights are the same without
    if head is not None:
        head.to(device)
    opt = make_optimizer(model, cfg, head)
    scaler = torch.amp.GradScaler(device.type) if cfg.amp == "fp16" else None
    state: dict[str, Any] = {"epoch": 0, "batch": 0, "step": 0, "elapsed": 0.0, "best_acc": None, "best_epoch": None}
    run = Run(plan, d, device, out, model, net, opt, scaler, state, init, head)
    if resume is not None:
        continue_from(run, resume)
    if d.main:
        plan.record(out)
        log.info(
            "%s on %s: %d train images/epoch, %d validation, %d steps/epoch, %d parameters",
            cfg.model,
            device,
            plan.data.epoch_size,
            len(plan.data.val) if plan.data.val else 0,
            run.steps_per_epoch,
            sum(p.numel() for p in model.parameters()),
        )
    return run


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
        group["lr"] = lr * group.get("lr_scale", 1.0)  # a resumed optimizer recorded before scales has none
    with _autocast(run.device, cfg.amp):
        logits = run.net(x)
    loss, hits = loss_and_hits(logits, y, run.model.config, progress, cfg.label_smoothing)
    head = run.backbone_head
    # the capsules' loss is what the run reports; the backbone classifier's only joins the gradient
    multi_label = run.model.config.task == "multi_label"
    total = loss if head is None else loss + head.loss(y, multi_label, cfg.label_smoothing)
    opt.zero_grad(set_to_none=True)
    if scaler is not None:
        scaler.scale(total).backward()
        scaler.unscale_(opt)
    else:
        total.backward()
    if head is not None and run.d.enabled:
        head.average_gradients()
    if cfg.grad_clip:
        torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], cfg.grad_clip)
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
        save_state(run.out / "last", run.model, run.opt, run.scaler, state, cfg, run.backbone_head)
    if d.enabled:
        dist.barrier()


def finish(run: Run) -> dict[str, Any]:
    """After the last epoch: thresholds for multi-label models, the one test evaluation of ``best/``, and the
    summary (``summary.json``, ``curves.png``)."""
    cfg, d, state, data, c = run.cfg, run.d, run.state, run.data, run.model.config
    device = run.device
    summary: dict[str, Any] = {
        "model": cfg.model,
        "dataset": run.plan.dataset,
        "best_epoch": state["best_epoch"],
        "best_val_acc": state["best_acc"] if data.val is not None else None,
        "steps": state["step"],
        "train_seconds": state["elapsed"],
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "processes": d.world,
        "augment": cfg.augment,
    }
    if run.plan.manifest is not None:
        summary.update(labels=list(c.labels), task=c.task, skipped_images=run.plan.skipped)
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
    learned = check_learned(run.out, data, state, c) if d.main else None
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
    if state["best_epoch"] is not None and d.main and summary.get("learned") is not False:  # "cannot tell" too
        train = data.train if data.train is not None else data.epoch(0, cfg.seed, device)  # generated: one epoch's
        calibrate_familiarity(run.out / "best", train, data.val, device)
    if cfg.test and state["best_epoch"] is not None and d.main:
        test_split = run.plan.test_split if run.plan.manifest is not None else load_test(run.plan.dataset, cfg.data)
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
