"""Every public transform on every layout, eagerly and under jit.

Modelled on optax's own sharding tests (`optax/_src/sharding_test.py`), which ask of
each optimizer that `init` works on `jax.ShapeDtypeStruct` params, that every state
leaf's `jax.typeof` is the same after `init` and after `update` under `jax.make_mesh`'s
defaults, and that jit gives eager's types. Here, for every public transform (the
train steps and a nest of accumulators included), on each layout:

- `one_device`: no mesh;
- `explicit`: `jax.make_mesh`'s defaults (explicit axes), under `jax.set_mesh`;
- `auto`: the same mesh with `Auto` axes (classic GSPMD);
- `reduced`: explicit, with the params typed reduced over the batch axis
  (`optax_accum.as_reduced`), so that their gradients come typed unreduced, as
  `jax.grad` gives them;

and each call form (`jit`; `eager`, the same Python step without `jax.jit`):

- `init` works on `jax.ShapeDtypeStruct` params, directly (as optax's tests call it)
  and under `jax.eval_shape` (the guide's recipe), and gives the types of `init` on
  the params;
- `jax.typeof` of every leaf of the params and the state is the same after init and
  after each of three updates, the second of which releases;
- eager gives jit's types (`jax.eval_shape` of the jitted step, which compiles
  nothing) and values (through the reference);
- the params and the state after three updates equal the one-device jitted run (a sum
  typed unreduced read as its true value, a spent sum as zeros), to rounding.

A transform that cannot take reduced params must say so with a TypeError raised by
optax_accum that says what to do (reduce the gradients first, or put an accumulator
inside), never with an error from inside JAX.

The tree mixes the leaves a model has: a float16 kernel sharded on its second axis, a
float32 bias sharded over the mesh's model axis, a replicated matrix, and, for the
sparse accumulator, an embedding table sharded over its rows whose gradient is an
`IndexedSlices` with its ids and rows split over the batch axis. Values are multiples
of 1/8, so the gradients' partial sums are exact in float16 and every layout sees the
same gradients to the bit. The mesh is (data=2, model=4): the batch is split over
`data`, the params over `model`.

Which cells run (the selections below say why): abstract init for every transform on
every layout (no step is compiled); three jitted steps for every transform on the
typed layouts (explicit, reduced) and on one device (the references), and under auto
sharding where tests/test_fsdp.py does not already run the transform against one
device; three eager steps where eager can differ from jit. Each jitted cell compiles
its step once; an eager cell compiles no step, only JAX's op-by-op kernels, which are
shared by the cells a process runs.
"""

from __future__ import annotations

import contextlib
import functools
import re
import traceback
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _cases import lenient, spent_as_zeros
from _session import once
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import optax_accum
from optax_accum import _compat

AXES = ("data", "model")
BATCH = "data"  # the axis gradients are split over; `reduced` types the params over it
STEPS = 3  # the second releases (every accumulator here takes two gradients)
ROWS = 16  # the embedding table's rows: more than the capacity, so it is row-sparse
LAYOUTS = ("one_device", "explicit", "auto", "reduced")
SPECS = {
    "kernel": P(None, "model"),
    "bias": P("model"),
    "replicated": P(),
    "emb": P("model", None),
}


def _adam() -> optax.GradientTransformationExtraArgs:
    return lenient(optax.adam(0.1))


# --------------------------------------------------------------------------- the steps


class Transform(NamedTuple):
    """A public transform, and the step that users write with it."""

    make: Callable[[], optax.GradientTransformation]
    step: str  # a key of STEPS_BY_NAME
    sparse: bool = False  # takes the embedding table, with IndexedSlices gradients
    takes_reduced: bool = True  # False: may refuse reduced params with a TypeError


