"""What a TPU pod runs: the train steps compiled for TPU topologies, read.

No TPU is needed: the TPU compiler (libtpu, installed by the README's test command)
compiles each step for the devices of a TPU topology described by
`jax.experimental.topologies`, from `jax.ShapeDtypeStruct`s; nothing is allocated or
run. `benchmarks/tpu_compiled.py` builds the programs (the same ones its report
tabulates) and `optax_accum.demo.tpu` reads them. Checked, Adam inside, 8 gradients per
window, for `conditional_accumulator`, `sparse_conditional_accumulator` (its dense
leaves), `drop_stale_gradients` around an accumulator, a nest of two accumulators and
`agn`, in the canonical step, `apply_gradients`, Flax linen `TrainState` and NNX
(`NNXOptimizer`):

- at 268M params (8 leaves of 4096 x 8192, one slice of TPU v5e, params replicated, the
  gradients given; and the canonical step on params `as_reduced`): temporaries no
  larger than `optax.MultiSteps`' in the same step;
  the HBM bytes read and written by the ops that run on every step at most 1.1x the
  floor `acc + g` (3 params-sized trees) with `apply_gradients`, TrainState and NNX,
  and at most 2.1x with the canonical step (whose form must also read and write the
  params: 5 trees at least); one conditional on every step, no loop;
- data parallel, params typed reduced (`as_reduced`), on TPU v5e and TPU v4 (two
  leaves of 128 x 64): a held step runs no gradient-sized collective, and the release
  reduces every leaf once (one all-reduce per leaf, or one packed), inside the step's
  one conditional;
- two v5e slices, FSDP within a slice, the sum across slices deferred: a held step
  sends nothing to the other slice, the release crosses once;
- `agn`: a local step moves nothing, on one slice and across two;
- the sparse accumulator's held step on a 1M- and a 10M-row table: the same bytes.

Each transform meets each step form once, on one of the two generations (`PAIRS`); at
268M each step form runs `conditional_accumulator`, and each other transform one form.
NNX is not paired with the sparse accumulator: `nnx.Optimizer` turns its nested
NamedTuple state into `nnx.State` trees (tests/test_flax.py says so and runs that
combination functionally).

On params `as_reduced` the release keeps no all-reduce output of its own, in every
step form, under the compiler's default memory scheduler and its list and DFS ones.

A check that the code fails on TPU is marked `xfail(strict=True)`, with what the
compiled program shows, until the code is fixed (none is, today).
"""

from __future__ import annotations

import pytest

from optax_accum.demo import tpu

_REASON = tpu.unavailable()
if _REASON:
    pytest.skip(f"TPU programs are not compiled here: {_REASON}", allow_module_level=True)

from benchmarks import tpu_compiled as T  # noqa: E402

BIG = "268M"
SMALL = "64K"
SMALL_LEAVES = 2  # the collectives' checks: two leaves of 128 x 64
pytestmark = pytest.mark.flax  # TrainState and NNX need Flax


# --------------------------------------------------------------------------- 268M

# Each step form with conditional_accumulator; each other transform in one form.
BIG_CASES = [
    pytest.param("conditional_accumulator", "canonical"),
    pytest.param("conditional_accumulator", "apply_gradients"),
    pytest.param("conditional_accumulator", "TrainState"),
    pytest.param("conditional_accumulator", "NNX"),
    pytest.param("sparse_conditional_accumulator", "TrainState"),
    pytest.param("drop_stale", "canonical"),
    # Before issue 36's engine, a nest's fused steps kept a params-sized temporary here.
    pytest.param("nest", "apply_gradients"),
]
# MultiSteps' own step for each form: its apply_gradients and Flax's TrainState are the
# canonical step (`tx.update`, then `optax.apply_updates`).
_BASELINE = {"canonical": "canonical", "apply_gradients": "canonical", "TrainState": "canonical"}


