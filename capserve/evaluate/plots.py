"""Figures for training runs and evaluations (matplotlib, optional: without it no PNG is written)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


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


def _pyplot(png: Path) -> Any:
    """matplotlib.pyplot on the Agg backend, or None (with a log line naming ``png``) when it is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.info("matplotlib is not installed: skipping %s (pip install 'capserve[train]')", png)
        return None
    return plt


def plot_iterations(results: dict[int, dict[str, Any]], key: str, png: Path, title: str) -> Path | None:
    plt = _pyplot(png)
    if plt is None:
        return None
    Ts = sorted(results)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(Ts, [100 * results[T][key] for T in Ts], marker="o")
    ax.set_xlabel("routing iterations T")
    ax.set_ylabel(f"{key} (%)")
    ax.set_xticks(Ts)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


COUNTED_LABELS = 30  # up to this many labels a confusion matrix shows its counts (PNG) or prints whole (terminal)


def plot_confusion(confusion: list[list[int]], labels: Sequence[str], png: Path, title: str) -> Path | None:
    """The confusion matrix as a PNG with the label names (rows true, columns predicted; counts for ≤ 30 labels)."""
    plt = _pyplot(png)
    if plt is None:
        return None
    C = len(labels)
    side = min(4 + 0.45 * C, 40)
    fig, ax = plt.subplots(figsize=(side, side))
    ax.imshow(confusion, cmap="Blues")
    ax.set_xticks(range(C), labels, rotation=90)
    ax.set_yticks(range(C), labels)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title)
    if C <= COUNTED_LABELS:
        peak = max(max(row) for row in confusion) or 1
        for i, row in enumerate(confusion):
            for j, v in enumerate(row):
                ax.text(j, i, str(v), ha="center", va="center", color="white" if v > peak / 2 else "black", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