TRANSFORMS = {
    "conditional_accumulator": Transform(
        lambda: optax_accum.conditional_accumulator(_adam(), 2), "canonical"
    ),
    "sparse_conditional_accumulator": Transform(
        lambda: optax_accum.sparse_conditional_accumulator(
            optax_accum.sparse_sgd(0.1), 2, capacity=8
        ),
        "canonical",
        sparse=True,
    ),
    "drop_stale_gradients": Transform(
        lambda: optax_accum.drop_stale_gradients(_adam(), 1), "canonical", takes_reduced=False
    ),
    "drop_stale_accumulator": Transform(
        lambda: optax_accum.drop_stale_gradients(
            optax_accum.conditional_accumulator(_adam(), 2), 1
        ),
        "canonical",
    ),
    "agn": Transform(lambda: optax_accum.agn(_adam(), 2), "canonical", takes_reduced=False),
    "nested_accumulators": Transform(
        lambda: optax_accum.conditional_accumulator(
            optax_accum.conditional_accumulator(_adam(), 2), 1, reduction="sum"
        ),
        "canonical",
    ),
    "cross_shard_optimizer": Transform(
        lambda: optax_accum.cross_shard_optimizer(_adam(), BATCH),
        "mapped",
        takes_reduced=False,
    ),
    # The window's gradient norm, recorded where the chain runs: on plain gradients
    # alone (each step's), and inside an accumulator (the window's, at its release).
    "record_global_norm": Transform(
        lambda: optax.chain(optax_accum.record_global_norm(), _adam()),
        "canonical",
        takes_reduced=False,
    ),
    "record_global_norm_in_accumulator": Transform(
        lambda: optax_accum.conditional_accumulator(
            optax.chain(optax_accum.record_global_norm(), _adam()), 2
        ),
        "canonical",
    ),
    "apply_gradients": Transform(
        lambda: optax_accum.conditional_accumulator(_adam(), 2), "apply_gradients"
    ),
    "TrainState": Transform(lambda: optax_accum.conditional_accumulator(_adam(), 2), "train_state"),
    "NNXOptimizer": Transform(lambda: optax_accum.conditional_accumulator(_adam(), 2), "nnx"),
}


class Step(NamedTuple):
    """How a step carries its params and state: `start(params) -> carry`,
    `step(carry, grads) -> carry`, `view(carry) -> (params, opt_state)`."""

    start: Callable
    step: Callable
    view: Callable


def _canonical(tx) -> Step:
    def step(carry, grads):
        params, state = carry
        updates, state = tx.update(grads, state, params)
        return optax_accum.apply_updates(params, updates), state

    return Step(lambda params: (params, tx.init(params)), step, lambda carry: carry)


def _apply_gradients(tx) -> Step:
    def step(carry, grads):
        params, state = carry
        return optax_accum.apply_gradients(tx, grads, state, params)

    return Step(lambda params: (params, tx.init(params)), step, lambda carry: carry)


def _train_state(tx) -> Step:
    def start(params):
        return optax_accum.TrainState.create(apply_fn=None, params=params, tx=tx)

    def step(state, grads):
        return state.apply_gradients(grads=grads)

    return Step(start, step, lambda state: (state.params, state.opt_state))


def _nnx(tx) -> Step:
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, tree):
            self.tree = nnx.data(jax.tree.map(nnx.Param, tree))

    graphdefs = []

    def start(params):
        model = Model(params)
        graphdef, state = nnx.split((model, optax_accum.NNXOptimizer(model, tx, wrt=nnx.Param)))
        graphdefs.append(graphdef)
        return state

    def step(state, grads):
        model, optimizer = nnx.merge(graphdefs[0], state)
        optimizer.update(model, nnx.state(Model(grads), nnx.Param))
        return nnx.state((model, optimizer))

    def view(state):
        model, optimizer = nnx.merge(graphdefs[0], state)
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))["tree"]
        return params, nnx.as_pure(optimizer.opt_state)

    return Step(start, step, view)


