"""Moved to ``capserve.model.checkpoint`` (and ``load`` to ``capserve.model.factory``): this module only keeps old
imports (``from capserve.checkpoint import ...``) working."""

from capserve.model.checkpoint import *  # noqa: F403
from capserve.model.factory import load  # noqa: F401
