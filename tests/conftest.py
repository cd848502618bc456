"""Fixtures shared by the cache and CLI tests, and the test tiers (see tests/tiers.py).

`python -m pytest -q` runs the fast tier; `python -m pytest -q --full` also runs every case marked
`full` (the whole compile sweep: run it before submitting kernel changes).
"""
import cache_helpers as ch
import pytest


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true",
                     help="also run the cases marked `full` (the whole compile sweep; see tests/tiers.py)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--full"):
        return
    skip = pytest.mark.skip(reason="full sweep only: run `python -m pytest -q --full`")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """A cache holding real compiled entries, built once per test session (compiling is the slow part)."""
    return ch.golden_cache(tmp_path_factory)


@pytest.fixture
def copy(golden, tmp_path):
    """A private copy of the golden cache that a test may damage."""
    return ch.copy_cache(golden[0], tmp_path / "cache")


@pytest.fixture(autouse=True)
def _fresh_validation_memo(monkeypatch):
    """kdajit.validate remembers the signatures of valid calls: a test that stubs its device check must not
    leave entries behind that would let the next test's CPU tensors through."""
    from kdajit import validate
    monkeypatch.setattr(validate, "_VALID_SIGNATURES", {})


@pytest.fixture(autouse=True)
def _fresh_kernels_memo(monkeypatch):
    """kdajit.api memoizes each call's kernels: a test that stubs the lookups (cache.get_kernels, api._spec) must not
    leave answers behind for the next test's calls."""
    from kdajit import api
    monkeypatch.setattr(api, "_KERNELS_MEMO", {})
