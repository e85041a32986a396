"""Will my run fit on a TPU slice? Any script compiled for one on this machine, nothing run.

libtpu (pip install -t .tpu -r requirements-tpu.txt) compiles TPU programs without a TPU: its
compile-only devices for a slice (jax.experimental.topologies) stand in for the script's
devices, the script builds its mesh and its step on them as on the slice itself, and compiles.
Nothing is allocated or run, no data is read. The report is the TPU program's: memory per chip
against its HBM (XLA's TPU compiler refuses a step that does not fit: one line, exit 2), the
collectives it holds, its matmul FLOPs per chip, and a step time predicted from it at the chip's
published rates (CHIPS: matmuls at peak, HBM traffic at its bandwidth, the collectives over the
interconnect), overlapped (the largest of the three) and not (the collectives after the larger of
the other two), with the MFUs they imply. Compiled, not run: a guide to
what to rent and which flags to pass, not a measurement.

  python tools/compile_for.py v5e:2x4 fsdp.py --layers 12 --d-model 768 --heads 12 \\
      --seq-len 1024 --vocab-size 50304 --dtype bfloat16 --batch-size 64
  python tools/compile_for.py v5p:4x4x4 pjit_tp.py --metrics-file runs/v5p.jsonl --hlo step.txt

Slices: v5e:RxC and v6e:RxC (8 chips a host), v5p:AxBxC (4 chips a host); not v4, whose
compile-only devices are its TensorCores, two a chip, where a v4 run's are chips. The script
takes its own flags; --metrics-file gets the report as its summary, --hlo the TPU program's text.
A script that makes its state before it compiles (pmap_dp.py) is given the state's shapes; JAX's
pmap lowers for shapes on one host only, so pmap_dp.py compiles for one-host slices.
"""

import math
import os
import re
import runpy
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # hlo.py, beside this tool
import hlo  # noqa: E402

# A TPU chip's HBM bytes, HBM bytes/s and bidirectional inter-chip (ICI) bytes/s, by device_kind
# (cloud.google.com/tpu/docs/v5e, v5p and v6e); its peak FLOP/s is hlo.PEAK_FLOPS'.
CHIPS = {
    "tpu v5 lite": (16 * 2**30, 819e9, 400e9),  # v5e
    "tpu v5": (95 * 2**30, 2765e9, 1200e9),  # v5p
    "tpu v6 lite": (32 * 2**30, 1638e9, 800e9),  # v6e
}
USAGE = "usage: python tools/compile_for.py SLICE SCRIPT.py [its flags], e.g. v5e:2x4 fsdp.py"


