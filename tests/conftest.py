"""Test ordering: the oldest-versions run starts first.

tests/test_oldest_versions.py is one long test (a venv install, then the core tests in
a subprocess). Collected first, it starts at once on one pytest-xdist worker while the
other works through the rest of the suite, instead of starting last and running alone.
(Devices and dtype promotion are set in the repository's top-level conftest.py.)
"""

from __future__ import annotations

import pytest

FIRST = "tests/test_oldest_versions.py::"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # stable: order kept
