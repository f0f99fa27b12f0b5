"""The test helper that lists a compiled program's collectives (tests/_hlo.py), read
on programs whose collectives are known."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from _hlo import Collective, collectives
from jax import lax
from jax.sharding import PartitionSpec as P

from optax_accum import _compat
from optax_accum.demo.hlo import count_collectives, replica_groups


def _one_every_step_one_in_a_cond() -> jax.stages.Compiled:
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))

    def step(x: jax.Array, flag: jax.Array) -> tuple:
        every = lax.psum(x, "data")  # f32[4] on each device
        taken = lax.cond(
            flag,
            lambda y: _compat.pcast_varying(lax.psum(y[:2].astype(jnp.int32), "data"), "data"),
            lambda y: y[:2].astype(jnp.int32),
            x,
        )
        return every, taken

    mapped = jax.shard_map(
        step, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P("data"))
    )
    return jax.jit(mapped).lower(jnp.zeros(32), jnp.bool_(True)).compile()


def test_collectives_says_which_run_on_every_step_and_their_bytes():
    compiled = _one_every_step_one_in_a_cond()
    expected = [Collective("all-reduce", 16, True), Collective("all-reduce", 8, False)]
    assert sorted(collectives(compiled), key=lambda c: -c.nbytes) == expected
    assert collectives(compiled.as_text()) == collectives(compiled)
    assert count_collectives(compiled.as_text()) == {
        "every_step": {"all-reduce": 1, "all-reduce bytes": 16},
        "when_taken": {"all-reduce": 1, "all-reduce bytes": 8},
    }


_ASYNC_IN_A_LOOP = """\
HloModule m

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], f32[6])) -> (s32[], f32[6]) {
  %p = (s32[], f32[6]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[6]{0} get-tuple-element(%p), index=1
  %g = (f32[6]{0}, f32[48]{0}) all-gather-start(%x), dimensions={0}
  %y = f32[48]{0} all-gather-done(%g)
  %r = f32[6]{0} reduce-scatter(%y), dimensions={0}, to_apply=%add
  ROOT %t = (s32[], f32[6]{0}) tuple(%i, %r)
}

%cond (p: (s32[], f32[6])) -> pred[] {
  %p = (s32[], f32[6]{0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  ROOT %lt = pred[] compare(%i, %i), direction=LT
}

ENTRY %main (x: f32[6]) -> f32[6] {
  %x = f32[6]{0} parameter(0)
  %s = f32[6]{0} all-reduce-start(%x), to_apply=%add
  %d = f32[6]{0} all-reduce-done(%s)
  %z = s32[] constant(0)
  %t = (s32[], f32[6]{0}) tuple(%z, %d)
  %w = (s32[], f32[6]{0}) while(%t), condition=%cond, body=%body
  ROOT %o = f32[6]{0} get-tuple-element(%w), index=1
}
"""


def test_async_pairs_count_once_and_loop_bodies_are_not_every_step():
    assert collectives(_ASYNC_IN_A_LOOP) == [
        Collective("all-reduce", 24, True),
        Collective("all-gather", 192, False),
        Collective("reduce-scatter", 24, False),
    ]


def test_replica_groups_are_read_in_every_form_xla_writes():
    """A list, an iota (transposed or not), named mesh axes laid over the devices in
    order or in a `device_ids` order (jax 0.10's XLA:CPU writes that one), none."""
    forms = {
        "replica_groups={{0,4},{1,5}}, to_apply=%add": ((0, 4), (1, 5)),
        "replica_groups=[2,4]<=[8], to_apply=%add": ((0, 1, 2, 3), (4, 5, 6, 7)),
        "replica_groups=[4,2]<=[2,4]T(1,0), to_apply=%add": ((0, 4), (1, 5), (2, 6), (3, 7)),
        "replica_groups=mesh['slice'=2,'data'=4] {'slice'}, to": ((0, 4), (1, 5), (2, 6), (3, 7)),
        "replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2], device_ids=([2,4]T(1,0)) "
        "{'axis_0'}, dimensions={0}": ((0, 1, 2, 3), (4, 5, 6, 7)),
        "to_apply=%add": (),
    }
    for line, groups in forms.items():
        assert replica_groups(line) == groups, line


def test_a_collective_says_whether_it_crosses_parts_of_the_mesh():
    """On a (dp=2, fsdp=4) mesh, a sum over fsdp stays within each dp row, a sum over
    dp crosses them; each collective's groups come from the compiled program."""
    mesh = jax.make_mesh((2, 4), ("dp", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def step(x):
        return lax.psum(x, "fsdp"), lax.psum(2 * x, "dp")

    mapped = jax.shard_map(
        step, mesh=mesh, in_specs=P(("dp", "fsdp")), out_specs=(P("dp"), P("fsdp"))
    )
    found = collectives(jax.jit(mapped).lower(jnp.zeros(8)).compile())
    row = lambda device: device // 4  # noqa: E731  (devices are numbered in mesh order)
    assert sorted((len(c.groups[0]), c.crosses(row)) for c in found) == [(2, True), (4, False)]