def _update_and_apply(tx, carry, grads):
    params, state = carry
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def _mapped(tx, layout: str) -> Step:
    """`cross_shard_optimizer` where it applies, over a mapped batch axis, each
    replica given its own gradient (stacked on a leading axis): on one device under
    `jax.vmap` (one replica), on a mesh under `jax.shard_map`, each device holding its
    block of the params and the state. Under plain jit (`reduced`) no axis is mapped:
    the step is the canonical one."""
    if layout == "reduced":
        return _canonical(tx)
    start, view = (lambda params: (params, tx.init(params))), (lambda carry: carry)
    if layout == "one_device":

        def one_replica(carry, grads):
            carry = jax.tree.map(lambda x: x[None], carry)
            carry = jax.vmap(functools.partial(_update_and_apply, tx), axis_name=BATCH)(
                carry, grads
            )
            return jax.tree.map(lambda x: x[0], carry)

        return Step(start, one_replica, view)

    def on_the_mesh(carry, grads):
        params, state = carry
        by_shape = {jnp.shape(p): SPECS[k] for k, p in params.items()}
        param_specs = {k: SPECS[k] for k in params}
        state_specs = jax.tree.map(lambda x: by_shape.get(jnp.shape(x), P()), state)
        mapped = jax.shard_map(
            lambda carry, grads: _update_and_apply(tx, carry, jax.tree.map(lambda g: g[0], grads)),
            mesh=_mesh(layout),
            in_specs=((param_specs, state_specs), {k: P(BATCH, *SPECS[k]) for k in params}),
            out_specs=(param_specs, state_specs),
        )
        return mapped(carry, grads)

    return Step(start, on_the_mesh, view)


STEPS_BY_NAME = {
    "canonical": lambda tx, layout: _canonical(tx),
    "apply_gradients": lambda tx, layout: _apply_gradients(tx),
    "train_state": lambda tx, layout: _train_state(tx),
    "nnx": lambda tx, layout: _nnx(tx),
    "mapped": _mapped,
}


# --------------------------------------------------------------------------- the data


def _mesh(layout: str) -> jax.sharding.Mesh:
    kind = jax.sharding.AxisType.Auto if layout == "auto" else jax.sharding.AxisType.Explicit
    return jax.make_mesh((2, 4), AXES, axis_types=(kind, kind))


def _dyadic(rng, shape, dtype) -> np.ndarray:
    return (rng.integers(-8, 9, size=shape) / 8).astype(dtype)


def _params(sparse: bool) -> dict:
    rng = np.random.default_rng(0)
    params = {
        "kernel": _dyadic(rng, (4, 8), np.float16),
        "bias": _dyadic(rng, (8,), np.float32),
        "replicated": _dyadic(rng, (4, 4), np.float32),
    }
    if sparse:
        params["emb"] = _dyadic(rng, (ROWS, 4), np.float32)
    return params


def _grads(i: int, sparse: bool) -> tuple[dict, dict]:
    """Step i's gradient as two partial sums, one per replica of the batch axis, each
    a multiple of 1/8 (so the sum is exact in float16); the table's is an
    `IndexedSlices` (ids with a duplicate and a padding id) whose rows are the
    replicas' halves of the batch."""
    rng = np.random.default_rng(100 + i)
    params = _params(sparse)
    dense = [k for k in params if k != "emb"]
    parts = tuple({k: _dyadic(rng, params[k].shape, params[k].dtype) for k in dense} for _ in "ab")
    if sparse:
        ids = rng.choice(ROWS, size=8, replace=False).astype(np.int32)
        ids[3], ids[6] = ids[0], ROWS  # a duplicate, and padding
        rows = _dyadic(rng, (8, 4), np.float32)
        parts[0]["emb"], parts[1]["emb"] = (ids, rows), None
    return parts


def _slices(ids, rows) -> optax_accum.IndexedSlices:
    return optax_accum.IndexedSlices(ids, rows, (ROWS, 4))


def _is_slices(x) -> bool:
    return isinstance(x, optax_accum.IndexedSlices)


