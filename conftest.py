"""Test configuration: 8 host CPU devices, XLA:CPU's code unoptimised, and strict dtype
promotion.

These must be set before JAX initialises its backends, so this runs at import time,
before any test module imports jax.numpy. optax's Adam is not clean under strict
promotion (`decay ** count`); tests wrap such third-party optimizers in
`_cases.lenient` (or use `_cases.adam`), which keeps optax_accum's own code strict.

`--xla_backend_optimization_level=0`: the suite compiles thousands of small programs
and runs each for microseconds, so LLVM's optimisation of the machine code costs far
more than it saves (about 30% of the compile-bound tests' time). It changes neither
what XLA's HLO passes produce (the programs, buffers and collectives the tests read)
nor any result (XLA:CPU uses no fast math).

`--xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1`:
XLA:CPU's MLIR fusion emitters took most of a small program's compile time (a 24-leaf
accumulator step with Adam: 5.1 s to compile with them, 0.4-0.6 s with the older
emitters and one LLVM module instead of a split into parallel ones, which 2 cores
cannot use); the whole suite's CPU time fell from 1,490 s to 900 s. The older emitters
run the same fusions, so results and the HLO the tests read are the same, but for
two things: a lone elementwise op stays outside any fusion, and a scatter becomes a
dynamic-update-slice. The tests that read how XLA:CPU laid a program out compile
with `_hlo.AS_USERS_COMPILE` (the emitters on), as users compile.

Processes the tests start inherit these flags; the benchmarks, run by themselves,
compile at XLA's default, as users do.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
    + " --xla_cpu_use_fusion_emitters=false --xla_cpu_parallel_codegen_split_count=1"
).strip()

# The test extra installs libtpu (the TPU compiler, for tests/test_tpu_compiled.py, which
# compiles for TPU topologies without a TPU). The tests run on the CPU: without this, JAX
# would try to start a TPU in every test process (and those the tests start), logging
# that it found none.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Ray (tests/test_ray*.py): the test cluster listens on the loopback address only. Ray
# 2.60 maps 127.0.0.1 to the machine's address unless this is off; it is read when ray
# is imported, and the cluster's workers inherit it.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")

# Property tests (Hypothesis): the "ci" profile, loaded here, sizes the example counts so
# the README's test command fits in its time; `pytest --hypothesis-profile thorough` runs
# four times as many. A test's own count is `_cases.examples(n)`: n under "thorough".
from hypothesis import settings  # noqa: E402

settings.register_profile("ci", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=100, deadline=None)
settings.load_profile("ci")


# --------------------------------------------------------------------------- Ray
# One local Ray cluster per test session (per pytest-xdist worker), started by the
# first test that needs it (tests/test_ray*.py, optax_accum/ray's doctests) and shut
# down at the end: 2 CPUs, on the loopback address (see the top), no dashboard.

import pathlib  # noqa: E402

import pytest  # noqa: E402

_ROOT = pathlib.Path(__file__).resolve().parent


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray cluster whose workers import this checkout's optax_accum (and the
    test modules, whose remote functions they run)."""
    ray = pytest.importorskip("ray")
    path = os.environ.get("PYTHONPATH")
    paths = (str(_ROOT), str(_ROOT / "tests"), path)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
    )
    import psutil  # a Ray dependency

    started = psutil.Process().children(recursive=True)  # Ray's GCS, raylet, workers
    try:
        yield ray
    finally:
        started += psutil.Process().children(recursive=True)
        ray.shutdown()
        _, alive = psutil.wait_procs(set(started), timeout=30)
        assert not alive, f"Ray left processes running: {alive}"
        if path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = path


@pytest.fixture(autouse=True)
def _ray_for_doctests(request):
    """optax_accum/ray's doctests run on the session's cluster."""
    if isinstance(request.node, pytest.DoctestItem) and "optax_accum/ray/" in str(
        request.node.path
    ):
        request.getfixturevalue("ray_cluster")
