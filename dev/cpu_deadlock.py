"""The hang of issue 28, on purpose: XLA's CPU client deadlocks when its thread pool has fewer
than 2 x devices threads (common.start_devices says why).

Each step is one tiny program with an all-gather over every emulated device, dispatched
without waiting, so more than 32 are soon in flight per device. With the scripts' setting
(2 x devices threads) it finishes in under a second; with fewer it stops for good in its
first all-gather, every device but one waiting there, as the run in the issue did (XLA says
"waiting for all gather ... Expected N threads to join the rendezvous" after 10 minutes with
the scripts' timeouts, after 20 seconds with XLA's own). Measured on 2 cores: 8 devices hang
with 15 threads and finish with 16; 4 devices hang with 4 (XLA's default here) or 5, and
finish with 6 or more.

  python dev/cpu_deadlock.py                           # the scripts' setting: finishes
  python dev/cpu_deadlock.py --devices 8 --threads 15  # 2N - 1 threads: hangs, until SIGKILL
  python dev/cpu_deadlock.py --threads 4               # XLA's default on <= 4 cores: hangs
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import common  # noqa: E402

parser = argparse.ArgumentParser(
    description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
)
parser.add_argument("--devices", type=int, default=4, help="emulated CPU devices")
parser.add_argument(
    "--threads",
    type=int,
    help="the CPU client's threads (PJRT_NPROC); default: the scripts' choice",
)
parser.add_argument("--steps", type=int, default=300)
args = parser.parse_args()
if args.threads:
    os.environ["PJRT_NPROC"] = str(args.threads)
common.setup(common.Config(cpu_devices=args.devices))  # starts the devices as the scripts do
print(f"{args.devices} devices, PJRT_NPROC={os.environ['PJRT_NPROC']}", flush=True)

mesh = jax.make_mesh((args.devices,), ("d",))
step = jax.jit(
    jax.shard_map(
        lambda x: jax.lax.all_gather(x, "d", tiled=True)[: x.shape[0]] + 1,
        mesh=mesh,
        in_specs=P("d"),
        out_specs=P("d"),
    )
)
x = jax.device_put(np.zeros((args.devices * 64, 64), np.float32), NamedSharding(mesh, P("d")))
start = time.perf_counter()
for _ in range(args.steps):
    x = step(x)  # not waited for: the host runs far ahead of the devices
x.block_until_ready()
print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s", flush=True)
