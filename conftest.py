"""Start JAX with 8 emulated CPU devices before any test touches a device.

The tests compile far more than they run (a few steps of a tiny model, about sixty times), so
they ask XLA for less optimised machine code: this shortens each compilation by about a
third on CPU. It changes nothing the tests check: XLA's HLO passes, and so the collectives
and shardings, are the same, and every comparison is between programs compiled alike. The
scripts' subprocesses inherit the setting.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
