"""Dropout is on when asked for, every mask is drawn once, and evaluation drops nothing.

The equivalence proof runs with dropout 0 (one device cannot draw the masks of eight), so it
cannot see dropout at all: a script that never dropped anything, whose devices all drew the
same masks (one key for every device: each mask then repeats on every device's rows, which is
not dropout of the global batch), whose micro-batches, layers or steps reused a key, or which
evaluated with dropout on, would pass it. Here every script trains 2 steps of 2 micro-batches
with dropout 0.1 while a probe records each mask a dropout layer draws and on which device,
then evaluates.
"""

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import common
from tests.harness import (
    DEFAULTS,
    DEVICES,
    RTOL,
    SMALL,
    STRATEGIES,
    matrix,
    model_flags,
    record_flags,
    run_uncached,
)
from test_equivalence import global_params, reference

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


# Who draws each mask: under shard_map and pmap every device its own (its rows, or its pieces of
# the sequences), each data shard's stages their own layers' (pipeline.py); under jax.jit one
# mask of the global batch, which the compiler splits (pjit_tp.py, logical_pjit.py,
# explicit_sharding.py). Every script in every pytest.
BY_JIT = ("pjit_tp", "logical_fsdp_tp", "explicit_fsdp_tp")
STEPS, MICROBATCHES = 2, 2


def drawers(name, config) -> int:
    """How many draw their own masks of a dropout layer in one micro-batch."""
    if name in BY_JIT:
        return 1
    return config.mesh_axes()["data"] if name.startswith("pipeline") else DEVICES


@pytest.mark.parametrize("name", list(DEFAULTS.values()))
def test_dropout_is_on_and_every_mask_is_drawn_once(name, monkeypatch):
    """With --dropout 0.1 over 2 steps of 2 micro-batches, each dropout layer drops about a tenth
    of its activations, and every mask is new: as many different masks as there are dropout
    layers (the embedding's, and attention's and the MLP's in each block) x micro-batches x
    steps x those who draw them, none on two devices (a mask drawn again for the backward pass
    is the same mask, on the same device); under jax.jit, the pieces the devices' rows take
    differ. The evaluation draws none, and the first step's loss is not dropout 0's."""
    masks = probe_dropout(monkeypatch)
    result = run_uncached(
        name, dropout=RATE, steps=STEPS, microbatches=MICROBATCHES, eval_every=STEPS, eval_batches=1
    )
    jax.effects_barrier()  # every report is in
    assert masks, "no dropout layer drew a mask"
    where = {}  # mask digest -> the devices that drew it
    for device, path, mask in masks:
        if mask.size >= 1000:  # a tenth dropped, give or take the sampling
            assert abs(mask.mean() - RATE) < 0.03, (path, mask.mean())
        where.setdefault((path, digest(mask)), set()).add(device)
        if device < 0:  # the global batch's mask, its rows split over the batch's devices
            shards = result.config.batch_shards()
            pieces = {digest(piece) for piece in np.split(mask, shards)}
            assert len(pieces) == shards, f"{path}: the devices' rows drew the same masks"
    shared = {key: devices for key, devices in where.items() if len(devices) > 1}
    layers = 1 + 2 * result.config.layers
    expected = layers * MICROBATCHES * STEPS * drawers(name, result.config)
    print(
        f"\n{name}: {len(masks)} masks drawn, {len(where)} different ({expected} expected: "
        f"{layers} layers x {MICROBATCHES} micro-batches x {STEPS} steps x "
        f"{drawers(name, result.config)}), {len(shared)} on more than one device"
    )
    assert not shared, f"masks drawn on more than one device: {sorted(shared.values())[:3]}"
    assert len(where) == expected
    # The first step's loss and gradient against dropout 0's, on the same batch and parameters.
    ref = reference(**model_flags(name))
    loss, norm = (
        abs(a[0] - b[0]) / b[0]
        for a, b in [(result.losses, ref.losses), (result.grad_norms, ref.grad_norms)]
    )
    print(f"{name}: the first step's loss {loss:.1e} and gradient norm {norm:.1e} from dropout 0's")
    # Measured: at least 5.2e-5, 8.2e-3
    assert loss > RTOL and norm > 100 * RTOL, "as if dropout were 0"
    # The held-out loss, as the run logged it, is the final weights' without dropout
    record_flags(STRATEGIES[name][0], result.config)
    config = common.Config(**{**SMALL, **model_flags(name), "dropout": 0.0})
    params = global_params(name, result.state)
    batch = jnp.asarray(common.load_dataset(config).batch(0, 0, config.batch_size, "eval"))
    losses, _ = jax.jit(common.token_losses, static_argnums=1)(
        params, common.make_model(config), batch
    )
    held_out = float(losses.mean())
    off = abs(result.summary["eval_loss"] - held_out) / held_out
    print(f"{name}: held-out loss {result.summary['eval_loss']:.6f}, without dropout {off:.1e} off")
    assert off <= RTOL


@pytest.mark.parametrize("scanned", [False, True], ids=["loop", "scan_layers"])
def test_each_piece_draws_from_its_own_key(scanned, monkeypatch):
    """The embedding, every block and the head are each given their own key of the step's, under
    the layer loop and the scanned one: a model whose head drops (the GPT's does not, so its masks
    cannot tell) draws no block's masks."""
    keys = []

    def spy(piece, params, x, rng=None):
        data = jax.random.key_data(rng)
        jax.debug.callback(lambda k: keys.append((piece.name, tuple(np.asarray(k)))), data)
        return run_piece(piece, params, x, rng)

    run_piece = common.run_piece
    monkeypatch.setattr(common, "run_piece", spy)
    config = common.Config(**{**SMALL, "layers": 3, "dropout": RATE, "scan_layers": scanned})
    model = common.make_model(config)
    params = common.init_params(model, jax.random.key(0))
    tokens = jnp.zeros((2, config.seq_len), jnp.int32)
    jax.jit(model)(params, tokens, jax.random.key(1))
    jax.effects_barrier()
    assert sorted(name for name, _ in keys) == ["block"] * 3 + ["embed", "head"]
    assert len({key for _, key in keys}) == len(keys), "two pieces drew from one key"


@pytest.mark.parametrize("schedule", matrix(["1f1b", "zero-bubble"], ["zero-bubble"]))
def test_a_pipeline_backward_reads_the_masks_its_forward_drew(schedule):
    """pipeline.py --no-remat: a backward runs from what its forward kept, the dropout masks with
    it, where --remat (the default) draws them again from the same keys: the same training,
    step by step, at dropout 0.1."""
    runs = [
        run_uncached(f"pipeline_{schedule}", dropout=RATE, steps=STEPS, remat=remat)
        for remat in (True, False)
    ]
    record_flags(STRATEGIES[f"pipeline_{schedule}"][0], runs[1].config)
    print(f"\n{schedule}: losses {runs[0].losses} and {runs[1].losses} without --remat")
    assert runs[0].losses == pytest.approx(runs[1].losses, rel=RTOL)
    assert runs[0].grad_norms == pytest.approx(runs[1].grad_norms, rel=RTOL)
