"""Entry point: `python -m optax_accum.demo --help`."""

from optax_accum.demo import main

if __name__ == "__main__":
    import os

    # Sections that show multi-device behaviour simulate 8 CPU devices when no
    # accelerator is present; this must happen before JAX initialises.
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    main()
