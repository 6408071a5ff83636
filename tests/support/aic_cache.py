"""The AIC value cache (``AISIM_FAST_CACHE_DIR``) in a folder of a test module's own, as
on a fresh machine: ``own_value_cache = pytest.fixture(autouse=True, scope="module")(
fresh_value_cache)`` in the module."""

import pytest


def fresh_value_cache(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("AISIM_FAST_CACHE_DIR", str(tmp_path_factory.mktemp("aic_cache")))
    yield
    mp.undo()
