"""tools/compile_for.py: each script compiled for a TPU slice on this CPU machine (libtpu's
compile-only devices, requirements-tpu.txt), nothing run, from a folder holding only the script
and common.py, as a user's copy; its report checked against the compiled program and the
script's docstring, and the predicted step time against hand arithmetic."""

import json
import math
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

import common

from tools import hlo
from tools import compile_for as tool
from tests.harness import FULL, MOE, ROOT, TINY, as_flags, copy_alone, matrix

TOPOLOGY = "v5e:2x4"  # v5e-8: 8 chips, one host
# The scripts' default width and length (smaller arrays would be mostly TPU's tile padding)
SIZE = as_flags(dict(layers=2, d_model=128, seq_len=64, batch_size=32))
# The collectives each docstring names for the script's defaults, by kind (logical_pjit.py's and
# explicit_sharding.py's fsdp_tp reduce-scatter their 'data' gradients in one, combined, which
# XLA:CPU writes as all-reduces; logical_pjit.py's layout adds 2 tiny permutes).
NAMED = {
    "pmap_dp": {"all-reduce"},
    "shardmap_dp": {"all-reduce"},
    "fsdp": {"all-gather", "reduce-scatter", "all-reduce"},
    "pjit_tp": {"all-reduce"},
    "logical_pjit": {"all-gather", "reduce-scatter", "all-reduce", "collective-permute"},
    "explicit_sharding": {"all-gather", "reduce-scatter", "all-reduce"},
    "pipeline": {"collective-permute", "all-gather", "reduce-scatter", "all-reduce"},
    "context_parallel": {"collective-permute", "all-reduce"},
    "expert_parallel": {"all-to-all", "all-reduce"},  # dropless: ragged all-to-alls
}


def compile_for(script, tmp_path, *flags, topology=TOPOLOGY):
    """The script, copied with common.py alone into tmp_path, compiled for a slice by
    tools/compile_for.py: (the process, its summary, the TPU program's text)."""
    copy_alone(script, tmp_path)
    metrics, hlo = tmp_path / "m.jsonl", tmp_path / "step.hlo"
    command = [sys.executable, str(ROOT / "tools/compile_for.py"), topology, f"{script}.py"]
    command += [*SIZE, *flags, "--metrics-file", str(metrics), "--hlo", str(hlo)]
    metrics.unlink(missing_ok=True)
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(metrics.read_text().splitlines()[-1])["summary"]
    return done, summary, hlo.read_text()


def the_report_is_the_programs(done, summary, text, batch):
    """The report is the TPU program's, nothing run: its state per chip what the program takes
    in (and the batch, int32 [rows, length + 1], at most)."""
    assert not re.search(r"^step \d", done.stdout, re.M)  # compiled, no step run
    assert done.stderr == ""  # and libtpu said nothing
    assert summary["devices"] == 8 and summary["device_kind"] == "TPU v5 lite"
    # The program's inputs (their shapes, TPU's tile padding aside): the state's pieces the
    # report counts, and this chip's rows of the batch
    computations, shapes, entry = common.hlo_program(text)
    inputs = [name for name, opcode, *_ in computations[entry] if opcode == "parameter"]
    taken = sum(common._shape_bytes(shapes[name]) for name in inputs)
    assert 0 <= taken - summary["state_bytes_per_device"] <= batch + 1024, taken
    assert summary["compiled_argument_bytes"] >= taken  # padded to tiles
    need = summary["compiled_argument_bytes"] + summary["compiled_temp_bytes"]
    assert summary["hbm_need_bytes"] <= need + summary["compiled_argument_bytes"]
    assert summary["hbm_need_bytes"] <= summary["predicted"]["hbm"] == 16 * 2**30
    assert re.search(r"HBM per chip: [\d.e-]+ GiB of 16 GiB, fits", done.stdout)


