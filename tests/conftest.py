"""Test ordering (the longest tests start first), and shared fixtures.

tests/test_oldest_versions.py is one long test (the core tests in a subprocess, on
the oldest versions). Collected first, it starts at once on one pytest-xdist worker
while the other works through the rest of the suite, instead of starting last and
running alone. Next come the suites whose tests each start processes (notebook
kernels, workers, the demo, the docs build): seconds each, they are spread over the
workers early, and the run ends on short tests that keep both workers busy to the end.
pyproject.toml's `--maxschedchunk=1` makes pytest-xdist follow this order: each worker
takes the next test when it is done, instead of a long run of tests queued in advance
(which, on the oldest-versions run's worker, would wait minutes behind it).
(Devices, dtype promotion and the Hypothesis profiles are set in the repository's
top-level conftest.py.)
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator

import pytest

FIRST = "tests/test_oldest_versions.py::"
# Files whose tests take seconds each (measured with --durations), longest first.
# The first test of a module whose fixture is shared by the workers (tests/_session.py)
# comes early; its other tests, which read the result, stay where they are.
EARLY = [
    "tests/test_preemption.py::test_killed_at_every_planned_step",
    "tests/test_orbax.py::test_restore_in_fresh_process_continues_bit_identically[conditional_accumulator]",
    "tests/test_multihost.py::",
    "tests/test_notebooks.py::test_notebook_runs_top_to_bottom",
    "tests/test_benchmarks.py::",
    "tests/test_demo.py::",
    "tests/test_porting.py::",
    "tests/test_docs.py::test_sphinx",
    # A Ray cluster per pytest-xdist worker (conftest.py's ray_cluster), started by the
    # first of these; each test starts Ray actors (a process each, seconds).
    "tests/test_ray.py::test_four_asynchronous_workers",
    "tests/test_ray.py::test_random_program_from_three_processes",
    "tests/test_ray.py::test_payloads_travel",
    "tests/test_ray.py::test_a_",
    "tests/test_ray.py::",
    # Sparse accumulators under shard_map on 8 devices, and their vmap reference.
    "tests/test_shard_map_window.py::test_one_reduction_per_window_and_the_values_of_one_device[sparse_row",
]


def _rank(item: pytest.Item) -> int:
    if item.nodeid.startswith(FIRST):
        return 0
    return next((1 + i for i, p in enumerate(EARLY) if item.nodeid.startswith(p)), 1 + len(EARLY))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=_rank)  # stable: the order within a rank is kept
    # pytest-xdist hands each worker its next test ahead (pyproject.toml's
    # --maxschedchunk=1 keeps it to one): the one behind the oldest-versions run waits
    # for it, so make it a short one, the first test of the last rank.
    if items and _rank(items[0]) == 0:
        short = next((i for i, item in enumerate(items) if _rank(item) > len(EARLY)), None)
        if short is not None:
            items.insert(1, items.pop(short))


@pytest.fixture
def pool() -> Iterator[concurrent.futures.ThreadPoolExecutor]:
    """A pool of 16 threads for the host accumulator tests, shut down after the test."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=16) as executor:
        yield executor


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """When the tests that compile for TPU (tests/test_tpu_compiled.py and the TPU halves
    of test_tpu_reader.py and test_embedding_scan.py) were skipped, why: said once, at
    the end of the run (where `-q` still prints)."""
    from optax_accum.demo import tpu

    reason = tpu.unavailable()
    if reason:
        terminalreporter.write_line(f"TPU compile tests skipped: {reason}")
