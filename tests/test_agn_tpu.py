"""Streaming DiLoCo's sync against the step's compute, in the program the TPU compiler
makes of a whole train step (deviceless; `benchmarks/agn_tpu.py` builds and reads it).

A worker a chip, two tanh layers, `agn` with a fragment per layer and one on every step
(`communication_period == fragments`), its reduction known when the step starts
(`delay` >= 1). What the compiler does with it (libtpu of jax 0.10.2):

- one v5e slice, default options, and with the async collective options of pod
  configs: a synchronous all-reduce, overlapping nothing;
- with `--xla_enable_async_all_reduce=true` too: an async collective; with delay 1 it
  starts before every forward fusion and completes before the backward fusions (the
  last ones fuse the params' update, which reads the new centre); with delay 2 (the
  step's updates do not read this step's reduction) it completes after every one;
- two v5e slices (the reduction crosses the data-center network), default options:
  the transfer to the other slice is in flight over the whole forward and backward
  pass (delay 2);
- a sync every other step (`communication_period == 2 * fragments`): the reduction
  sits inside a conditional's branch and overlaps nothing.
"""

from __future__ import annotations

import pytest

from optax_accum.demo import tpu

_REASON = tpu.unavailable()
if _REASON:
    pytest.skip(f"TPU programs are not compiled here: {_REASON}", allow_module_level=True)

from benchmarks import agn_tpu as A  # noqa: E402

DOTS = "ffbbb"  # the fusions holding the two layers' forward and backward dots


def _dots(sequence: str) -> str:
    return "".join(c for c in sequence if c in "fb")


@pytest.mark.parametrize("options", ["default", "async fusion"])
def test_one_slice_without_async_all_reduce_is_synchronous(options):
    found = A.overlap(A.program(options=options))
    assert _dots(found.sequence) == DOTS
    assert "R" in found.sequence and "<" not in found.sequence
    assert found.overlapped == ""


def test_one_slice_async_all_reduce_overlaps_the_step():
    blended_now = A.overlap(A.program(delay=1, options="+ async all-reduce"))
    assert blended_now.sequence.startswith("<")  # before every forward fusion
    assert blended_now.overlapped == "ff"  # the backward fusions read the new centre
    later = A.overlap(A.program(delay=2, options="+ async all-reduce"))
    assert later.sequence.endswith(">")  # after every backward fusion
    assert later.overlapped.endswith("bbb") and len(later.overlapped) >= 4


def test_two_slices_send_the_fragment_while_the_step_computes():
    found = A.overlap(A.program(slices=2))
    assert found.sequence.index("<") < found.sequence.index("f")
    assert found.overlapped == DOTS  # in flight over the whole forward and backward pass


def test_a_sync_in_a_branch_overlaps_nothing():
    found = A.overlap(A.program(slices=2, period=4))
    assert found.sequence.count("C") == 2  # one conditional per fragment
    assert "<" not in found.sequence and found.overlapped == ""
