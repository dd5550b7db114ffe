"""Training: ``TrainConfig`` (``config``), every data-derived choice made once (``plan``), the loop
(``loop.train``), the verdict on learning (``verdict``), resumable state and ``--init`` (``state``), DDP
(``distributed``) and the command line (``cli``)."""

from __future__ import annotations

from capserve.train.config import TrainConfig
from capserve.train.loop import train

__all__ = ["TrainConfig", "train"]
