"""Dropout is on when asked for, and every device draws its own masks.

The equivalence proof runs with dropout 0 (one device cannot draw the masks of eight), so it
cannot see dropout at all: a script that never dropped anything, or whose devices all drew
the same masks (one key for every device: each mask then repeats on every device's rows,
which is not dropout of the global batch), would pass it. Here every script trains a step
with dropout 0.1 while a probe records each mask a dropout layer draws and on which device.
"""

import hashlib

import jax
import numpy as np
import pytest
from flax import nnx
from jax import lax

from tests.harness import DEFAULTS, RTOL, SMALL, STRATEGIES, matrix, model_flags, run_uncached
from test_equivalence import reference

RATE = 0.1


def probe_dropout(monkeypatch) -> list:
    """Make every nnx.Dropout report the mask it draws: (the device's place in the mesh, -1 under
    jax.jit where a mask covers the global batch; the layer's input shape; the mask). Where
    shard_map or pmap runs the step, each device reports its own. Returns the list the reports
    go to."""
    masks = []
    dropout = nnx.Dropout.__call__

    def call(self, inputs, *, deterministic=None, rngs=None):
        out = dropout(self, inputs, deterministic=deterministic, rngs=rngs)
        on = not (self.deterministic if deterministic is None else deterministic)
        if on and self.rate > 0:
            mesh = jax.sharding.get_abstract_mesh()
            axes = () if mesh.empty else mesh.manual_axes
            device = lax.axis_index(axes) if axes else -1
            where = f"dropout of {inputs.shape}"
            jax.debug.callback(
                lambda d, dropped: masks.append((int(d), where, np.asarray(dropped))),
                device,
                out == 0,
            )
        return out

    monkeypatch.setattr(nnx.Dropout, "__call__", call)
    return masks


def digest(mask) -> str:
    return hashlib.sha256(np.packbits(mask).tobytes() + str(mask.shape).encode()).hexdigest()


# Every pytest: each way of drawing a device's masks once (tests/test_command_line.py's BITWISE):
# a device's index folded in by hand (shardmap_dp.py; fsdp.py and expert_parallel.py the same,
# and context_parallel.py for its pieces of a sequence), the compiler splitting one draw
# (pjit_tp.py; logical_pjit.py and explicit_sharding.py the same), pmap_dp.py's and pipeline.py's.
DRAWS = ["shardmap_dp", "context_parallel", "pjit_tp", "pmap_dp", "pipeline_1f1b"]


@pytest.mark.parametrize("name", matrix(list(DEFAULTS.values()), DRAWS))
def test_dropout_is_on_and_every_device_draws_its_own_masks(name, monkeypatch):
    """With --dropout 0.1, each dropout layer drops about a tenth of its activations, the loss is
    not dropout 0's, and no mask is drawn on two devices: where the script writes each device's
    step (shard_map, pmap), every device reports its masks and none appears on another device;
    under jax.jit one mask covers the global batch, and the pieces of it that the devices' rows
    take differ."""
    masks = probe_dropout(monkeypatch)
    result = run_uncached(name, dropout=RATE, steps=1, eval_every=0)
    jax.effects_barrier()  # every report is in
    assert masks, "no dropout layer drew a mask"
    where = {}  # mask digest -> the devices that drew it
    for device, path, mask in masks:
        if mask.size >= 1000:  # a tenth dropped, give or take the sampling
            assert abs(mask.mean() - RATE) < 0.03, (path, mask.mean())
        if device >= 0:
            where.setdefault((path, digest(mask)), set()).add(device)
        else:  # the global batch's mask, its rows split over the batch's devices as the batch is
            module, flags = STRATEGIES[name]
            shards = module.Config(**{**SMALL, **flags}).batch_shards()
            pieces = {digest(piece) for piece in np.split(mask, shards)}
            assert len(pieces) == shards, f"{path}: the devices' rows drew the same masks"
    shared = {key: devices for key, devices in where.items() if len(devices) > 1}
    devices = {device for device, *_ in masks}
    print(
        f"\n{name}: {len(masks)} masks from {len(devices)} device(s), {len(shared)} drawn on more "
        "than one"
    )
    assert not shared, f"masks drawn on more than one device: {sorted(shared.values())[:3]}"
    assert len(devices) > 1 or devices == {-1}
    # The first step's loss and gradient against dropout 0's, on the same batch and parameters.
    ref = reference(**model_flags(name))
    loss, norm = (
        abs(a[0] - b[0]) / b[0]
        for a, b in [(result.losses, ref.losses), (result.grad_norms, ref.grad_norms)]
    )
    print(f"{name}: the first step's loss {loss:.1e} and gradient norm {norm:.1e} from dropout 0's")
    # Measured: at least 5.2e-5, 8.2e-3
    assert loss > RTOL and norm > 100 * RTOL, "as if dropout were 0"
