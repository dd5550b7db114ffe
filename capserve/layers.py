"""Moved to ``capserve.model.backbones`` and ``capserve.routing`` (each algorithm's layers beside its maths): this
module only keeps old imports (``from capserve.layers import ...``) working."""

from capserve.model.backbones import *  # noqa: F403
from capserve.routing import *  # noqa: F403
