"""The core tests pass on the oldest versions pyproject.toml declares.

One test: it makes a venv with optax_accum's dependencies (pyproject.toml's
`dependencies`, no extras) installed under the constraints in `oldest_versions.txt`
(jax, optax and numpy at their lower bounds), checks that those versions are the ones
installed, and runs the core tests in a subprocess, importing optax_accum from this
checkout: every test and doctest of the library itself, not those of the extras (Flax,
the demo and notebooks, Orbax, the docs build) nor the multi-process suites.

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
import venv

ROOT = pathlib.Path(__file__).resolve().parent.parent
CONSTRAINTS = ROOT / "tests" / "oldest_versions.txt"
TEST_TOOLS = ["pytest>=8", "pytest-xdist>=3.8", "hypothesis>=6.150"]
CACHE = pathlib.Path(os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache")

# The extras' tests, the multi-process suites, and this test itself stay out.
NOT_CORE = {
    "test_benchmarks.py",  # dense.py measures Flax TrainState and NNX too
    "test_bad_inputs_coverage.py",  # reads every table, the Flax one too
    "test_bad_inputs_flax.py",
    "test_demo.py",
    "test_docs.py",
    "test_embedding.py",
    "test_flax.py",
    "test_fsdp_flax.py",
    "test_microbatching.py",  # optax.microbatching is not in optax 0.2.5 (it is in 0.2.8)
    "test_multihost.py",
    "test_notebooks.py",
    "test_oldest_versions.py",
    "test_orbax.py",
    "test_porting.py",  # the ports use Flax and Orbax
    "test_ray.py",  # the ray extra
    "test_preemption.py",
    "test_regression_guard_flax.py",
    # Reduced and unreduced sharding types are jax 0.10's; on the oldest jax the
    # library's answer is a clear error, which test_unreduced_versions.py checks here.
    "test_unreduced.py",
    "test_bad_inputs_unreduced.py",
}
# Their doctests need Flax, and jax 0.10's unreduced sharding types.
NOT_CORE_MODULES = {"embedding.py", "flax_train_state.py", "unreduced.py"}
DESELECT = [
    # Rules on the source, whatever the jax: radon is a test extra of the newest run.
    "tests/test_layout.py::test_radon_rates_no_function_worse_than_c",
    "tests/test_layout.py::test_the_complexity_check_sees_a_tangled_function",
    # Orbax is a test-only dependency of the newest run.
    "tests/test_agn.py::test_checkpoint_resume_mid_round_is_bit_exact",
    # A memory guard on XLA's compiler, not on correctness: jax 0.8's XLA:CPU keeps
    # about 13 kB more temporaries in a bfloat16 train step (42 kB against 30 kB
    # allowed; float32 passes here, and bfloat16 from jax 0.9 on, in the newest run).
    "tests/test_regression_guard.py::test_train_step_temporaries_are_the_release_mean_and_updates[canonical-bf16]",
    "tests/test_regression_guard.py::test_train_step_temporaries_are_the_release_mean_and_updates[apply_gradients-bf16]",
    # The anchor, not our code: optax 0.2.5's MultiSteps itself raises on bfloat16 or
    # float16 gradients for float32 params under SGD (its cond branches return
    # different dtypes). The same cases run here against float64 NumPy anchors:
    # test_conditional_accumulator_sgd_matches_a_float64_reference and
    # test_mixed_precision_sparse_sgd_matches_a_float64_reference.
    "tests/test_mixed_precision.py::test_conditional_accumulator_matches_multisteps_in_mixed_precision"
    "[f32-params-bf16-grads-sgd]",
    "tests/test_sparse.py::test_mixed_precision_matches_multisteps[float32-bfloat16-sgd]",
    "tests/test_sparse.py::test_mixed_precision_matches_multisteps[float32-float16-sgd]",
]


def _pins() -> dict[str, str]:
    pins = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, version = line.split("==")
            pins[name.strip()] = version.strip()
    return pins


def _core_paths() -> list[str]:
    tests = sorted(
        f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py") if p.name not in NOT_CORE
    )
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
        venv.create(target, with_pip=True)
        install = _run(
            [str(python), "-m", "pip", "install", "-q", "-c", str(CONSTRAINTS),
             *_dependencies(), *TEST_TOOLS],
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

    deselect = [arg for test in DESELECT for arg in ("--deselect", test)]
    proc = _run(
        [str(python), "-m", "pytest", "-q", "-n", "0", "-m", "not flax",
         *deselect, *_core_paths()],
        timeout=1800,
    )  # fmt: skip
    tail = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, tail
    print(sys.version, installed, tail.splitlines()[-1])
