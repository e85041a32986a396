"""Two TPU programs whose answers are known by construction, compiled for v5e-8 (libtpu's
compile-only chips) and read by tools/compile_for.py and tools/hlo.py; JSON on stdout for
tests/test_tpu.py. Run alone: python tests/tpu_programs.py"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
import compile_for as tool  # noqa: E402

tool.tpu_devices("v5e:2x4")
import common  # noqa: E402
import hlo  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

mesh = jax.make_mesh((8,), ("x",))
ring = [(i, (i + 1) % 8) for i in range(8)]


def array(rows, columns, spec):
    return jax.ShapeDtypeStruct((rows, columns), jnp.float32, sharding=NamedSharding(mesh, spec))


def gathered(a, y):
    """A chip's piece a [1024, 8192] (32 MiB) and y [1024, 256] (1 MiB) in; out a + the largest
    of tanh of the 8 pieces gathered (256 MiB, a temporary), and y + 1."""
    pieces = jnp.tanh(lax.all_gather(a, "x", tiled=True)).reshape(8, *a.shape)
    return a + pieces.max(0), y + 1.0


def each_kind(a, b):
    """Three trips of a loop each reducing, reduce-scattering, exchanging (all-to-all) and
    passing on (a ring) a chip's [1024, 1024] (4 MiB); then a gathered (32 MiB) beside a matmul."""

    def trip(a, w):
        s, r = lax.psum(a, "x"), lax.psum_scatter(a, "x", tiled=True)
        t, p = lax.all_to_all(a, "x", 0, 0, tiled=True), lax.ppermute(a, "x", ring)
        return jnp.tanh(s + t + p + jnp.tile(r, (8, 1)) + a @ w), None

    a = lax.scan(trip, a, jnp.stack([b] * 3))[0]
    return lax.all_gather(a, "x", tiled=True), jnp.tanh(jnp.tanh(b @ b) @ b) @ b


def compiled(body, *args, donate=()):
    specs = tuple(x.sharding.spec for x in args)
    step = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P("x"), specs[1]))
    return jax.jit(step, donate_argnums=donate).lower(*args).compile()


a, y = array(8 * 1024, 8192, P("x")), array(1024, 256, P())
memory = {
    donate: tool.hbm_need(compiled(gathered, a, y, donate=donate).memory_analysis())
    for donate in [(), (0,)]
}
program = compiled(each_kind, array(8 * 1024, 1024, P("x")), array(8 * 1024, 1024, P("x")))
text = program.as_text()
wire = sum(c["wire_bytes"] for c in hlo.by_kind(text).values())
made = ("collective-permute-start", "async-collective-start")  # TPU's asynchronous forms
seconds = tool.predict(program, 0.0, 1.0, wire, "tpu v5 lite")["seconds"]["collectives"]
print(
    json.dumps(
        dict(
            hbm_need={"kept": memory[()], "donated": memory[(0,)]},
            collectives=hlo.hlo_collectives(text),
            printed=common.collectives(text),  # what a run prints
            asynchronous=[kind for kind in made if f"%{kind} = " in text],
            collective_seconds=seconds,
        )
    )
)
