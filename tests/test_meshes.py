"""The meshes the scripts choose themselves (--mesh auto), as functions of the device and host
counts, from 1 to 256 chips with 4 or 8 a host: the tests run on 8 devices, a user on anything.

Each script's own make_mesh runs on stand-in devices (the counts JAX reports replaced, and the
devices handed to common.make_mesh's device assignment): GPUs numbered host by host, and the
compile-only chips of real TPU slices (libtpu, requirements-tpu.txt). What is checked is what
each script says its 'auto' does, written here: the axis sizes its help gives, and that the
axis whose collectives run in every block (tensor parallelism's 'model', context
parallelism's 'context', expert parallelism's 'expert', the pipeline's 'stage') keeps each of
its groups together: within one host on GPUs (NVLink, not the network), on a box of the torus
on a TPU (neighbouring chips on its interconnect)."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from jax.experimental import mesh_utils

import common
from tests.harness import ROOT, SCRIPTS, matrix

# Hosts of 4 or 8 devices, from one device to 256; 3 hosts too
COUNTS = sorted(
    {(n, n) for n in (1, 2, 4, 8)}
    | {(per_host * hosts, per_host) for per_host in (4, 8) for hosts in (2, 3, 4, 8, 16, 32, 64)}
)
COUNTS = [(n, local) for n, local in COUNTS if n <= 256]
# The flags 'auto' reads (each script's defaults, and others): key-value heads, layers and
# groups of layers per stage, experts
CASES = {
    "fsdp": [{}],
    "pjit_tp": [{}, {"kv_heads": 2}, {"kv_heads": 1}, {"heads": 6, "kv_heads": 6}],
    "logical_pjit": [{}, {"kv_heads": 2}],
    "explicit_sharding": [{}, {"kv_heads": 2}],
    "pipeline": [{}, {"layers": 6}, {"layers": 8, "schedule": "interleaved"}, {"layers": 1}],
    "context_parallel": [{}],
    "expert_parallel": [{}, {"experts": 6}, {"experts": 16}, {"experts": 1}],
}
INNER = {  # the axis whose collectives run in every block
    "pjit_tp": "model",
    "logical_pjit": "model",
    "explicit_sharding": "model",
    "pipeline": "stage",
    "context_parallel": "context",
    "expert_parallel": "expert",
}


def stated(script, config, n, local) -> dict:
    """The mesh each script's help says 'auto' gives: (axis, size) in mesh order."""
    half = max(1, n // 2)  # at most half the devices: some data parallelism is kept
    if script == "fsdp":
        return {"replica": 1, "data": n}
    if script in ("pjit_tp", "logical_pjit", "explicit_sharding"):  # up to 4, whole kv heads
        kv = config.kv_heads or config.heads
        model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0 and m <= half)
        return {"data": n // model, "model": model}
    if script == "pipeline":  # up to 4 stages, each whole groups of layers
        groups = config.virtual_stages if config.schedule == "interleaved" else 1
        fits = [s for s in (1, 2, 4) if n % s == 0 and config.layers % (s * groups) == 0]
        stage = max(s for s in fits if s <= max(2, half))  # both of 2: nothing else pipelines
        return {"data": n // stage, "stage": stage}
    if script == "context_parallel":
        context = max(c for c in (1, 2, 4) if n % c == 0 and c <= half)
        return {"data": n // context, "context": context}
    # expert_parallel: whole experts, at most half the devices, within a host's devices
    expert = math.gcd(config.experts, half, local)
    return {"data": n // expert, "expert": expert}


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A stand-in for a GPU: JAX numbers a cluster's GPUs host by host."""

    id: int
    process_index: int
    platform: str = "gpu"
    device_kind: str = "NVIDIA H100 80GB HBM3"


def counted(monkeypatch, devices):
    """JAX's device counts and common.make_mesh's devices: those given."""
    local = sum(d.process_index == 0 for d in devices)
    monkeypatch.setattr(jax, "device_count", lambda: len(devices))
    monkeypatch.setattr(jax, "local_device_count", lambda: local)
    monkeypatch.setattr(jax, "process_count", lambda: len({d.process_index for d in devices}))
    assign = SimpleNamespace(
        create_device_mesh=lambda shape, **kw: mesh_utils.create_device_mesh(shape, devices, **kw)
    )
    monkeypatch.setattr(common, "mesh_utils", assign)


def groups(mesh, axis) -> list:
    """The devices of each group along one axis of a mesh."""
    at = mesh.axis_names.index(axis)
    return list(np.moveaxis(mesh.devices, at, -1).reshape(-1, mesh.shape[axis]))


@pytest.mark.parametrize("script", list(CASES))
def test_every_auto_mesh_is_what_its_script_says(script, monkeypatch):
    """On every count of GPUs, each case's 'auto' mesh: its axes the sizes the script's help
    states, every device once, and the per-block axis's groups each within one host."""
    module, checked = SCRIPTS[script], 0
    for flags in CASES[script]:
        for n, local in COUNTS:
            devices = [Gpu(i, i // local) for i in range(n)]
            with monkeypatch.context() as patched:
                counted(patched, devices)
                config = module.Config(**flags)
                mesh = module.make_mesh(config)
                said = stated(script, config, n, local)
                where = f"{script} {flags} on {n} GPUs, {local} a host"
                assert config.mesh_axes() == said, f"{where}: {config.mesh_axes()} != {said}"
                assert {d.id for d in mesh.devices.flat} == set(range(n)), where
                if axis := INNER.get(script):
                    hosts = [len({d.process_index for d in g}) for g in groups(mesh, axis)]
                    assert max(hosts) == 1, f"{where}: a group of '{axis}' spans hosts"
                checked += 1
    print(f"\n{script}: {checked} meshes, each as stated")


# TPU slices from 4 chips to 256: v5e's hosts hold 8 chips (2x4), v5p's 4 (2x2x1)
SLICES = [f"v5e:{s}" for s in ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")]
SLICES += [f"v5p:{s}" for s in ("2x2x1", "2x2x2", "2x2x4", "2x4x4", "4x4x4", "4x4x8", "4x8x8")]


def tpu_meshes() -> list:
    """In a process of its own (libtpu): every case's 'auto' mesh on every slice, by the script's
    make_mesh; one line of JSON per mesh: each per-block group's span on the torus, its hosts,
    and whether the assignment is jax.make_mesh's where that one exists."""
    from jax.experimental import topologies

    found = []
    for name in SLICES:
        kind, shape = name.split(":")
        hosts = {"chips_per_host_bounds": (2, 4, 1)} if kind == "v5e" else {}
        devices = topologies.get_topology_desc(name, "tpu", **hosts).devices
        for script, cases in CASES.items():
            for flags in cases:
                with pytest.MonkeyPatch.context() as patched:
                    counted(patched, devices)
                    config = SCRIPTS[script].Config(**flags)
                    mesh, axes = SCRIPTS[script].make_mesh(config), config.mesh_axes()
                    try:
                        sizes, names = tuple(mesh.shape.values()), mesh.axis_names
                        theirs = jax.make_mesh(sizes, names, devices=devices)
                        same = theirs.devices.tolist() == mesh.devices.tolist()
                    except Exception:  # no assignment without splitting a side of the torus
                        same = None
                spans = []
                for group in groups(mesh, INNER.get(script, mesh.axis_names[-1])):
                    coords = np.array([d.coords for d in group])
                    spans.append((coords.max(0) - coords.min(0) + 1).tolist())
                found.append(dict(slice=name, script=script, flags=flags, mesh=axes))
                found[-1].update(spans=spans, same=same, chips=len(devices))
    print(json.dumps(found))


def test_on_a_tpu_slice_each_group_is_a_box_of_the_torus(tmp_path):
    """Every case's 'auto' mesh on TPU slices of 8 to 256 chips (compile-only devices): the sizes
    the script states for that count, and each group of the per-block axis a box of
    neighbouring chips (as many chips as the box holds), the assignment jax.make_mesh's where it
    has one (common.make_mesh splits a side of the torus only where it must)."""
    env = dict(os.environ, TPU_ACCELERATOR_TYPE="v5litepod-8", TPU_WORKER_HOSTNAMES="localhost")
    env.update(TPU_LIBRARY_PATH=str(ROOT / ".tpu" / "libtpu" / "libtpu.so"))
    env.update(ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    code = "from tests.test_meshes import tpu_meshes; tpu_meshes()"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert len(found) == len(SLICES) * sum(map(len, CASES.values()))
    for mesh in found:
        where = f"{mesh['script']} {mesh['flags']} on {mesh['slice']}: {mesh['mesh']}"
        per_host = 8 if mesh["slice"].startswith("v5e") else 4
        config = SCRIPTS[mesh["script"]].Config(**mesh["flags"])
        assert mesh["mesh"] == stated(mesh["script"], config, mesh["chips"], per_host), where
        size = mesh["mesh"][INNER.get(mesh["script"], "data")]
        assert all(math.prod(span) == size for span in mesh["spans"]), f"{where}: not a box"
        assert mesh["same"] in (True, None), f"{where}: not jax.make_mesh's assignment"
    print(f"\n{len(found)} meshes on {len(SLICES)} TPU slices, each group a box of the torus")


# Flags each refused somewhere from 1 to 16 devices (a batch, heads, layers, experts, a sequence
# a count does not split; a mesh of other axes or devices), on hosts of 4 and 8
REFUSED = [{}, dict(batch_size=12), dict(batch_size=6, microbatches=3), dict(kv_heads=1)]
REFUSED += [dict(heads=3, d_model=96), dict(experts=6), dict(layers=3), dict(seq_len=60)]
REFUSED += [dict(mesh=m) for m in ("data=4,model=2", "data=2,stage=4", "replica=2,data=4")]
REFUSED += [dict(mesh="data=2,context=4"), dict(mesh="data=2,expert=4")]
HOSTS = [(1, 1), (2, 2), (4, 4), (8, 8), (8, 4), (12, 4), (16, 8)]
# -m full: the two whose checks trace the model (2 to 3 minutes each on a slow 2-core machine),
# and logical_pjit.py, whose rules and their refusals explicit_sharding.py shares; every pytest
# the other six
TRACING = ("pjit_tp", "context_parallel", "logical_pjit")


def example(message: str) -> dict:
    """The flags a refusal's 'e.g.' sets, as text."""
    said = message.split("e.g. ", 1)[1].split(" (or ")[0]  # the first of its fixes
    return {
        name.replace("-", "_"): v.rstrip(",;)") for name, v in re.findall(r"--([\w-]+) (\S+)", said)
    }


@pytest.mark.parametrize("script", matrix(list(SCRIPTS), [s for s in SCRIPTS if s not in TRACING]))
def test_every_refusal_gives_a_fix_that_runs_there(script, monkeypatch):
    """On 1 to 16 GPUs, 4 or 8 a host, each case refused or not: what a refusal's 'e.g.' sets is
    accepted there, or refused for another reason, which gives its own; the defaults run on
    every power of two (pipeline.py on 2 GPUs once refused its own 'auto', one stage)."""
    # The GPT's parameters and their names do not change with the batch, its micro-batches or
    # the mesh, which most fixes set: built once per model, not once per config (the cases of
    # explicit_sharding.py and expert_parallel.py: 117 -> 26 s, the same 68 and 52 refusals)
    named, same = common.logical_names, {"batch_size": 32, "microbatches": 1, "mesh": "auto"}

    def by_model(config):
        return named(
            dataclasses.replace(config, **{k: same[k] for k in same if hasattr(config, k)})
        )

    monkeypatch.setattr(common, "logical_names", by_model)
    module, refusals = SCRIPTS[script], 0
    names = {field.name: type(field.default) for field in dataclasses.fields(module.Config)}
    cases = {tuple((k, v) for k, v in flags.items() if k in names) for flags in REFUSED}
    for case in sorted(cases):
        for n, local in HOSTS:
            flags, said = dict(case), []
            with monkeypatch.context() as patched:
                counted(patched, [Gpu(i, i // local) for i in range(n)])
                for _ in range(4):
                    try:
                        module.Config(**flags).validate()
                        break
                    except common.ConfigError as error:
                        said.append(str(error))
                    where = f"{script} on {n} GPUs, {local} a host: {' -> '.join(said)}"
                    assert "e.g. --" in said[-1], f"{where}: no example"
                    again = [re.sub(r"\d+", "N", m.split(", e.g.")[0]) for m in said]
                    assert len(set(again)) == len(again), f"{where}: its example is refused"
                    flags = {**flags, **{k: names[k](v) for k, v in example(said[-1]).items()}}
                else:
                    raise AssertionError(f"{where}: still refused")
            if not case and n & (n - 1) == 0:  # its defaults run on 1, 2, 4, 8 and 16
                assert not said, f"{script} on {n} GPUs refuses its defaults: {said[0]}"
            refusals += len(said)
    print(f"\n{script}: {refusals} refusals on {len(HOSTS)} counts, each example accepted")


def test_fsdp_keeps_its_data_axis_and_splits_no_scanned_layers_axis():
    """fsdp.py's mesh names 'data' at size 1 too (--mesh replica=8,data=1: HSDP that splits
    nothing), which every split parameter's layout names; a parameter of --min-shard-size values
    is split; --scan-layers' axis of layers never is, even where it divides (16 on 8)."""
    fsdp = SCRIPTS["fsdp"]
    assert dict(fsdp.make_mesh(fsdp.Config(mesh="replica=8,data=1")).shape) == {
        "replica": 8,
        "data": 1,
    }
    config = fsdp.Config(scan_layers=True, min_shard_size=16 * 8 * 4)
    params = {"blocks": {"w": np.zeros((16, 8, 4))}, "head": {"w": np.zeros((16, 8, 4))}}
    split = fsdp.shard_params(params, config)
    assert split["blocks"]["w"].out_sharding == (None, "data", None)
    assert split["head"]["w"].out_sharding == ("data", None, None)


def test_micro_batches_on_a_mesh_axis_of_one_device():
    """explicit_sharding.py --rules dp --mesh data=8,model=1 (the README's flags for one host)
    with --microbatches 4: the batch is split over 'data' alone (an axis of one device in its
    layout made lax.scan refuse the micro-batches), and trains as one device does."""
    from test_equivalence import reference, relative
    from tests.harness import RTOL, run

    result = run("explicit_dp", mesh="data=8,model=1", microbatches=4, batch_size=32, steps=2)
    ref = reference(batch_size=32)  # test_microbatches_match's: the same first steps
    assert relative(result.losses, ref.losses[:2]) <= RTOL
    assert relative(result.grad_norms, ref.grad_norms[:2]) <= RTOL