def fail(message: str):
    print(f"compile_for.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def tpu_devices(topology: str):
    """Make JAX's devices a slice's compile-only ones: their client, registered as a backend."""
    import jax
    from jax.experimental import topologies
    from jax.extend.backend import register_backend_factory

    # libtpu where requirements-tpu.txt puts it, off the path of every other run (its warnings)
    bundled = Path(__file__).resolve().parent.parent / ".tpu" / "libtpu" / "libtpu.so"
    if bundled.exists():
        os.environ.setdefault("TPU_LIBRARY_PATH", str(bundled))
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-8")  # no TPU here: libtpu is quiet
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # none holds a TPU: no lock needed
    if topology.startswith("v4:"):  # libtpu's compile-only v4 devices are TensorCores
        fail("v4's compile-only devices are TensorCores, not a v4 run's chips, e.g. v5p:2x2x1")
    try:
        kind, shape = topology.split(":")
        eight = kind in ("v5e", "v6e") and math.prod(map(int, shape.split("x"))) % 8 == 0
        hosts = {"chips_per_host_bounds": (2, 4, 1)} if eight else {}  # libtpu's default: 4
        client = topologies.get_topology_desc(topology, "tpu", **hosts).devices[0].client
    except Exception as error:  # no libtpu, or a slice it does not know
        why = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        libtpu = "pip install -t .tpu -r requirements-tpu.txt"
        fail(f"cannot compile for {topology} ({why}), e.g. v5e:2x4 ({libtpu})")
    register_backend_factory("compile_only", lambda: client, priority=1)
    jax.config.update("jax_platforms", "compile_only")
    # The compile-only client counts no device as local; pmap_dp.py asks how many are
    type(client).local_device_count = lambda self: len(jax.local_devices())


def per_chip(x) -> int:
    """Bytes of one chip's piece of an abstract array: by its sharding, or pmap's stacked copies."""
    shape = x.sharding.shard_shape(x.shape) if x.sharding else x.shape[1:]
    return math.prod(shape) * x.dtype.itemsize


def predict(compiled, step_flops: float, model_flops: float, wire_bytes: float, kind: str):
    """The step's seconds at the chip's rates (matmuls at peak, HBM traffic by XLA's count, a
    loop's body once, collectives on the interconnect) two ways: overlapped, the largest of the
    three (a floor); not overlapped, the collectives after the larger of the other two. MFUs."""

    peak = next(p for n, p in hlo.PEAK_FLOPS if n in kind)
    hbm, hbm_rate, ici_rate = CHIPS[kind]
    accessed = compiled.cost_analysis()["bytes accessed"]
    times = dict(compute=step_flops / peak, hbm=accessed / hbm_rate)
    times["collectives"] = wire_bytes / ici_rate if ici_rate else 0.0
    step = dict(
        overlapped=max(times.values()),
        not_overlapped=max(times["compute"], times["hbm"]) + times["collectives"],
    )
    mfu = {way: model_flops / seconds / peak for way, seconds in step.items()}
    return dict(seconds=times, step_seconds=step, mfu=mfu, hbm=hbm)


def hbm_need(memory) -> int:
    """A chip's HBM for a program: its arguments, outputs and temporaries, a donated argument
    once (the output it becomes)."""
    sizes = ("argument", "output", "temp")
    return sum(getattr(memory, f"{s}_size_in_bytes") for s in sizes) - memory.alias_size_in_bytes


def report(config, topology: str, compiled, state, seconds: float) -> dict:
    """The run's report (common.cost_report's figures) for a step compiled on shapes alone."""
    import jax

    import common

    device, memory, text = jax.devices()[0], compiled.memory_analysis(), compiled.as_text()
    kind, full = device.device_kind.lower(), common.model_shapes(config)
    costs = hlo.costs(config, compiled)
    params, whole = common.unbox(full.params), common.unbox((full.params, full.opt_state))
    step_flops = costs["step_flops"]
    model_flops = step_flops / costs["step_flops_over_model"]
    wire = sum(c["wire_bytes"] for c in costs["collectives"].values())
    # A loop whose trip count the TPU program does not state (pipeline.py's ticks): its matmuls
    # are counted (common.trips reads its condition), its HBM traffic (XLA's) once
    uncounted = sum(
        " while(" in line and "known_trip_count" not in line for line in text.split("\n")
    )
    shards = jax.tree.leaves(common.unbox((state.params, state.opt_state)))
    return {
        "topology": topology,
        "device_kind": device.device_kind,
        "devices": jax.device_count(),
        "processes": len({d.process_index for d in jax.devices()}),
        "platform": "tpu (compiled, not run)",
        "param_count": sum(x.size for x in jax.tree.leaves(params)),
        **costs,
        "xla_flops": compiled.cost_analysis()["flops"],  # XLA's own count: a loop's body once
        "state_bytes_total": sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(whole)),
        "state_bytes_per_device": sum(map(per_chip, shards)),
        "compile_seconds": seconds,
        "compiled_argument_bytes": memory.argument_size_in_bytes,
        "compiled_temp_bytes": memory.temp_size_in_bytes,
        "hbm_need_bytes": hbm_need(memory),
        "loops_counted_once": uncounted,
        "predicted": predict(compiled, step_flops, model_flops, wire, kind)
        if kind in CHIPS
        else None,
    }


def lines(summary: dict) -> str:
    """What the report says, for people: common.report_lines', and the chip's."""
    import common

    text = common.report_lines(summary)
    if tpu := summary["predicted"]:
        fits = "fits" if summary["hbm_need_bytes"] <= tpu["hbm"] else "does not fit"
        parts = ", ".join(f"{t * 1e3:,.2f}" for t in tpu["seconds"].values())
        step, mfu = tpu["step_seconds"], tpu["mfu"]
        text += (
            f"\nHBM per chip: {summary['hbm_need_bytes'] / 2**30:.3g} GiB of "
            f"{tpu['hbm'] / 2**30:.0f} GiB, {fits} | predicted step "
            f"{step['overlapped'] * 1e3:,.1f} ms overlapped, {step['not_overlapped'] * 1e3:,.1f} "
            f"ms not (matmuls, HBM, collectives: {parts} ms), MFU {mfu['overlapped']:.1%}, "
            f"{mfu['not_overlapped']:.1%}"
        )
        if loops := summary["loops_counted_once"]:  # its HBM traffic and so its step too low
            text += f" (XLA counts {loops} loop(s)' HBM traffic once: it takes longer)"
    return text


