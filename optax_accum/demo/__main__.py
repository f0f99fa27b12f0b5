"""Entry point: `python -m optax_accum.demo --help`."""

import os

if __name__ == "__main__":
    # The data_parallel section needs 8 devices: on a CPU, simulate them. This must
    # happen before JAX initialises; it changes nothing on a GPU or TPU.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count=8".strip()

    from optax_accum.demo import main

    main()
