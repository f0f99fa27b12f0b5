"""The trap of openxla/xla #49143: embedding gradients summed inside a `scan`.

XLA once moved an all-reduce out of a loop that accumulated embedding gradients and
compiled it wrongly for TPU (109,628 wrong elements). The step below is that pattern
on the one-reduction path: each step takes its batch in micro-batches inside a
`jax.lax.scan`, each micro-batch's embedding gradient (a scatter-add of rows, many ids
repeated) left unreduced over the data axis (`optax_accum.unreduced_grad` on a table
typed reduced), summed in the scan's carry, then across held steps by
`conditional_accumulator`; the window's one all-reduce runs in its release.

- On 8 CPU devices, the released sum equals the gradient of the window's whole batch
  computed at once on one device, exactly in float32 (integer-valued rows, so no
  order of additions may round).
- Compiled for TPU v5e (when libtpu is installed), each reduction stands where it
  must: the loop (the scan) reduces nothing, a held step reduces nothing, and the
  release all-reduces the table once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum.demo import tpu

ROWS, WIDTH = 64, 8  # the embedding table
STEPS = 4  # held steps per window (the last releases)
MICRO, BATCH = 4, 32  # micro-batches a step, ids per micro-batch (split over devices)


def _loss(table: jax.Array, ids: jax.Array, coef: jax.Array) -> jax.Array:
    """Linear in the looked-up rows: the gradient is `coef` scatter-added at `ids`."""
    return jnp.sum(table[ids] * coef)


def _step(tx: optax.GradientTransformation):
    grad_fn = optax_accum.unreduced_grad(_loss, "data", reduction="sum")

    def step(table, state, ids, coef):  # ids: (MICRO, BATCH), coef: (MICRO, BATCH, WIDTH)
        first = grad_fn(table, ids[0], coef[0])

        def add(total, batch):
            return total + grad_fn(table, *batch), None

        total, _ = jax.lax.scan(add, first, (ids[1:], coef[1:]))
        return optax_accum.apply_gradients(tx, total, state, table)

    return step


def _tx() -> optax.GradientTransformation:
    """Releases the window's sum itself: the updates are the summed gradient."""
    return optax_accum.conditional_accumulator(optax.identity(), STEPS, reduction="sum")


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [
        (
            rng.integers(0, ROWS, (MICRO, BATCH)).astype(np.int32),  # ids repeat often
            rng.integers(-3, 4, (MICRO, BATCH, WIDTH)).astype(np.float32),
        )
        for _ in range(STEPS)
    ]


def test_micro_batches_and_held_steps_sum_to_the_full_batch_gradient_exactly():
    tx, batches = _tx(), _batches()
    with jax.set_mesh(jax.make_mesh((8,), ("data",))):
        table = optax_accum.as_reduced(jnp.zeros((ROWS, WIDTH)), "data")
        state = tx.init(table)
        step = jax.jit(_step(tx), donate_argnums=(0, 1))
        compiled = None
        for i, (ids, coef) in enumerate(batches):
            args = (
                table,
                state,
                jax.reshard(jnp.asarray(ids), P(None, "data")),
                jax.reshard(jnp.asarray(coef), P(None, "data")),
            )
            compiled = compiled or step.lower(*args).compile()
            table, state = compiled(*args)
            if i < STEPS - 1:  # a held step leaves the table as it was
                np.testing.assert_array_equal(np.asarray(table), 0.0)
    ids = np.concatenate([b[0].reshape(-1) for b in batches])
    coef = np.concatenate([b[1].reshape(-1, WIDTH) for b in batches])
    want = jax.jit(jax.grad(_loss))(jnp.zeros((ROWS, WIDTH)), ids, coef)
    assert np.abs(np.asarray(want)).max() > 8  # rows hit many times, both signs
    np.testing.assert_array_equal(np.asarray(table), np.asarray(want))
    released = [c for c in tpu.read_text(compiled.as_text()).collectives]
    assert [(c.opcode, c.every_step) for c in released] == [("all-reduce", False)], released


@pytest.mark.skipif(bool(tpu.unavailable()), reason=str(tpu.unavailable()))
def test_on_tpu_the_scan_and_the_held_step_reduce_nothing():
    mesh = tpu.mesh(tpu.TOPOLOGIES["v5e"], ("data",))
    tx = _tx()

    def struct(shape, spec, dtype=jnp.float32):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    table = struct((ROWS, WIDTH), P(None, None, reduced={"data"}))
    ids = struct((MICRO, BATCH), P(None, "data"), jnp.int32)
    coef = struct((MICRO, BATCH, WIDTH), P(None, "data"))
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, table)
        step = jax.jit(_step(tx), donate_argnums=(0, 1))
        program = tpu.read(step.lower(table, state, ids, coef).compile())
    assert program.loops == 1, "the scan over micro-batches is a loop"
    table_bytes = ROWS * WIDTH * 4
    # The window's one reduction: the table's, in the release's branch; none in the
    # loop's body (where the micro-batches are summed) and none on every step.
    assert [(c.opcode, c.nbytes, c.where) for c in program.collectives] == [
        ("all-reduce", table_bytes, ("conditional",))
    ], program.collectives
    assert program.conditionals == 1
