"""Did a run learn (``check_learned``)? Its best validation score against the label prior: always answering the
training split's most common label (or label set), what a model that learned nothing from the images reaches
(``verdict``)."""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from capserve.configs import ModelConfig
from capserve.data.builtin import Data
from capserve.model.checkpoint import NOT_LEARNED, update_config

__all__ = [
    "LEARNED_SHARE",
    "MEMORISING_GAP",
    "TRY_NEXT",
    "Verdict",
    "can_tell",
    "chance_level",
    "check_learned",
    "has_learned",
    "images_to_tell",
    "learning_bound",
    "mark_not_learned",
    "prior_score",
    "standard_error",
    "verdict",
]

log = logging.getLogger(__name__)

MEMORISING_GAP = 0.3  # train minus validation score above which the log names a run as memorising


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


# a run that learned, for telling one apart on a small split: right on this share of the images that always answering
# the prior gets wrong
LEARNED_SHARE = 0.5


def can_tell(prior: float, n: int) -> bool:
    """Whether ``n`` validation images can tell a run that did not learn from one that did: a run that learned (right
    on ``LEARNED_SHARE`` of the images the ``prior``'s answer gets wrong) scores, but for two of its own standard
    errors, above ``chance_level``. Where it could fall below, a score at chance says nothing about learning."""
    learned = prior + LEARNED_SHARE * (1 - prior)
    return learned - 2 * standard_error(learned, n) > chance_level(prior, n)


MOST_IMAGES = 100_000  # images_to_tell's answer where no split can tell (a prior of 100 %)


def images_to_tell(prior: float) -> int:
    """The fewest validation images that ``can_tell`` at ``prior`` (``MOST_IMAGES`` if none up to it)."""
    return next((n for n in range(1, MOST_IMAGES) if can_tell(prior, n)), MOST_IMAGES)


def has_learned(best: float, prior: float, n: int) -> bool:
    """Whether a best validation score ``best`` over ``n`` images is clearly above the ``prior`` score
    (``learning_bound``)."""
    return best > learning_bound(prior, n)


@dataclass(frozen=True)
class Verdict:
    """What a run's best validation score says about its learning (``verdict``).

    ``learned``: True, clearly above the label prior (``learning_bound``); False, at the prior (at most
    ``chance_level``) on a split large enough that a run which learned would have scored above it (``can_tell``):
    the run fails and ``best/`` is marked; None, between the two, or on a split too small to tell: the run does not
    fail. ``message``: what
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
    if not can_tell(prior, n):
        needed = images_to_tell(prior)
        more = (
            f"it takes about {needed} validation images at this prior: give --val-size {needed} (or more), a val/ "
            "split, or more images"
            if needed < MOST_IMAGES
            else "no number of images can at this prior: give a validation split with other answers"
        )
        return Verdict(
            None,
            f"the validation split ({n} images) is too small to tell a model that learned from one that did not: "
            f"{scored}, against {always}. On {n} images a model that learned nothing reaches up to "
            f"{100 * min(chance, 1):.1f} % by chance, and one that learned can score below that; clear of chance "
            f"takes {clears}. best/ is not marked. To tell, {more}",
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


def check_learned(out: Path, data: Data, state: dict[str, Any], config: ModelConfig) -> dict[str, Any] | None:
    """After the last epoch of the run in ``out``: the ``verdict`` on the best epoch against the label prior on
    validation, and whether the run memorised. A run that did not learn says so loudly, and ``best/`` is marked
    ``"learned": false`` in its config (export and serve warn about such a model); a run above the prior that its
    split cannot tell from chance gets a warning with the figures and the bound. None without a validation split or
    a best epoch."""
    c = config
    if data.val is None or not len(data.val) or state["best_epoch"] is None:
        return None
    train_targets = data.train.targets if data.train is not None else data.val.targets
    prior, answer = prior_score(train_targets, data.val.targets)
    key = "exact match" if c.task == "multi_label" else "top-1"
    names = [c.labels[int(i)] for i in answer.split(",") if i]
    said = verdict(
        state["best_acc"], prior, len(data.val), " + ".join(names) if names else "no label", key, state["best_epoch"]
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
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
        mark_not_learned(out / "best", state["best_acc"], prior)
    elif said.learned is None:
        log.warning("%s", said.message)
    return {"learned": said.learned, "prior": prior}


def mark_not_learned(best_dir: Path, best: float, prior: float) -> None:
    """Record in ``best_dir``'s config.json that its model did not beat the label prior (``NOT_LEARNED``)."""
    update_config(best_dir, training={NOT_LEARNED: False, "best_val": best, "prior_val": prior})
