"""The core tests pass on the oldest versions pyproject.toml declares.

One test: it makes a venv with optax_accum's dependencies (pyproject.toml's
`dependencies`, no extras) installed under the constraints in `oldest_versions.txt`
(jax, optax and numpy at their lower bounds), checks that those versions are the ones
installed, and runs the core tests in a subprocess, importing optax_accum from this
checkout: the tests of what changes between releases (`ON_OLDEST`) and every doctest
of the library itself, none of the extras' (Flax, the demo and notebooks, Orbax, Ray,
the docs build) nor the multi-process suites.

The venv lives in the user's cache folder (`$XDG_CACHE_HOME` or `~/.cache`, then
`optax_accum/venv-oldest-<key>`), keyed by what it was built from: the constraints, the
dependencies, the test tools and the Python version. Any checkout on the same machine
reuses it; a change to any of those builds a new one. Building it needs the package
index, as the README's install does.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "tests" / "oldest_versions.txt"
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3.8", "hypothesis>=6.150"]
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")

# What runs on the oldest versions: what changes from one jax or optax release to the
# next. Sharding (explicit and auto meshes, FSDP, several mesh levels), pmap and
# shard_map, lowering for TPU and GPU, the staged host objects, every transform once
# against its anchor (its NumPy reference, MultiSteps or TF's trace), every check of bad
# input, and every doctest of the library. The newest run (the rest of this suite) holds
# every test; the ones left out here repeat these code paths over larger matrices
# (steps, dtypes, nests, capacities) or check the transforms' own arithmetic, which no
# release changes, and cost the minutes the README's test command cannot spend twice.
ANCHORS = {
    "test_accumulator.py": [
        "test_matches_numpy_reference",
        "test_equals_optax_multisteps_when_nothing_is_stale",
        "test_equals_sgd_on_the_concatenated_batch",
        "test_low_precision_params_accumulate_in_float32_and_return_their_dtype",
        "test_shared_accumulator_under_pmap",
        "test_shared_accumulator_under_shard_map",
        "test_bad_arguments_raise_at_construction",
        "test_bad_updates_raise_at_trace_time",
        "test_unbound_axis_name_is_a_clear_error",
    ],
    "test_agn.py": [
        "test_tf_trace_adam_b1_b2_zero_period_4",
        "test_matches_numpy_model",
        "test_eight_workers_pmap",
        "test_eight_workers_shard_map",
        "test_shard_map_init_inside_scan_keeps_types_and_branch_invariant",
        "test_hlo_pmap_all_reduce_only_inside_conditional",
        "test_hlo_shard_map_all_reduce_only_inside_conditional",
        "test_state_does_not_alias_params_so_both_can_be_donated",
        "test_bad_arguments",
        "test_missing_params_is_a_clear_error",
        "test_unbound_axis_is_a_clear_error",
    ],
    "test_skip_rule.py": [
        "test_equals_multisteps_with_the_same_rule",
        "test_replicas_skip_their_own_gradients_and_counts_sum_under_pmap",
        "test_agn_skips_summed_over_replicas_at_the_sync_under_pmap",
        "test_bad_rules",
    ],
    "test_sparse.py": ["test_matches_numpy_reference", "test_axis_name_under_pmap"],
    "test_state.py": [
        "test_accessors_work_under_jit_and_vmap",
        "test_num_accumulated_finds_the_accumulator_inside_wrappers",
        "test_set_global_step_on_a_batched_state_sets_every_element",
        "test_under_vmap_and_jit_nothing_warns",
        "test_bad_batched_steps_are_clear_errors",
    ],
    "test_shard_map_window.py": [
        "test_one_reduction_per_window_and_the_values_of_one_device"
        "[conditional_accumulator-canonical]",
        "test_one_reduction_per_window_and_the_values_of_one_device[agn-apply_gradients]",
    ],
}
ON_OLDEST = [
    "tests/test_bad_inputs_*.py",
    "tests/test_cross_shard.py",
    "tests/test_fsdp.py",
    "tests/test_hlo.py",
    "tests/test_host.py",
    "tests/test_indexed_slices.py",
    "tests/test_lowering.py",
    "tests/test_multislice.py",
    "tests/test_schedules.py",
    "tests/test_sharding.py",
    "tests/test_staleness.py",
    "tests/test_unreduced_versions.py",
    *(f"tests/{file}::{test}" for file, tests in ANCHORS.items() for test in tests),
]
# The extras' tests: they need Flax, Orbax or Ray, which the oldest run does not install.
NOT_CORE = {
    "test_bad_inputs_coverage.py",  # reads every table, the Flax one too
    "test_bad_inputs_flax.py",
    # Reduced and unreduced sharding types are jax 0.10's; on the oldest jax the
    # library's answer is a clear error, which test_unreduced_versions.py checks here.
    "test_bad_inputs_unreduced.py",
}
# Their doctests need Flax, and jax 0.10's unreduced sharding types.
NOT_CORE_MODULES = {"checkpoint.py", "embedding.py", "flax_train_state.py", "unreduced.py"}


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def _core_paths() -> list[str]:
    tests = []
    for entry in ON_OLDEST:
        path, sep, test = entry.partition("::")
        for match in sorted((ROOT / "tests").glob(path.removeprefix("tests/"))):
            if match.name not in NOT_CORE:
                tests.append(f"tests/{match.name}{sep}{test}")
    modules = sorted(
        f"optax_accum/{p.name}"
        for p in (ROOT / "optax_accum").glob("*.py")
        if p.name not in NOT_CORE_MODULES
    )
    return tests + modules


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _dependencies() -> list[str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]


def _venv() -> pathlib.Path:
    """Where the venv for these constraints, dependencies and test tools lives."""
    key = json.dumps([CONSTRAINTS.read_text(), _dependencies(), TEST_TOOLS, sys.version_info[:2]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return CACHE / "optax_accum" / f"venv-oldest-{digest}"


def _python() -> pathlib.Path:
    """The oldest-versions venv's interpreter, built once per key (see `_venv`)."""
    target = _venv()
    python = target / "bin" / "python"
    done = target / "complete"
    target.parent.mkdir(parents=True, exist_ok=True)
    # One build at a time per key, whichever checkout runs it; a build that stopped
    # half way (no `complete` stamp) is thrown away and made again.
    with open(target.parent / f"{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            return python
        shutil.rmtree(target, ignore_errors=True)
        # uv (the test extra's), as the README's command installs the main venv: it
        # reuses what that install downloaded, and takes a third of pip's time.
        uv = [sys.executable, "-m", "uv"]
        created = _run([*uv, "venv", "-q", "--python", sys.executable, str(target)], timeout=120)
        assert created.returncode == 0, created.stderr[-3000:]
        install = _run(
            [*uv, "pip", "install", "-q", "--python", str(python), "--compile-bytecode",
             "-c", str(CONSTRAINTS), *_dependencies(), *TEST_TOOLS],
            timeout=900,
        )  # fmt: skip
        assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
        done.write_text("")
    return python


def test_core_tests_pass_on_the_oldest_declared_versions():
    python = _python()
    versions = _run(
        [str(python), "-c",
         "import importlib.metadata as m, sys, optax_accum; "
         "print(optax_accum.__file__); "
         "print(' '.join(f'{n}=={m.version(n)}' for n in sys.argv[1:]))", *_pins()],
        timeout=60,
    )  # fmt: skip
    assert versions.returncode == 0, versions.stderr
    imported, installed = versions.stdout.splitlines()
    assert pathlib.Path(imported).parent == ROOT / "optax_accum"  # this checkout's code
    assert installed.split() == [f"{n}=={v}" for n, v in _pins().items()]

    proc = _run(
        [str(python), "-m", "pytest", "-q", "-n", "0", "-m", "not flax",
         *_core_paths()],
        timeout=1800,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    print(sys.version, installed, tail.splitlines()[-1])