# -m full only (a compile each): every pytest compiles fsdp.py (a copy's test, below)
@pytest.mark.parametrize("script", matrix(list(NAMED), []))
def test_every_script_compiles_for_a_tpu_slice(script, tmp_path):
    """The report is the TPU program's, nothing run: its state per chip what the program takes
    in, its collectives the docstring's, its matmul FLOPs within XLA's own count."""
    done, summary, text = compile_for(script, tmp_path)
    the_report_is_the_programs(done, summary, text, 32 * 65 * 4)
    kinds = {op for op, c in summary["collectives"].items() if c["count"]}
    assert kinds == NAMED[script], summary["collectives"]
    # XLA counts the matmuls (TPU's convolutions) and the elementwise work (a loop once; under
    # tensor parallelism, replicated work on every chip: 0.62 here): most of it is matmuls
    loops = script in ("pipeline", "context_parallel")
    assert 0.5 < summary["step_flops"] / summary["xla_flops"] <= 1 or loops


# GPT-2's vocabulary and length, 2 rows a chip: the state and the logits both count
STATE_WIDTH = as_flags(
    dict(layers=2, d_model=256, heads=4, seq_len=1024, vocab_size=50304, dtype="bfloat16")
) + ["--batch-size", "16"]


@pytest.fixture(scope="session")
def data_parallel(tmp_path_factory):
    """shardmap_dp.py's summary at STATE_WIDTH, compiled once per process."""
    return compile_for("shardmap_dp", tmp_path_factory.mktemp("dp"), *STATE_WIDTH)[1]


@pytest.fixture(scope="session")
def fsdp_alone(tmp_path_factory):
    """fsdp.py compiled at STATE_WIDTH, 1,024 tokens: (its folder, the process, its summary, the
    TPU program's text)."""
    folder = tmp_path_factory.mktemp("fsdp")
    return folder, *compile_for("fsdp", folder, *STATE_WIDTH)


def kernels(hlo) -> set:
    """The Pallas kernels a TPU program runs: splash attention's parts, megablox's matmuls."""
    found = set(re.findall(r"%splash_\w+?_(fwd|dq|dkv)", hlo))
    return found | set(re.findall(r'custom_call_target="tpu_custom_call".*jit\((t?gmm)\)', hlo))


