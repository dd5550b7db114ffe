"""A progress bar over images (tqdm), with log records on lines of their own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def progress_bar(total: int, desc: str) -> Iterator[Any]:
    """A tqdm bar over ``total`` images. Log records (a warning from the model, say) print on lines of their own
    above it, instead of at the end of the bar's line."""
    from tqdm import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    with (
        logging_redirect_tqdm(),
        tqdm(total=total, desc=desc, unit="img", mininterval=0.5, leave=True, dynamic_ncols=True) as bar,
    ):
        yield bar
