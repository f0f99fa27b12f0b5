"""Test configuration: 8 host CPU devices and strict dtype promotion.

Both must be set before JAX initialises its backends, so this runs at import time,
before any test module imports jax.numpy. optax's Adam is not clean under strict
promotion (`decay ** count`); tests wrap such third-party optimizers in
`_cases.lenient` (or use `_cases.adam`), which keeps optax_accum's own code strict.
"""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

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