@pytest.mark.parametrize(("name", "form"), BIG_CASES)
def test_268m_step_temporaries_bytes_and_one_conditional(name, form):
    ours = T.optimizer_step(name, form, "v5e", BIG, False)
    base = T.optimizer_step("MultiSteps", _BASELINE.get(form, form), "v5e", BIG, False)
    tree = T.tree_bytes(BIG)
    assert (ours.conditionals, ours.loops) == (1, 0), (ours.conditionals, ours.loops)
    assert not ours.collectives and not ours.transfers  # replicated, gradients given
    limit = 2.1 if form == "canonical" else 1.1
    assert ours.every_step_bytes <= limit * 3 * tree, ours.every_step_bytes / tree
    assert ours.temp_bytes <= base.temp_bytes, (ours.temp_bytes, base.temp_bytes)
    # The checks have teeth: MultiSteps runs its whole Adam on every step (11 trees,
    # beside a few scalars), with no conditional, and keeps an eighth of the params
    # (one leaf) in temporaries.
    assert round(base.every_step_bytes / tree, 3) == 11
    assert base.temp_bytes >= tree // 8 and (base.conditionals, base.loops) == (0, 0)
    if name == "conditional_accumulator":  # the figures, exactly
        trees = 6 if form == "canonical" else 3  # acc + g; and params + updates
        assert round(ours.every_step_bytes / tree, 3) == trees  # and a few scalars
        assert ours.temp_bytes == 0


def test_268m_as_reduced_canonical_step_keeps_no_more_than_multisteps():
    """The data-parallel step on params typed reduced (the release all-reduces the
    window's sum), against MultiSteps on plain params reducing every step.

    The released updates travel out of the branch in the sums' buffers, typed as the
    sums (unreduced) by a cast that moves nothing, and are typed like the params after
    it (`_unreduced.in_sum_type`, `out_of_sum_type`); each all-reduce writes into its
    own sum's buffer (`_unreduced.reduced_in_place`): no temporaries on TPU v5e, where
    MultiSteps keeps 134,733,824 bytes (an all-reduce's output, one leaf). Made in the
    branch, typed reduced, the updates kept a params-sized tree more (1,208,346,624
    bytes); the all-reduces writing outputs of their own, one leaf (134,604,800)."""
    ours = T.optimizer_step("conditional_accumulator", "canonical", "v5e", BIG, True)
    base = T.optimizer_step("MultiSteps", "canonical", "v5e", BIG, True)
    assert ours.temp_bytes <= base.temp_bytes, (ours.temp_bytes, base.temp_bytes)
    assert ours.temp_bytes == 0, ours.temp_bytes


# --------------------------------------------------------------------------- one reduction

# Every (transform, step form) pair once, on one of the two generations; each
# generation runs every transform and every step form.
PAIRS = {
    "v5e": [
        ("conditional_accumulator", "canonical"),
        ("conditional_accumulator", "NNX"),
        ("sparse_conditional_accumulator", "apply_gradients"),
        ("sparse_conditional_accumulator", "TrainState"),
        ("drop_stale", "apply_gradients"),
        ("drop_stale", "NNX"),
        ("nest", "canonical"),
        ("nest", "TrainState"),
    ],
    "v4": [
        ("conditional_accumulator", "apply_gradients"),
        ("conditional_accumulator", "TrainState"),
        ("sparse_conditional_accumulator", "canonical"),
        ("drop_stale", "canonical"),
        ("drop_stale", "TrainState"),
        ("nest", "apply_gradients"),
        ("nest", "NNX"),
    ],
}


