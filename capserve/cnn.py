"""Moved to ``capserve.model.cnn``: this module only keeps old imports
(``from capserve.cnn import ...``) working."""

from capserve.model.cnn import *  # noqa: F403
