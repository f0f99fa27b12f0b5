"""The reader of compiled TPU programs (`optax_accum.demo.tpu`), on small programs
whose answers are known by hand.

The program (tests/data/tpu_step.hlo) is written as the TPU compiler prints one
(operands by name only, layouts with tiles and memory spaces, async pairs, megascale
transfers), so the reader needs no libtpu here; the last test compiles one program for
TPU (when libtpu is installed) and checks the reader against what it must find there.
"""

from __future__ import annotations

import pathlib

import pytest

from optax_accum.demo import tpu

F = "{1,0:T(8,128)}"  # a 2-D float32 layout in HBM
V = "{1,0:T(8,128)S(1)}"  # the same in the TPU's vector memory (not HBM)

# ENTRY adds a gradient into a sum (a fusion of 3 operands, one of them a scalar in
# scalar memory), reads 4 of a 1024-row table's rows (a gather fusion), scatters 4
# rows into a 1024-row map in place, prefetches a [64,64] array into vector memory and
# back, all-reduces a [16,128] array every step (an async pair), then runs a loop
# whose body all-gathers, and a conditional whose first branch all-reduces a [64,64]
# array within two groups and sends and receives it to and from the other slice.
PROGRAM = (pathlib.Path(__file__).parent / "data" / "tpu_step.hlo").read_text()

K = 64 * 64 * 4  # bytes of a [64,64] float32 array


def test_collectives_with_their_bytes_groups_and_place():
    program = tpu.read_text(PROGRAM)
    found = [(c.opcode, c.nbytes, c.groups, c.where) for c in program.collectives]
    assert found == [
        # mesh['x'=2,'y'=2] {'y'}: devices numbered x-major, grouped along y.
        ("all-reduce", 16 * 128 * 4, ((0, 1), (2, 3)), ()),
        # [2,2]<=[4]: the iota 0..3 as two rows.
        ("all-gather", 32 * 128 * 4, ((0, 1), (2, 3)), ("while",)),
        ("all-reduce", K, ((0, 1), (2, 3)), ("conditional",)),
    ]
    assert [c.every_step for c in program.collectives] == [True, True, False]
    assert [(c.opcode, c.nbytes) for c in program.held(min_bytes=K)] == [("all-gather", K)]
    assert [c.opcode for c in program.released()] == ["all-reduce"]
    assert (program.conditionals, program.loops) == (1, 1)


def test_transfers_between_slices_are_the_megascale_sends_and_recvs():
    transfers = tpu.read_text(PROGRAM).transfers
    assert [(t.kind, t.nbytes, t.handler, t.operation, t.every_step) for t in transfers] == [
        ("send", 8 * 8 * 128 * 4, "xla_megascale_runtime", "ALL_REDUCE", False),
        ("recv", 8 * 8 * 128 * 4, "xla_megascale_runtime", "ALL_REDUCE", False),
    ]


def test_every_step_bytes_resolve_operands_by_name():
    """ENTRY's ops, each its result plus its operands: `acc + g` reads two [64,64]
    arrays and writes one (the scalar flag lives in scalar memory); the gather reads
    the 4 rows it takes (not the table) and the ids; the scatter reads the ids and
    updates and writes the 4 entries it updates in place (not the map); the prefetch
    moves the [64,64] array once; the all-reduce reads and writes [16,128]. The loop's
    body and the conditional's branches do not count."""
    program = tpu.read_text(PROGRAM)
    by_name = {op.name: nbytes for op, nbytes in program.every_step_ops}
    assert by_name == {
        "select_add_fusion": 3 * K,
        "gather_fusion": 4 * 64 * 4 + 16 + 4 * 64 * 4,
        "scatter_fusion": 16 + 16 + 16,
        "copy-start": K,
        "copy-done": 0,
        "all-reduce-start": 16 * 128 * 4,
        "all-reduce-done": 16 * 128 * 4,
    }
    assert program.every_step_bytes == sum(by_name.values())
    assert program.temp_bytes == -1  # read from text: no buffer assignment


def test_array_bytes_of_types_and_memory_spaces():
    assert tpu.array_bytes(f"f32[64,64]{F}") == K
    assert tpu.array_bytes("(bf16[4,8]{1,0:T(8,128)(2,1)}, s32[], pred[3])") == 64 + 4 + 3
    assert tpu.array_bytes(f"(f32[64,64]{V}, f32[64,64]{F})", hbm_only=True) == K
    assert tpu.array_bytes("token[]") == 0


def test_replica_groups_in_every_notation():
    groups = tpu.replica_groups
    assert groups("replica_groups={{0,2},{1,3}}") == ((0, 2), (1, 3))
    assert groups("replica_groups=[2,2]<=[2,2]T(1,0)") == ((0, 2), (1, 3))
    assert groups("replica_groups=mesh['slice'=2,'data'=4] {'slice'}") == (
        (0, 4),
        (1, 5),
        (2, 6),
        (3, 7),
    )
    assert groups("source_target_pairs={{0,1},{1,0}}") == ((0, 1), (1, 0))
    assert groups("dimensions={0}") == ()


def test_a_program_without_entry_is_an_error():
    with pytest.raises(ValueError, match="no ENTRY computation"):
        tpu.read_text("HloModule empty\n")


@pytest.mark.skipif(bool(tpu.unavailable()), reason=str(tpu.unavailable()))
def test_the_floor_compiled_for_tpu_reads_three_trees_and_no_temporaries():
    """`acc + g` for TPU v5e, 8 leaves of 4096 x 8192 (268M params, one tree 1 GiB),
    the sum donated: read the sum and the gradient, write the sum; nothing else."""
    from benchmarks import tpu_compiled

    program = tpu_compiled.floor("v5e", "268M")
    assert program.every_step_bytes == 3 * tpu_compiled.tree_bytes("268M")
    assert (program.temp_bytes, program.collectives, program.conditionals) == (0, (), 0)
