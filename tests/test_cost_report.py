"""The end-of-run report measures what each strategy costs, and the figures are the ones
theory promises: bytes of state per device, collectives per step and their bytes, compile
time; --show-sharding and the benchmark that tabulates it all."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import pytest

import common
import fsdp
from tests.harness import DEVICES, ROOT, SMALL, TINY, as_flags, copy_alone, run, run_script, run_uncached, state_bytes

REPORT_KEYS = {
    "tokens_per_sec", "step_seconds", "compile_seconds", "param_count", "flops_per_token", "mfu",
    "state_bytes_total", "state_bytes_per_device", "compiled_argument_bytes", "compiled_temp_bytes", "collectives",
}  # fmt: skip


def cost(name, **overrides):
    summary = run(name, **overrides).summary
    return summary, {op: c["bytes"] for op, c in summary["collectives"].items()}


def test_report_measures_the_real_arrays(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = run_uncached("fsdp", steps=2, metrics_file=str(metrics))
    summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
    assert REPORT_KEYS <= set(summary) and summary == json.loads(json.dumps(result.summary))
    assert summary["mfu"] is None  # no known peak for a CPU
    assert set(summary["collectives"]) == set(common.COLLECTIVES)
    # The state's bytes from the arrays themselves, independently of the report's code.
    for name in ("shardmap_dp", "fsdp", "pjit_tp", "logical_fsdp_tp"):
        total, per_device = state_bytes(run(name).state)
        assert (run(name).summary["state_bytes_total"], run(name).summary["state_bytes_per_device"]) == (
            total,
            per_device,
        ), name
    config = common.Config(**SMALL)
    n, d, t = summary["param_count"], config.d_model, config.seq_len
    tables = (common.VOCAB_SIZE + t) * d
    assert summary["flops_per_token"] == 6 * (n - tables) + 12 * config.layers * t * d


HLO = """HloModule step
%body (p: (s32[], f32[8,4])) -> (s32[], f32[8,4]) {
  %p = (s32[], f32[8,4]) parameter(0)
  %x = f32[8,4]{1,0} get-tuple-element(%p), index=1
  %g = f32[64,4]{1,0} all-gather(%x), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  ROOT %t = (s32[], f32[8,4]) tuple(%i, %x)
}
%cond (p: (s32[], f32[8,4])) -> pred[] {
  ROOT %c = pred[] constant(true)
}
ENTRY %main (a: f32[8,4], b: bf16[16]) -> f32[8,4] {
  %a = f32[8,4]{1,0} parameter(0)
  %b = bf16[16]{0} parameter(1)
  %s = f32[8,4]{1,0} all-reduce-start(%a), replica_groups={{0,1}}, to_apply=%add
  %d = f32[8,4]{1,0} all-reduce-done(%s)
  %r = bf16[2]{0} reduce-scatter(%b), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %w = (s32[], f32[8,4]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %o = f32[8,4]{1,0} copy(%d)
}
"""


def test_collectives_are_counted_per_step_and_device():
    """Hand-written HLO: an op in a while loop runs once per iteration; an async pair is one op;
    bytes are the larger of operands and result."""
    found = {c["op"]: (c["runs"], c["bytes"]) for c in common.hlo_collectives(HLO)}
    assert found == {"all-gather": (3, 64 * 4 * 4), "all-reduce": (1, 8 * 4 * 4), "reduce-scatter": (1, 16 * 2)}


@pytest.mark.parametrize("name", ["fsdp", "pjit_tp", "logical_fsdp_tp"])
def test_scanned_layers_cost_the_same_communication(name):
    """With --scan-layers the blocks' collectives sit in a while loop; counted per iteration,
    a step moves the same bytes as unscanned."""
    scanned, unscanned = cost(name, scan_layers=True)[1], cost(name)[1]
    if name != "pjit_tp":  # the two that gather weights over 'data'
        # XLA's CPU compiler merges an unscanned block's forward and backward all-gathers (see
        # fsdp.gather_before_use) but keeps them apart inside the scan: there, every block
        # kernel is gathered a second time for the backward pass, as ZeRO-3 intends. With
        # fsdp_tp, each device gathers only its 'model' part of a kernel.
        config = common.Config(**SMALL)
        params = jax.tree_util.tree_leaves_with_path(
            jax.eval_shape(lambda: nn.unbox(common.init_params(config, jax.random.key(0))))
        )
        kernels = sum(
            common.nbytes(x)
            for path, x in params
            if "block_" in jax.tree_util.keystr(path) and path[-1].key == "kernel"
        )
        model_parts = 4 if name == "logical_fsdp_tp" else 1
        assert scanned.pop("all-gather") == unscanned.pop("all-gather") + kernels // model_parts
    assert scanned == unscanned


@pytest.mark.parametrize("name", ["pmap_dp", "shardmap_dp"])
def test_data_parallel_reduces_the_gradients_once(name):
    summary, moved = cost(name)
    print(f"\n{name}: all-reduce {moved['all-reduce']:,} bytes, parameters {summary['param_bytes']:,}")
    assert abs(moved["all-reduce"] / summary["param_bytes"] - 1) <= 0.10
    assert sum(moved.values()) == moved["all-reduce"]


def test_fsdp_moves_each_parameter_twice_at_most():
    summary, moved = cost("fsdp")
    params = summary["param_bytes"]
    print(
        f"\nfsdp: all-gather {moved['all-gather'] / params:.2f} x, reduce-scatter {moved['reduce-scatter'] / params:.2f} x"
        f" parameter bytes; state {summary['state_bytes_per_device'] * DEVICES / summary['state_bytes_total']:.3f}"
        " x total/8 per device"
    )
    assert params <= moved["all-gather"] <= 2 * params
    assert abs(moved["reduce-scatter"] / params - 1) <= 0.10
    assert moved["all-reduce"] < 0.01 * params  # only the metrics
    assert abs(summary["state_bytes_per_device"] * DEVICES / summary["state_bytes_total"] - 1) <= 0.05


def test_fsdp_state_per_device_scales_as_one_over_n(tmp_path):
    """The default model on 2, 4, 8 and 16 emulated devices: state bytes per device within 5%
    of total / N."""
    ratios = {}
    for n in (2, 4, 8, 16):
        metrics = tmp_path / f"{n}.jsonl"
        done = run_script(
            "fsdp", tmp_path, "--steps=1", "--eval-every=0", f"--cpu-devices={n}", f"--metrics-file={metrics}"
        )
        assert done.returncode == 0, done.stderr[-2000:]
        summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
        ratios[n] = summary["state_bytes_per_device"] * n / summary["state_bytes_total"]
    print(f"\nfsdp, default model: state per device x N / total = {ratios}")
    assert all(abs(ratio - 1) <= 0.05 for ratio in ratios.values())


def test_remat_keeps_less_for_the_backward_pass():
    """With --remat, JAX keeps fewer bytes between the forward and the backward pass: the
    residuals of the loss's VJP, for one device's rows. (Its losses match the reference:
    test_equivalence.py.)"""

    def residual_bytes(**overrides):
        config = common.Config(**{**SMALL, **overrides})
        model, tokens = (
            common.GPT(config),
            jax.numpy.zeros((SMALL["batch_size"] // DEVICES, config.seq_len + 1), "int32"),
        )
        params = nn.unbox(common.init_params(config, jax.random.key(0)))
        vjp = jax.eval_shape(lambda p: jax.vjp(lambda p: common.loss_fn(p, model.apply, tokens, None)[0], p)[1], params)
        return sum(map(common.nbytes, jax.tree.leaves(vjp)))

    kept, remat = residual_bytes(), residual_bytes(remat=True)
    print(f"\n--remat: {kept:,} -> {remat:,} bytes kept for the backward pass")
    assert remat < 0.7 * kept


def test_scanned_compile_time_does_not_grow_with_layers(tmp_path):
    """logical_pjit.py --scan-layers compiles one block whatever --layers says. Measured in
    fresh processes without the test session's compilation cache."""
    seconds = {}
    for layers in (2, 12):
        metrics = tmp_path / f"{layers}.jsonl"
        flags = as_flags({**SMALL, "steps": 1, "layers": layers, "metrics_file": metrics})
        copy_alone("logical_pjit", tmp_path)
        env = {**os.environ, "JAX_ENABLE_COMPILATION_CACHE": "false"}
        done = subprocess.run(
            [sys.executable, "logical_pjit.py", *flags, "--scan-layers"], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        seconds[layers] = json.loads(metrics.read_text().splitlines()[-1])["summary"]["compile_seconds"]
    print(f"\nlogical_pjit --scan-layers compile: 2 layers {seconds[2]:.2f}s, 12 layers {seconds[12]:.2f}s")
    assert seconds[12] <= 1.5 * seconds[2]


def test_show_sharding_prints_every_parameter(tmp_path):
    done = run_script("fsdp", tmp_path, *TINY, "--show-sharding")
    assert done.returncode == 0, done.stderr[-2000:]
    table = dict(
        (line.split()[0], line.split()[1:])
        for line in done.stdout.splitlines()
        if line.startswith(("block_", "embed/", "head/")) and not line.endswith("over the devices:")
    )
    config = fsdp.Config(steps=3, batch_size=8, seq_len=16, layers=1, d_model=32)
    expected = jax.eval_shape(lambda: nn.unbox(common.init_params(config, jax.random.key(0))))
    names = [
        jax.tree_util.keystr(path, simple=True, separator="/")
        for path, _ in jax.tree_util.tree_leaves_with_path(expected)
    ]
    assert sorted(table) == sorted(names)
    fc1 = " ".join(table["block_0/mlp/fc1/kernel"])
    assert "(32, 128)" in fc1 and "'data'" in fc1 and fc1.endswith(f"{32 * 128 * 4 // DEVICES:,}")
    assert "block_0/mlp/fc1/kernel (32, 128) over the devices" in done.stdout  # the drawing's title


def test_benchmark_writes_the_table_and_the_picture(tmp_path):
    done = subprocess.run(
        [sys.executable, ROOT / "benchmarks" / "benchmark.py", "--only", "shardmap_dp,fsdp", "--no-readme",
         "--out", tmp_path, "--", *TINY, "--eval-every", "2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in (tmp_path / "results.md").read_text().splitlines() if line.startswith("| ")]
    assert [row.split(" | ")[0] for row in rows] == ["| strategy", "| shardmap_dp", "| fsdp"]
    assert (tmp_path / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
