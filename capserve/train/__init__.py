"""Training: ``TrainConfig`` (``config``), the loop (``loop.train``), resumable state and ``--init`` (``state``),
DDP (``distributed``) and the command line (``cli``)."""

from __future__ import annotations

from capserve.train.config import TrainConfig
from capserve.train.loop import train

__all__ = ["TrainConfig", "train"]