@functools.cache
def _to_unreduced(kinds: tuple) -> Callable:
    """A jitted map from each dense leaf's two partial sums (stacked, split over the
    batch axis) to the gradient typed unreduced over it: each device holds its
    replica's partial sum, as `jax.grad` leaves it for a param typed reduced."""
    in_specs = {k: P(BATCH, *SPECS[k]) for k in kinds}
    out_specs = {k: P(*SPECS[k], unreduced={BATCH}) for k in kinds}
    mapped = jax.shard_map(
        lambda tree: jax.tree.map(lambda x: x[0], tree),
        mesh=_mesh("reduced"),
        in_specs=(in_specs,),
        out_specs=out_specs,
    )
    return jax.jit(mapped)


def _placed_grads(i: int, transform: Transform, layout: str):
    """Step i's gradients as the layout's step receives them."""
    a, b = _grads(i, transform.sparse)
    dense = [k for k in a if k != "emb"]
    if transform.step == "mapped" and layout == "one_device":  # one replica
        return {k: jnp.asarray(a[k] + b[k])[None] for k in dense}
    if transform.step == "mapped" and layout != "reduced":
        # Per replica: the two replicas' gradients, whose mean is the gradient.
        mesh = _mesh(layout)
        return {
            k: jax.device_put(
                np.stack([2 * a[k], 2 * b[k]]), NamedSharding(mesh, P(BATCH, *SPECS[k]))
            )
            for k in dense
        }
    grads = {k: a[k] + b[k] for k in dense}
    if layout == "one_device":
        grads = jax.tree.map(jnp.asarray, grads)
    elif layout == "reduced":
        stacked = {k: np.stack([a[k], b[k]]) for k in dense}
        mesh = _mesh(layout)
        stacked = {
            k: jax.device_put(v, NamedSharding(mesh, P(BATCH, *SPECS[k])))
            for k, v in stacked.items()
        }
        grads = _to_unreduced(tuple(dense))(stacked)
    else:
        mesh = _mesh(layout)
        grads = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in grads.items()}
    if transform.sparse:
        ids, rows = a["emb"]
        if layout == "one_device":
            grads["emb"] = _slices(jnp.asarray(ids), jnp.asarray(rows))
        else:  # the batch's ids and rows, split over the batch axis
            mesh = _mesh(layout)
            grads["emb"] = _slices(
                jax.device_put(ids, NamedSharding(mesh, P(BATCH))),
                jax.device_put(rows, NamedSharding(mesh, P(BATCH, None))),
            )
    return grads


def _placed_params(transform: Transform, layout: str) -> dict:
    params = _params(transform.sparse)
    if layout == "one_device":
        return jax.tree.map(jnp.asarray, params)
    mesh = _mesh(layout)
    placed = {k: jax.device_put(v, NamedSharding(mesh, SPECS[k])) for k, v in params.items()}
    if layout == "reduced":
        # Every dense leaf typed reduced; the table stays plain (jax 0.10.2 cannot
        # index a reduced array: tests/test_unreduced.py's row-sparse test).
        dense = {k: v for k, v in placed.items() if k != "emb"}
        placed.update(optax_accum.as_reduced(dense, BATCH))
    return placed


# --------------------------------------------------------------------------- reading


def _type(x) -> str:
    """A leaf's type as `jax.typeof` prints it (dtype, shape, and under explicit
    sharding its layout and reduced or unreduced axes), for an array or a
    `jax.ShapeDtypeStruct` alike (which `jax.eval_shape` gives without a sharding
    where the value is replicated)."""
    if not isinstance(x, jax.ShapeDtypeStruct):
        return str(jax.typeof(x))
    sharding = {} if x.sharding is None else {"sharding": x.sharding}
    return str(jax.core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type, **sharding))


def _types(tree) -> list[str]:
    return [_type(x) for x in jax.tree.leaves(tree)]


