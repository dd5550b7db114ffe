"""Package discovery (pyproject.toml holds everything else).

Every package under ``capserve/`` is found, and the top-level ``export/`` folder installs as ``capserve.export``
with its subpackages: no hand-kept list that a new subpackage can be missing from (tests/test_wheel.py checks
the built wheel).
"""

from setuptools import find_packages, setup

setup(
    packages=[
        *find_packages(include=["capserve", "capserve.*"]),
        *("capserve." + name for name in find_packages(include=["export", "export.*"])),
    ],
    package_dir={"capserve.export": "export"},
)
