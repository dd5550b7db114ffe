"""Moved to ``capserve.data.preprocess``: this module only keeps old imports
(``from capserve.preprocess import ...``) working."""

from capserve.data.preprocess import *  # noqa: F403