@pytest.mark.parametrize(
    ("topology", "name", "form"),
    [(topology, name, form) for topology, pairs in PAIRS.items() for name, form in pairs],
)
def test_held_step_reduces_nothing_and_the_release_every_leaf_once(topology, name, form):
    program = T.optimizer_step(name, form, topology, SMALL, True, SMALL_LEAVES)
    tree = T.tree_bytes(SMALL, SMALL_LEAVES)
    assert not program.held(min_bytes=tree // SMALL_LEAVES), program.held()
    released = program.released()
    assert {c.opcode for c in released} == {"all-reduce"}, released
    assert sum(c.nbytes for c in released) == tree, released
    assert len(released) <= SMALL_LEAVES
    devices = tuple(range(T.devices(topology)))  # every chip (v4: every core) of the slice
    assert all(c.groups == (devices,) for c in released), released
    assert (program.conditionals, program.loops) == (1, 0)


def test_multisteps_all_reduces_the_gradient_on_every_step():
    """The same data-parallel step with MultiSteps (plain params: `jax.grad`'s
    all-reduce): every leaf reduced on every step."""
    program = T.optimizer_step("MultiSteps", "canonical", "v5e", SMALL, True, SMALL_LEAVES)
    held = program.held()
    assert sum(c.nbytes for c in held) == T.tree_bytes(SMALL, SMALL_LEAVES), held
    assert not program.released()


# --------------------------------------------------------------------------- two slices

SLICE_PAIRS = [
    ("conditional_accumulator", "canonical"),
    ("sparse_conditional_accumulator", "apply_gradients"),
    ("drop_stale", "TrainState"),
    ("nest", "NNX"),
]


@pytest.mark.parametrize(("name", "form"), SLICE_PAIRS)
def test_two_slices_held_step_sends_nothing_to_the_other_slice(name, form):
    program = T.two_slices(name, form)
    assert program.transfers, "the release must cross the slices"
    assert not [t for t in program.transfers if t.every_step], program.transfers
    assert {t.handler for t in program.transfers} == {"xla_megascale_runtime"}
    sends = [t for t in program.transfers if t.kind == "send"]
    # One shard of every param crosses once (packed into one transfer, or one a leaf;
    # a packed buffer is padded to whole TPU tiles, less than a tenth more).
    assert 1 <= len(sends) <= len(T.MODEL)
    shard = T.model_shard_bytes()
    assert shard <= sum(t.nbytes for t in sends) <= 1.1 * shard, (sends, shard)
    # Within a slice, every step: only the FSDP gathers and the gradient's
    # reduce-scatter (and the bias's all-reduce), never across the slices.
    assert all(len(g) == 4 for c in program.held() for g in c.groups), program.held()
    assert (program.conditionals, program.loops) == (1, 0)


def test_two_slices_multisteps_crosses_on_every_step():
    program = T.two_slices("MultiSteps", "canonical")
    every = [t for t in program.transfers if t.every_step and t.kind == "send"]
    assert sum(t.nbytes for t in every) >= T.model_shard_bytes(), program.transfers


# --------------------------------------------------------------------------- agn


@pytest.mark.parametrize("form", T.FORMS)
def test_agn_local_step_moves_nothing(form):
    program = T.agn_step(form)
    assert not program.held() and not program.transfers, program.held()
    assert {c.opcode for c in program.released()} == {"all-reduce"}
    assert (program.conditionals, program.loops) == (1, 0)


def test_agn_across_two_slices_syncs_only_in_the_sync_branch():
    program = T.agn_step("apply_gradients", num_slices=2)
    assert not program.held(), program.held()
    assert program.transfers and not [t for t in program.transfers if t.every_step]


# --------------------------------------------------------------------------- sparse


def test_a_64_wide_table_is_column_major_on_tpu_and_any_row_scatter_transposes_it():
    """Not the accumulator's: in TPU's default layout for a 1M x 64 float32 table
    (column-major, no lane padding), `optax_accum.apply_updates` of 256 rows alone
    copies the table twice a step; at 10M rows the compiler scatters in place."""
    table = 1_000_000 * 64 * 4
    assert T.table_scatter(1_000_000).every_step_bytes >= 2 * table
    assert T.table_scatter(10_000_000).every_step_bytes < table // 100


def test_sparse_held_step_never_moves_the_table():
    """The table's layout pinned row-major (`T.sparse_step`): at 1M and 10M rows no
    every-step op reads or writes the table, and the held step compiles to one
    conditional. (Before the fused step applied a row buffer's updates after its
    branch, the table rode through the conditional, and TPU's compiler copied it: 2.56
    GB a step at 10M rows.)"""
    for rows in (1_000_000, 10_000_000):
        program = T.sparse_step(rows)
        table = rows * 64 * 4
        assert max(n for _, n in program.every_step_ops) < table // 32, rows
        assert program.every_step_bytes < table // 16, (rows, program.every_step_bytes)
        assert (program.conditionals, program.loops) == (1, 0)


def test_sparse_held_step_bytes_do_not_grow_with_the_table():
    """The held step finds the gradient's rows among the buffer's slots (`order`), so
    nothing it reads or writes has the table's rows. (When every step looked rows up
    in a map of one int32 per table row, the compiler's memory-space assignment copied
    the 4 MB map of a 1M-row table into faster memory and back on each step: 9.7 MB a
    step against 1.7 MB at 10M rows, whose 40 MB map did not fit.)"""
    small, large = (T.sparse_step(rows) for rows in (1_000_000, 10_000_000))
    # The same ops on both (the step's 256 rows, the buffer's 2,048 slots); scalars and
    # the table's shape may differ by a few bytes.
    assert abs(small.every_step_bytes - large.every_step_bytes) <= 4096, (
        small.every_step_bytes,
        large.every_step_bytes,
    )
    assert (small.conditionals, large.conditionals) == (1, 1)


@pytest.mark.parametrize("reduced", [False, True], ids=["replicated", "as_reduced"])
def test_268m_sparse_accumulator_canonical_step_keeps_no_more_than_multisteps(reduced):
    """The sparse accumulator whose leaves are all dense (`DenseRows`), in the
    canonical step: its released updates travel out of the branch in the values'
    buffers (restarted lazily, as a dense sum's), so the step keeps no params-sized
    tree of updates of its own. Before, the branch returned the updates in new buffers
    (and a held step zeros in them): 1,074,777,088 bytes of temporaries replicated,
    3,088,058,368 on params `as_reduced`; now 936,960 replicated and 1,098,752 on
    params `as_reduced`, where each all-reduce writes into its leaf's values (before
    that, 1,074,776,064: every leaf's all-reduce output at once)."""
    ours = T.optimizer_step("sparse_conditional_accumulator", "canonical", "v5e", BIG, reduced)
    base = T.optimizer_step("MultiSteps", "canonical", "v5e", BIG, reduced)
    assert (ours.conditionals, ours.loops) == (1, 0), (ours.conditionals, ours.loops)
    assert ours.temp_bytes <= base.temp_bytes, (ours.temp_bytes, base.temp_bytes)


@pytest.mark.parametrize(
    ("name", "form", "scheduler"),
    [
        ("conditional_accumulator", "apply_gradients", None),
        ("summing_accumulator", "canonical", None),
        ("summing_accumulator", "TrainState", None),
        ("sparse_conditional_accumulator", "apply_gradients", None),
        ("sparse_conditional_accumulator", "canonical", "list"),
        ("conditional_accumulator", "apply_gradients", "dfs"),
    ],
)
def test_as_reduced_release_keeps_no_all_reduce_output(name, form, scheduler):
    """On params `as_reduced`, 2 leaves of 4096 x 8192 (128 MiB each), whatever the
    TPU compiler's memory scheduler (`scheduler`: its default, or its list or DFS
    one): the release keeps no all-reduce output, each leaf's all-reduce writing into
    the sum's buffer (`_unreduced.reduced_in_place`; with `apply_gradients`, the
    buffer then cleared after the inner optimizer reads it: `_branch.cleared_after`).

    Before, each all-reduce wrote an output of its own, and the default scheduler
    (its list schedule) ran them all before the first Adam fusion unless a scalar
    divisor tipped it to its DFS schedule: the mean kept one leaf (134,411,264 bytes),
    the sum and the sparse accumulator's per-row mean every leaf (268,628,992 and
    268,742,144)."""
    ours = T.optimizer_step(name, form, "v5e", BIG, True, 2, scheduler)
    leaf = T.tree_bytes(BIG, 1)
    assert ours.temp_bytes <= leaf // 64, (ours.temp_bytes, leaf)
    assert (ours.conditionals, ours.loops) == (1, 0), (ours.conditionals, ours.loops)


def _as_reduced_step(tx, shapes: dict, form: str, dtype=None) -> tpu.Program:
    """`tx`'s step of `form` on one v5e slice, compiled for TPU: params typed reduced
    over its data axis, gradients unreduced, a leaf of each shape in `shapes` (in
    `dtype`; None: float32)."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import PartitionSpec as P

    mesh = tpu.mesh(tpu.TOPOLOGIES["v5e"], ("data",))

    def structs(kind: str) -> dict:
        spec = lambda s: P(*([None] * len(s)), **{kind: {"data"}})  # noqa: E731
        return {n: T._struct(s, mesh, spec(s), dtype or jnp.float32) for n, s in shapes.items()}

    params, grads = structs("reduced"), structs("unreduced")
    with jax.set_mesh(mesh):
        state = jax.eval_shape(tx.init, params)
    return T._compile(
        lambda p, s, g: T.STEPS[form](tx, p, s, g, optax.apply_updates),
        mesh,
        (params, state, grads),
        (0, 1),
        "ours",
    )


@pytest.mark.parametrize("form", ["canonical", "apply_gradients"])
def test_as_reduced_release_with_small_leaves_beside_large_bfloat16_ones(form):
    """bfloat16 params `as_reduced` (float32 sums), two leaves of 4096 x 8192 beside a
    128 x 64 one and a bias: the large sums are all-reduced into their own buffers,
    the small ones where they stand (`_spending._IN_PLACE_MIN_SIZE`), in one release;
    the step keeps about 1 MB of temporaries (a large leaf's sum is 128 MiB)."""
    import jax.numpy as jnp

    import optax_accum

    shapes = {"a": (4096, 8192), "b": (4096, 8192), "small": (128, 64), "bias": (8192,)}
    tx = optax_accum.conditional_accumulator(T._adam(), 8)
    program = _as_reduced_step(tx, shapes, form, jnp.bfloat16)
    assert program.temp_bytes <= T.tree_bytes(BIG, 1) // 64, program.temp_bytes
    assert (program.conditionals, program.loops) == (1, 0)


def test_a_max_leaf_keeps_the_as_reduced_canonical_step_in_the_sums_buffers():
    """Params `as_reduced` with a "max" leaf beside a 128 MiB mean leaf: the branch
    carries every update in its store's buffer or none (`_branch._can_spend`), so a
    max leaf's update must be typed as its store too. Typed like its param instead,
    it sent every leaf's update out in new buffers: 268,951,552 bytes of temporaries
    against 134,379,008 for the mean leaf alone (before each all-reduce wrote into its
    own sum's buffer, which leaves the mean leaf alone none)."""
    import optax_accum

    shapes = {"w": (4096, 8192), "amax": (16,)}

    def step_temps(reduction: dict) -> int:
        tx = optax_accum.conditional_accumulator(T._adam(), 8, reduction=reduction)
        return _as_reduced_step(tx, {n: shapes[n] for n in reduction}, "canonical").temp_bytes

    alone = step_temps({"w": "mean"})
    with_max = step_temps({"w": "mean", "amax": "max"})
    assert with_max <= alone + (1 << 20), (with_max, alone)