def test_a_copy_of_a_script_and_common_py_trains_here_and_compiles_for_a_tpu(fsdp_alone):
    """What the README says to do: fsdp.py and common.py alone in a folder train on this CPU and
    compile for v5e-8 at 1,024 tokens, where --attention auto is splash, dense and with --experts
    (megablox's grouped matmul; at a width of 64, which its tiles once refused); the report is the
    program's."""
    folder, done, summary, hlo = fsdp_alone
    assert done.stdout.splitlines()[0].endswith("bfloat16 compute, splash attention")
    assert kernels(hlo) == {"fwd", "dq", "dkv"}
    the_report_is_the_programs(done, summary, hlo, 16 * 1025 * 4)
    experts = as_flags(dict(seq_len=1024, layers=1, d_model=64, batch_size=8, experts=2, top_k=1))
    done, _, hlo = compile_for("fsdp", folder, *experts)
    assert done.stdout.splitlines()[0].endswith("float32 compute, splash attention")
    assert kernels(hlo) == {"fwd", "dq", "dkv", "gmm", "tgmm"}
    done = subprocess.run(
        [sys.executable, "fsdp.py", *TINY], cwd=folder, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "xla attention (auto: splash needs a TPU, cudnn a GPU)" in done.stdout.splitlines()[0]
    assert {p.name for p in folder.iterdir() if p.suffix == ".py"} == {"fsdp.py", "common.py"}


# ZeRO-3 as each script writes it (logical_*: logical_pjit.py's presets, explicit_*:
# explicit_sharding.py's): its flags, the ways its state is split (N), the largest piece a chip
# gathers whole, the head's (float32, 256 x 50,304; split over 'model' under fsdp_tp), and the
# layout it adds FSDP to: data parallelism (None), or tensor parallelism's
HEAD, TP = 256 * 50304 * 4, "--rules tp --mesh data=2,model=4"
SHARDED = {
    "fsdp": ("", 8, HEAD, None),
    "hsdp": ("--mesh replica=2,data=4", 4, HEAD, None),
    "logical_fsdp": ("--rules fsdp --mesh data=8,model=1", 8, HEAD, None),
    "explicit_fsdp": ("--rules fsdp --mesh data=8,model=1", 8, HEAD, None),
    "logical_hsdp": ("--rules hsdp --mesh data=2,model=4", 4, HEAD, None),
    "explicit_hsdp": ("--rules hsdp --mesh data=2,model=4", 4, HEAD, None),
    "logical_fsdp_tp": ("--rules fsdp_tp --mesh data=2,model=4", 8, HEAD / 4, TP),
    "explicit_fsdp_tp": ("--rules fsdp_tp --mesh data=2,model=4", 8, HEAD / 4, TP),
}


@pytest.mark.parametrize("name", matrix(list(SHARDED), ["fsdp", "logical_fsdp"]))
def test_fsdp_needs_less_hbm_than_data_parallelism_by_the_state_it_shards(
    name, data_parallel, fsdp_alone, tmp_path
):
    """ZeRO-3's promise on the chip it is for: HBM per chip at most that of the layout it adds
    FSDP to (data parallelism's; fsdp_tp's, tensor parallelism's, whose chips run 4 x the rows
    of data parallelism's) less the state it no longer holds, plus twice the largest piece's
    gathered parameters. fsdp.py's remat once held the logits' gradient whole beside the logits
    and kept every gathered weight's cast; XLA's collective matmul held the same two in
    logical_pjit.py's presets."""
    flags, shards, gathered, under = SHARDED[name]
    script = {"logical": "logical_pjit", "explicit": "explicit_sharding"}.get(
        name.split("_")[0], "fsdp"
    )
    if name == "fsdp":  # compiled for the copy's test too
        zero3 = fsdp_alone[2]
    else:
        zero3 = compile_for(script, tmp_path, *STATE_WIDTH, *flags.split())[1]
    base = compile_for(script, tmp_path, *STATE_WIDTH, *under.split())[1] if under else None
    base = base or data_parallel
    state, kept = data_parallel["state_bytes_per_device"], zero3["state_bytes_per_device"]
    assert kept <= 1.05 * state / shards + 2**20
    bound = base["hbm_need_bytes"] - (base["state_bytes_per_device"] - kept) + 2 * gathered
    assert zero3["hbm_need_bytes"] <= min(bound, data_parallel["hbm_need_bytes"])
    print(
        f"\nHBM per chip: {name} {zero3['hbm_need_bytes'] / 2**20:,.0f} MiB, data parallel "
        f"{data_parallel['hbm_need_bytes'] / 2**20:,.0f} MiB, bound {bound / 2**20:,.0f} MiB"
    )


DROPLESS = ["expert_parallel", "shardmap_dp", "fsdp", "pipeline", "context_parallel"]
DROPLESS += ["pjit_tp", "logical_pjit", "explicit_sharding"]


# -m full only (45 s a script): every pytest runs the kernel, and expert_parallel.py's ragged
# exchange, against one device in the interpreter (test_equivalence.py)
@pytest.mark.parametrize("script", matrix(DROPLESS, []))
def test_dropless_experts_compile_by_megablox_grouped_matmul(script, tmp_path):
    """XLA's TPU compiler refuses a grouped matmul with a group per sequence: on a TPU dropless
    routing runs megablox's kernel (common.megablox_matmul), forward (gmm) and backward (gmm,
    tgmm); the report counts its matmuls, every slot it is given (an upper bound: it skips the
    slots past its groups, other devices' experts' under expert_parallel.py), its forward again
    backward; pipeline.py's ticks each at their costliest op besides (docs/costs.md: 3.1 dense,
    5.9 here, with a row a micro-batch)."""
    flags = [] if script == "expert_parallel" else as_flags(MOE)
    summary, hlo = compile_for(script, tmp_path, *flags)[1:]
    assert kernels(hlo) == {"gmm", "tgmm"}
    bound = 4 * (2 if script == "pipeline" else 1)
    assert 0.9 <= summary["step_flops_over_model"] <= bound  # uncounted: 0.27
    if script == "expert_parallel":  # each choice to its expert's device alone, and back
        exchanges = re.findall(r"= \S+ ragged-all-to-all\(", hlo)
        assert len(exchanges) == 5 * 2  # a block's tokens, choices, outputs; backward 2
        assert summary["collectives"]["all-gather"]["count"] == 0  # no token gathered


# -m full (tests/test_cost_report.py's XLA:CPU programs in every pytest)
@pytest.mark.parametrize("rules", matrix(["tp", "dp"], []))
def test_explicit_sharding_reduces_the_gradients_once_on_a_tpu(rules, tmp_path):
    """The v5e-8 program with 4 micro-batches all-reduces about what one micro-batch's does (at
    most 1.15 x, not 4 x): its gradients stay unreduced through the loop (summed_once)."""
    flags = ["--rules", rules, "--microbatches"]
    one, four = (
        compile_for("explicit_sharding", tmp_path, *flags, m)[1]["collectives"]["all-reduce"]
        for m in ("1", "4")
    )
    print(f"\n{rules} on {TOPOLOGY}: all-reduce {one}, with 4 micro-batches {four}")
    assert one["bytes"] <= four["bytes"] <= 1.15 * one["bytes"]


@FULL
def test_dropless_holds_little_more_than_the_dense_model(tmp_path):
    """Dropless routing's TPU program against the dense model's, 4 blocks of width 512, 1,024
    tokens: beyond the parameters' gradients (8 experts hold 8 x the MLP's), within 1.5 x its
    temporaries (1.15 x; 1.84 x with the experts' hidden held whole, 2.9 x with besides the gate
    by take_along_axis, tiles of 128 and k copies of each token kept for the backward pass)."""
    flags = ["--layers", "4", "--seq-len", "1024", "--d-model", "512", "--heads", "4"]
    dense = compile_for("shardmap_dp", tmp_path, *flags)[1]
    dropless = compile_for("shardmap_dp", tmp_path, *flags, "--experts", "8")[1]
    held = [s["compiled_temp_bytes"] - 4 * s["param_count"] for s in (dense, dropless)]
    ratio = dropless["compiled_temp_bytes"] / dense["compiled_temp_bytes"]
    print(
        f"\ndropless temporaries / dense: {ratio:.2f}, beyond the gradients {held[1] / held[0]:.2f}"
    )
    assert held[1] <= 1.5 * held[0] and ratio <= 2


# Eight blocks, their head small: what the backward pass keeps of the blocks is the most
DEEP = as_flags(dict(layers=8, d_model=512, heads=8, seq_len=1024, dtype="bfloat16"))
DEEP += ["--batch-size", "16", "--remat"]


@FULL
def test_fsdp_under_remat_keeps_zero3s_promise(tmp_path):
    """Under --remat the model computes each block again in the backward pass: fsdp.py's own
    policy keeping the matmuls' outputs besides once held 9.56 GiB a v5e chip at 1.1B against
    4.97 before it (here 0.29 GiB against a bound of 0.26)."""
    data_parallel = compile_for("shardmap_dp", tmp_path, *DEEP)[1]
    zero3 = compile_for("fsdp", tmp_path, *DEEP)[1]
    block = 12 * 512**2 * 4  # the largest piece gathered, float32
    freed = data_parallel["state_bytes_per_device"] - zero3["state_bytes_per_device"]
    assert zero3["hbm_need_bytes"] <= data_parallel["hbm_need_bytes"] - freed + 2 * block


@pytest.mark.parametrize(
    "script, topology, flags, why",
    [
        ("pmap_dp", "v5p:4x4x4", ["--batch-size", "64"], "pmap lowers for shapes on one host only"),
        ("fsdp", "v4:2x2x1", [], "v4's compile-only devices are TensorCores"),
    ],
)
def test_what_does_not_compile_for_tpu_says_why_in_one_line(script, topology, flags, why):
    """JAX's pmap lowers for shapes within one process only (with several it assembles its
    arguments from every process's arrays); libtpu's compile-only v4 devices are a chip's
    TensorCores, not a v4 run's chips."""
    command = [sys.executable, "tools/compile_for.py", topology, f"{script}.py", *SIZE, *flags]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert why in done.stderr


def test_a_step_too_big_for_the_chip_is_one_line(tmp_path):
    """XLA's TPU compiler refuses a step over HBM: exit 2, one line naming what would fit it."""
    command = [sys.executable, "tools/compile_for.py", TOPOLOGY, "fsdp.py", "--d-model", "1024"]
    command += ["--layers", "1", "--batch-size", "4096", "--seq-len", "1024"]  # 37 GiB of 15.75
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "RESOURCE_EXHAUSTED" in done.stderr and "--remat" in done.stderr


def test_an_unknown_slice_is_one_line(tmp_path):
    command = [sys.executable, "tools/compile_for.py", "v9z:2x4", "fsdp.py"]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "cannot compile for v9z:2x4" in done.stderr


def test_the_predicted_step_is_its_parts_at_the_chips_rates():
    """v5e: 197 TFLOP/s, 819 GB/s of HBM, 400 GB/s of ICI. 1 ms of matmuls, 2 ms of HBM
    traffic and 0.5 ms of collectives: overlapped, 2 ms (the largest); not overlapped, the
    collectives after the larger of the other two, 2.5 ms; the model's 0.5 ms of FLOPs at peak
    in them, MFU 25% and 20%. Collectives of 3 ms outweigh the rest: overlapped, 3 ms."""
    compiled = SimpleNamespace(cost_analysis=lambda: {"bytes accessed": 819e9 * 2e-3})
    tpu = tool.predict(compiled, 197e9, 98.5e9, 0.2e9, "tpu v5 lite")
    assert tpu["seconds"] == pytest.approx({"compute": 1e-3, "hbm": 2e-3, "collectives": 0.5e-3})
    assert tpu["step_seconds"] == pytest.approx({"overlapped": 2e-3, "not_overlapped": 2.5e-3})
    assert tpu["mfu"] == pytest.approx({"overlapped": 0.25, "not_overlapped": 0.2})
    assert tpu["hbm"] == 16 * 2**30
    slow = tool.predict(compiled, 197e9, 98.5e9, 1.2e9, "tpu v5 lite")["step_seconds"]
    assert slow == pytest.approx({"overlapped": 3e-3, "not_overlapped": 5e-3})


# What the chips' makers publish, as their pages give it (read 2026-11-27): Google's
# cloud.google.com/tpu/docs/v5e, v5p, v6e and v4 — peak bf16 TFLOP/s per chip, HBM per chip
# (GiB: v5e's "16 GB" is 16 GiB, as XLA's TPU compiler allows 15.75 GiB of it), HBM GB/s,
# bidirectional ICI GB/s per chip (v4's page gives none), chips per host. (The tool compiles
# for no v4: libtpu's compile-only v4 devices are TensorCores, two a chip.)
PUBLISHED = {
    "TPU v5 lite": (197, 16, 819, 400, 8),
    "TPU v5": (459, 95, 2765, 1200, 4),
    "TPU v6 lite": (918, 32, 1638, 800, 8),
    "TPU v4": (275, 32, 1200, None, 4),
}
# NVIDIA's data sheets: dense bf16 tensor TFLOP/s (half the "with sparsity" figure), by the
# device_kind JAX reports
GPUS = {
    "NVIDIA H100 80GB HBM3": 989,
    "NVIDIA H100 PCIe": 756,
    "NVIDIA H200": 989,
    "NVIDIA A100-SXM4-80GB": 312,
}
# Each chip kind the tool compiles for, on a slice of two hosts
SLICES = {"TPU v5 lite": "v5e:4x4", "TPU v5": "v5p:2x2x2", "TPU v6 lite": "v6e:4x4"}


def peak(device_kind):
    """hlo.PEAK_FLOPS' figure for a device, as tools/compile_for.py looks it up (first match)."""
    return next((p for name, p in hlo.PEAK_FLOPS if name in device_kind.lower()), None)


def test_the_chips_figures_are_their_makers():
    """tools/compile_for.py's CHIPS and hlo.PEAK_FLOPS against the published figures, each
    chip looked up by the device_kind JAX gives it (the first match wins: 'tpu v5' is in
    'tpu v5 lite' too)."""
    assert set(tool.CHIPS) == {kind.lower() for kind in SLICES}
    for kind, (tflops, hbm, hbm_rate, ici_rate, _) in PUBLISHED.items():
        assert peak(kind) == tflops * 1e12, kind
        if kind in SLICES:
            assert tool.CHIPS[kind.lower()] == (hbm * 2**30, hbm_rate * 1e9, ici_rate * 1e9), kind
    for kind, tflops in GPUS.items():
        assert peak(kind) == pytest.approx(tflops * 1e12, rel=1e-3), kind
    assert peak("cpu") is None


@pytest.mark.full
@pytest.mark.parametrize("kind", list(SLICES))
def test_every_chip_the_tool_knows_compiles(kind, tmp_path):
    """Each chip kind of CHIPS, once: the compile-only slice is that chip, as many a host as
    its maker says, and the prediction uses its figures."""
    tflops, hbm, *_, per_host = PUBLISHED[kind]
    _, summary, _ = compile_for("fsdp", tmp_path, topology=SLICES[kind])
    assert summary["device_kind"] == kind
    assert summary["processes"] == 2 and summary["devices"] == 2 * per_host
    assert summary["predicted"]["hbm"] == hbm * 2**30
    compute = summary["predicted"]["seconds"]["compute"]
    assert compute == pytest.approx(summary["step_flops"] / (tflops * 1e12))


# 2,048 tokens, 2 rows a chip: XLA's attention holds each layer's scores [rows, heads, 2,048,
# 2,048]; the splash kernel computes them block by block. -m full only (two compiles at 2,048
# tokens, 72 s): every pytest runs the kernel itself against one device (test_equivalence.py)
LONG = as_flags(dict(layers=2, d_model=256, heads=4, seq_len=2048, dtype="bfloat16")) + [
    "--batch-size",
    "16",
]


@pytest.mark.parametrize("script", matrix(["shardmap_dp", "fsdp", "logical_pjit"], []))
def test_splash_attention_is_the_kernel_and_holds_no_scores(script, tmp_path):
    """--attention auto on a TPU is splash: Pallas's kernel in the program (its forward and both
    halves of its backward), under a seventh of XLA's attention's temporaries at 2,048 tokens
    (fsdp.py 437 MB against 12.8; the scores never whole), and its matmuls in the report's FLOPs."""
    xla = compile_for(script, tmp_path, *LONG, "--attention", "xla")[1]
    _, splash, hlo = compile_for(script, tmp_path, *LONG)
    assert set(re.findall(r"%splash_\w+?_(fwd|dq|dkv)", hlo)) == {"fwd", "dq", "dkv"}
    print(
        f"\n{script}: temporaries {xla['compiled_temp_bytes'] / 1e6:,.2f} MB with XLA's "
        f"attention, {splash['compiled_temp_bytes'] / 1e6:,.2f} MB with splash"
    )
    assert splash["compiled_temp_bytes"] < xla["compiled_temp_bytes"] / 7
    assert splash["step_flops"] > xla["step_flops"]  # the kernel's, and its backward's recompute


def test_the_tools_read_programs_whose_answers_are_known():
    """tests/tpu_programs.py's two TPU programs. One holds a chip's 32 MiB piece and 1 MiB whole
    in, the same out, and the 256 MiB of the 8 pieces gathered between: 322 MiB of HBM, 290 with
    the piece donated (XLA's small buffers aside: 253 and 284 KiB). The other a loop of 3 trips
    each holding an all-reduce, reduce-scatter, all-to-all and ring permute of 4 MiB, then an
    all-gather into 32 MiB, the permute and the gather asynchronous: hlo.py gives each its bytes
    and runs (it once counted a permute's 8 bytes of context), and the predicted time is their
    wire bytes at v5e's 400 GB/s."""
    command = [sys.executable, str(ROOT / "tests/tpu_programs.py")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout)
    MiB = 2**20
    need = found["hbm_need"]
    assert 0 <= need["kept"] - 322 * MiB < MiB and 0 <= need["donated"] - 290 * MiB < MiB, need
    assert found["asynchronous"] == ["collective-permute-start", "async-collective-start"]
    expected = {
        "all-reduce": (3, 4 * MiB),
        "reduce-scatter": (3, 4 * MiB),
        "all-to-all": (3, 4 * MiB),
        "collective-permute": (3, 4 * MiB),
        "all-gather": (1, 32 * MiB),
    }
    read = {c["op"]: (c["runs"], c["bytes"]) for c in found["collectives"]}
    assert read == expected and {c["group"] for c in found["collectives"]} == {8}
    # A run's own count (common.collectives, by kind): the same reading, loops' trips included
    assert found["printed"] == {
        op: {"count": expected.get(op, (0, 0))[0], "bytes": math.prod(expected.get(op, (0, 0)))}
        for op in common.COLLECTIVES
    }
    ring = 3 * 4 * MiB * (2 * 7 / 8 + 7 / 8 + 7 / 8 + 1) + 32 * MiB * 7 / 8  # hlo.wire's shares
    assert found["collective_seconds"] == pytest.approx(ring / 400e9)
