"""Shared test options and fixtures.

``--runslow`` also runs the tests marked ``slow`` (the 10k-request parity case).
Hypothesis runs derandomized (profile ``ci``) unless ``HYPOTHESIS_PROFILE=explore``.
pyproject.toml deselects them by default with ``addopts = "-m 'not slow'"``; an
explicit ``-m`` expression given on the command line is left alone, only that
default is lifted.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

# Property tests draw the same examples on every run unless asked otherwise, so the
# suite's time and outcome do not swing between CI runs; HYPOTHESIS_PROFILE=explore
# draws fresh ones (and AISIM_PROPERTY_EXAMPLES scales how many, test_properties).
settings.register_profile("ci", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from support.paths import DATA_DIR  # noqa: E402  (tests/ is on the path: this file is its conftest)

GOLDEN_DIR = DATA_DIR / "golden"
TRACES_DIR = DATA_DIR / "traces"
REFERENCE_DIR = Path("/work/shared/reference")

_DEFAULT_MARKEXPR = "not slow"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (lifts the default -m 'not slow')")


ROOMS = ("unit", "oracle", "golden", "cli")  # tests/<room>/: each also a marker (-m unit, ...)


def pytest_collection_modifyitems(config, items):
    for item in items:
        room = Path(str(item.fspath)).parent.name
        if room in ROOMS:
            item.add_marker(room)


def pytest_configure(config):
    if config.getoption("--runslow"):
        # Only the pyproject default is replaced: ``-m 'not slow'`` coming from
        # addopts would otherwise deselect what --runslow asks for. A user's own
        # later -m (e.g. -m handoff) has already overwritten markexpr and stays.
        if (config.option.markexpr or "").strip() == _DEFAULT_MARKEXPR:
            config.option.markexpr = ""


@pytest.fixture(scope="session")
def data_dir() -> Path:
    return DATA_DIR


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return GOLDEN_DIR


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    return TRACES_DIR


@pytest.fixture(scope="session")
def reference_dir() -> Path:
    """The reference tool folder (parity.py); tests using it skip when absent."""
    if not (REFERENCE_DIR / "parity.py").is_file():
        pytest.skip("reference tools not available at %s" % REFERENCE_DIR)
    return REFERENCE_DIR
