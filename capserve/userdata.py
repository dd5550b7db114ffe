"""Moved to ``capserve.data.own``: this module only keeps old imports
(``from capserve.userdata import ...``) working."""

from capserve.data.own import *  # noqa: F403
