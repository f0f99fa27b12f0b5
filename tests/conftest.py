"""Test ordering (the oldest-versions run starts first), and shared fixtures.

tests/test_oldest_versions.py is one long test (a venv install, then the core tests in
a subprocess). Collected first, it starts at once on one pytest-xdist worker while the
other works through the rest of the suite, instead of starting last and running alone.
(Devices and dtype promotion are set in the repository's top-level conftest.py.)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

FIRST = "tests/test_oldest_versions.py::"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: order kept


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A pool of 16 threads for the host accumulator tests, shut down after the test."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as executor:
        yield executor
