"""Training: ``TrainConfig`` (``config``), the loop (``loop.train``), resumable state and ``--init`` (``state``),
DDP (``distributed``) and the command line (``cli``)."""

from __future__ import annotations

from capserve.plots import plot_curves  # noqa: F401
from capserve.train.cli import add_arguments, run  # noqa: F401  (the `capserve train` command)
from capserve.train.config import (  # noqa: F401
    AMP,
    DEFAULT_LR,
    DEFAULT_VAL_SIZE,
    MILESTONES,
    OPTIMIZERS,
    SCHEDULES,
    WARMUP,
    TrainConfig,
    lr_factor,
    read_resume_config,
)
from capserve.train.distributed import Dist, setup_distributed  # noqa: F401
from capserve.train.loop import (  # noqa: F401
    build_model,
    calibrate_best,
    improves,
    load_own_training,
    loss_and_hits,
    make_optimizer,
    train,
    val_size_of,
    validate,
)
from capserve.train.state import init_architecture, init_from  # noqa: F401
