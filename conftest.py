"""Start JAX with 8 emulated CPU devices before any test touches a device."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
