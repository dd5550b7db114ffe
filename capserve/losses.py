"""Moved to ``capserve.routing`` (each algorithm's loss beside its maths; the table in ``capserve.routing.losses``):
this module only keeps old imports (``from capserve.losses import ...``) working."""

from capserve.routing import *  # noqa: F403
