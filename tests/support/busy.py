"""Another process using the CPU beside a test, as CI's other jobs or a laptop's other programs do."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

SPIN = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"


@contextmanager
def busy_core(seconds: float = 600.0) -> Iterator[None]:
    """One process spinning on a core while the block runs (and for at most ``seconds``, should the test die)."""
    spinner = subprocess.Popen([sys.executable, "-c", SPIN, str(seconds)])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()