def _read(x) -> np.ndarray:
    """A leaf as NumPy: an unreduced sum by its true value (the all-reduce)."""
    if isinstance(x, jax.Array) and _compat.sum_types(x)[1]:
        x = _compat.retyped(x, reduced=_compat.sum_types(x)[0])
    return np.asarray(x)


def _meaning(params, opt_state) -> tuple:
    return jax.tree.map(_read, (params, spent_as_zeros(opt_state)))


def _assert_close(got, want, where: str) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), where
    for (path, g), w in zip(
        jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want), strict=True
    ):
        tol = 2e-3 if g.dtype == np.float16 else 1e-5
        np.testing.assert_allclose(
            g, w, rtol=tol, atol=tol, err_msg=f"{where}{jax.tree_util.keystr(path)}"
        )


def _context(layout: str):
    return contextlib.nullcontext() if layout == "one_device" else jax.set_mesh(_mesh(layout))


# --------------------------------------------------------------------------- a cell


def _run(name: str, layout: str, mode: str) -> tuple:
    """Three steps of `name` on `layout`, jitted (one compile) or eager, checking that
    the types stay put; returns (params, opt_state) read as NumPy."""
    transform = TRANSFORMS[name]
    steps = STEPS_BY_NAME[transform.step](transform.make(), layout)
    with _context(layout):
        carry = steps.start(_placed_params(transform, layout))
        jitted = jax.jit(steps.step)
        want = _types(steps.view(carry))
        for i in range(STEPS):
            grads = _placed_grads(i, transform, layout)
            before = carry
            carry = (steps.step if mode == "eager" else jitted)(carry, grads)
            got = _types(steps.view(carry))
            assert got == want, f"types after step {i} differ from init's: {got} vs {want}"
        if mode == "eager":  # jit's types, traced (not compiled) from the same inputs
            traced = _types(steps.view(jax.eval_shape(jitted, before, grads)))
            assert got == traced, f"eager's types are not jit's: {got} vs {traced}"
        return _meaning(*steps.view(carry))


# The train steps that wrap `conditional_accumulator(adam, 2)` must give its canonical
# step's params and state (to rounding), so they share its one-device reference.
REFERENCE = dict.fromkeys(
    ("apply_gradients", "TrainState", "NNXOptimizer"), "conditional_accumulator"
)


def _reference(name: str, tmp_path_factory) -> tuple:
    """The one-device jitted run (its checks included), once per test session."""
    name = REFERENCE.get(name, name)
    return once(
        tmp_path_factory, f"every_layout_{name}", lambda root: _run(name, "one_device", "jit")
    )


def _assert_says_what_to_do(error: BaseException) -> None:
    """A transform that cannot take reduced params says so itself: a TypeError raised
    in optax_accum that names the fixes, not an error from inside JAX."""
    raised_in = traceback.extract_tb(error.__traceback__)[-1].filename
    assert isinstance(error, TypeError) and "/optax_accum/" in raised_in, (
        f"{type(error).__name__} raised in {raised_in}: {error}"
    )
    message = str(error)
    assert re.search(r"reduc", message) and re.search(r"accumulator", message), message


@contextlib.contextmanager
def _refused_where_allowed(name: str, layout: str):
    """Runs the body; a transform that may refuse reduced params may raise instead, if
    the error says what to do."""
    try:
        yield
    except Exception as e:
        if layout != "reduced" or TRANSFORMS[name].takes_reduced:
            raise
        _assert_says_what_to_do(e)


def _check_steps(name: str, layout: str, mode: str, tmp_path_factory) -> None:
    if (layout, mode) == ("one_device", "jit") and name not in REFERENCE:
        _reference(name, tmp_path_factory)  # the cell is the reference
        return
    got = None
    with _refused_where_allowed(name, layout):
        got = _run(name, layout, mode)
    if got is None:
        return
    want = _reference(name, tmp_path_factory)
    if name in REFERENCE:  # the same leaves, in the wrapper's own structure
        got, want = (tuple(jax.tree.leaves(t) for t in tree) for tree in (got, want))
    _assert_close(got, want, f"{name} on {layout} ({mode}): ")


