"""Moved to ``capserve.data.images`` (normalisation to ``capserve.data.preprocess``): this module only keeps old
imports (``from capserve.images import ...``) working."""

from capserve.data.images import *  # noqa: F403
from capserve.data.preprocess import InputSpec, normalize_images  # noqa: F401
