"""Fixtures shared by the cache and CLI tests."""
import cache_helpers as ch
import pytest


@pytest.fixture(scope="session")
def golden(tmp_path_factory):
    """A cache holding real compiled entries, built once per test session (compiling is the slow part)."""
    return ch.golden_cache(tmp_path_factory)


@pytest.fixture
def copy(golden, tmp_path):
    """A private copy of the golden cache that a test may damage."""
    return ch.copy_cache(golden[0], tmp_path / "cache")