# --------------------------------------------------------------------------- tests


# Every transform with its own `init` (the train steps call conditional_accumulator's;
# TrainState.create is run on abstract params too), on every layout: no step compiled.
INIT = [name for name in sorted(TRANSFORMS) if name not in ("apply_gradients", "NNXOptimizer")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("name", INIT)
def test_init_on_abstract_params(name, layout):
    transform = TRANSFORMS[name]
    tx = transform.make()
    with _context(layout), _refused_where_allowed(name, layout):
        params = _placed_params(transform, layout)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=None if layout == "one_device" else x.sharding
            ),
            params,
        )
        want = _types(tx.init(params))
        assert _types(jax.eval_shape(tx.init, abstract)) == want, "jax.eval_shape(tx.init)"
        if name == "TrainState":
            state = optax_accum.TrainState.create(apply_fn=None, params=abstract, tx=tx)
            assert _types(state.opt_state) == want, "TrainState.create on abstract params"
        else:
            assert _types(tx.init(abstract)) == want, "tx.init on jax.ShapeDtypeStruct params"


# Under jit, the form production runs: every transform on the typed layouts (explicit,
# reduced) and on one device (the references). Under auto sharding, where a type is a
# shape and a dtype, the transforms that tests/test_fsdp.py and test_fsdp_flax.py do
# not already run against one device: the nest, cross_shard_optimizer (under
# jax.shard_map), and the sparse accumulator's rows split over the batch (test_fsdp's
# ids are replicated). The train steps that wrap conditional_accumulator run on one
# device and the typed layouts as apply_gradients; TrainState and NNXOptimizer, whose
# own code moves the same arrays, pairwise over the typed layouts.
CORE = [name for name in sorted(TRANSFORMS) if name not in REFERENCE]
JIT = (
    [(name, layout) for name in CORE for layout in ("one_device", "explicit", "reduced")]
    + [(name, "auto") for name in ("cross_shard_optimizer", "nested_accumulators")]
    + [("sparse_conditional_accumulator", "auto")]
    + [("apply_gradients", layout) for layout in ("one_device", "explicit", "reduced")]
    + [("TrainState", "reduced"), ("NNXOptimizer", "explicit")]
)


@pytest.mark.parametrize(("name", "layout"), JIT)
def test_under_jit(name, layout, tmp_path_factory):
    _check_steps(name, layout, "jit", tmp_path_factory)


# Eagerly, JAX runs one op at a time on placed arrays. Where the layout is typed
# (explicit, reduced) each op checks its operands' shardings, and a value that a traced
# branch closes over is a placed array rather than a tracer: there every transform
# runs eagerly (such cells found the sparse release's eager failure). Under auto
# sharding nothing is typed, and on one device nothing is placed: there the code takes
# the explicit run's path without the type checks, and one train step stands for the
# rest. cross_shard_optimizer runs eagerly on one device (under jax.vmap): an eager
# jax.shard_map runs every op on every device from Python (15 s of CPU for a cell).
# The norm recorder alone runs eagerly inside the accumulator's cell (the same chain).
CANONICAL = [
    name for name in CORE if TRANSFORMS[name].step == "canonical" and name != "record_global_norm"
]
EAGER = (
    [(name, layout) for layout in ("explicit", "reduced") for name in CANONICAL]
    + [("cross_shard_optimizer", "one_device"), ("cross_shard_optimizer", "reduced")]
    + [("apply_gradients", "auto"), ("TrainState", "explicit"), ("NNXOptimizer", "reduced")]
)


@pytest.mark.parametrize(("name", "layout"), EAGER)
def test_eagerly(name, layout, tmp_path_factory):
    _check_steps(name, layout, "eager", tmp_path_factory)