def main(argv: list):
    if len(argv) < 2 or not argv[1].endswith(".py") or argv[0].startswith("-"):
        fail(USAGE)
    topology, script, flags = argv[0], argv[1], argv[2:]
    hlo_file = None
    if "--hlo" in flags:  # this tool's own flag: the TPU program's text to this file
        at = flags.index("--hlo")
        hlo_file, flags = flags[at + 1], flags[:at] + flags[at + 2 :]
    tpu_devices(topology)
    sys.path.insert(0, str(Path(script).resolve().parent))  # the script's common.py
    import jax
    import numpy as np

    try:
        import common
    except ImportError:
        fail(f"no common.py beside {script}: the tool runs a script of this project's")

    sys.argv, reached = [script, *flags], []
    try:  # the script's definitions, nothing run yet
        script_main = runpy.run_path(script, run_name="compile_for")["main"]
        module = script_main.__globals__
        config_class, doc = module["Config"], module["__doc__"]
    except Exception as error:
        fail(f"{script} does not load ({type(error).__name__}: {error})")
    config = common.parse_config(config_class, doc)
    common.same_start_everywhere = lambda config: None  # one process stands for the slice's

    def compile_and_stop(config, step_fn, state, *args):
        """common.compile_step: compile on shapes, report, stop before anything is made."""
        began = time.perf_counter()
        reached.append(True)  # what fails now is the compile
        mesh = next((x.sharding.mesh for x in jax.tree.leaves(state) if x.sharding), None)
        axes = ",".join(f"{a}={n}" for a, n in mesh.shape.items()) if mesh else "none, pmap"
        computes = common.computes(config)
        print(f"compiling {script}'s step for {topology} (mesh {axes}), {computes}", flush=True)
        if not hasattr(step_fn, "trace") and jax.process_count() > 1:  # jax.pmap's step
            fail(f"{script}: pmap lowers for shapes on one host only, e.g. v5p:2x2x1 (one host)")
        try:
            compiled = step_fn.lower(state, *args).compile()
        except jax.errors.JaxRuntimeError as error:  # XLA's TPU compiler: more than the HBM
            if "RESOURCE_EXHAUSTED" not in str(error):
                raise
            why = re.sub(r"\s+", " ", str(error).strip().splitlines()[0])
            fail(
                f"the step does not fit ({why}): lower --batch-size or --seq-len, or add "
                "--microbatches or --remat"
            )
        summary = report(config, topology, compiled, state, time.perf_counter() - began)
        print(
            f"{script} compiled for {topology}: {summary['devices']} chips of "
            f"{summary['device_kind']}, {summary['processes']} host(s); nothing run"
        )
        print(lines(summary), flush=True)
        if config.metrics_file:  # added to what the file holds
            with open(config.metrics_file, "a") as file:
                file.write(common.json_line({"summary": summary}))
        if hlo_file:
            Path(hlo_file).write_text(compiled.as_text())
        if (tpu := summary["predicted"]) and summary["hbm_need_bytes"] > tpu["hbm"]:
            fail(
                "the step does not fit a chip's HBM: lower --batch-size or --seq-len, or add "
                "--microbatches or --remat"
            )
        raise SystemExit(0)

    def rows_unread(dataset, config, step, split="train"):
        """common.host_batch, its shape alone: pmap_dp.py compiles for its first batch."""
        return np.zeros((config.batch_size // jax.process_count(), config.seq_len + 1), np.int32)

    common.compile_step, common.host_batch = compile_and_stop, rows_unread
    if made := module.get("init_state"):  # a state made before its step (pmap_dp.py's): shapes
        module["init_state"] = lambda *a, **k: (
            made(*a, **k) if k else jax.eval_shape(lambda: made(*a))
        )
    try:
        script_main(config)
    except Exception as error:  # what does not compile for TPU, in one line
        why = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
        if not reached:  # it ran a computation before compiling its step
            why += "; it runs on the devices before it compiles its step"
        fail(f"{script} does not compile for {topology} ({why})")


if __name__ == "__main__":
    main(sys.argv[1:])
