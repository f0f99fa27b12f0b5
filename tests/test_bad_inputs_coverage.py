"""The bad-input tables (tests/test_bad_inputs_*.py) together cover the public API.

Reads every table, so it needs what they need (Flax, for the Flax table): the
oldest-versions run leaves it out.
"""

from __future__ import annotations

import importlib
import pathlib

import optax_accum

SUITES = sorted(
    p.stem
    for p in pathlib.Path(__file__).parent.glob("test_bad_inputs_*.py")
    if p.stem != pathlib.Path(__file__).stem
)
# State NamedTuples and the accumulators' leaves are built by init, never by hand; their
# misuse is covered through the functions that take a state.
BUILT_BY_INIT = {
    "AGNState",
    "ConditionalAccumulatorState",
    "DenseRows",
    "DropStaleGradientsState",
    "RecordGlobalNormState",
    "RowBuffer",
    "SparseConditionalAccumulatorState",
}
SHORT = {
    "accumulator": "conditional_accumulator",
    "sparse": "sparse_conditional_accumulator",
    "drop_stale": "drop_stale_gradients",
}


def _calls() -> list:
    calls = []
    for name in SUITES:
        module = importlib.import_module(name)
        for table in ("BAD", "HOST_BAD", "STATEFUL_BAD"):
            calls += getattr(module, table, [])
    return calls


def test_every_module_has_a_bad_input_suite():
    assert len(SUITES) >= 11, SUITES


def test_enough_malformed_calls_across_the_public_api():
    calls = _calls()
    assert len(calls) >= 40
    named = {b.id.split("/")[0].split(".")[0] for b in calls}
    covered = {SHORT.get(n, n) for n in named}
    public = set(optax_accum.__all__) - BUILT_BY_INIT
    assert public - covered <= {"sparse_sgd"}, public - covered
