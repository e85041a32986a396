"""Starting from weights you have (--init-from): any script's checkpoint folder, or the
.safetensors file tools/export.py writes of it (or of GPT-2's published weights), laid out as the
run lays out its state; a fresh optimizer at step 0; every script then trains as one device does
from the same parameters. Bad input in one line."""

import functools
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax.traverse_util import unflatten_dict
import pytest
import safetensors
import safetensors.numpy
from orbax.checkpoint import v1 as ocp

import common
from test_equivalence import compare, reference
import shardmap_dp
from tests.harness import SMALL, STRATEGIES, matrix, model_flags, record_flags, run, run_script
from tests.harness import run_uncached
from tools import export

DENSE = [name for name in STRATEGIES if not model_flags(name)]  # the checkpoint's model
GPT2 = Path(__file__).parent / "gpt2"  # dev/gpt2.py's: a tiny GPT-2 by Hugging Face, its logits
GPT2_FLAGS = {"tie_embeddings": True}  # as SMALL's: 2 layers, width 64, 4 heads, 32 positions


@functools.cache
def gpt2() -> str:
    """tests/gpt2's weights in the model's paths, by tools/export.py --names gpt2."""
    out = os.path.join(tempfile.mkdtemp(), "gpt2.safetensors")
    names = ["--names", "gpt2", "--heads", "4", "--vocab-size", "256", "--seq-len", "32"]
    assert export.main([*names, str(GPT2 / "model.safetensors"), out]) == 0
    return out


@functools.cache
def first() -> tuple:
    """A shardmap_dp.py run's checkpoint after 10 steps (its folder) and tools/export.py's file."""
    folder = Path(tempfile.mkdtemp())
    run_uncached("shardmap_dp", steps=10, checkpoint_dir=str(folder / "run"))
    export.export(str(folder / "run"), str(folder / "run.safetensors"))
    return str(folder / "run"), str(folder / "run.safetensors")


@pytest.mark.parametrize("name", matrix(DENSE, ["fsdp"]))
def test_every_script_trains_from_another_scripts_checkpoint_as_one_device_does(name):
    folder, file = first()
    result = run(name, init_from=folder)
    compare(name, result, reference(init_from=file), {"init_from": "shardmap_dp's checkpoint"})
    assert result.summary["resumed_from"] is None and len(result.losses) == 20  # step 0


@pytest.mark.filterwarnings("ignore:Sharding info not provided")  # read back as saved
def test_the_exported_file_holds_the_checkpoints_parameters():
    """tools/export.py's file: the checkpoint's parameters bit for bit (read back as saved, no
    layout asked), each named by its path in the model, with the flags the checkpoint records."""
    folder, file = first()
    with ocp.training.Checkpointer(os.path.abspath(folder)) as saved:
        params = saved.load(saved.latest.step)["params"]
    name = lambda path: jax.tree_util.keystr(path, simple=True, separator="/")  # noqa: E731
    named = {name(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
    tensors = safetensors.numpy.load_file(file)
    assert named.keys() == tensors.keys() and "block_1/attn/qkv/kernel" in named
    assert all(np.array_equal(named[k], tensors[k]) for k in named)
    with safetensors.safe_open(file, "numpy") as f:
        flags = json.loads(f.metadata()["flags"])
    assert flags == common.recorded_flags(folder) and (flags["d_model"], flags["steps"]) == (64, 10)


def test_init_from_refuses_in_one_line_what_does_not_fit(tmp_path, capsys):
    """A path that does not exist; a file whose recorded flags differ (the flag named); without
    recorded flags, a tensor missing or of another shape (the tensor named): exit 2 in one line,
    nothing trained."""
    _, file = first()
    tensors = safetensors.numpy.load_file(file)
    part = {k: v for k, v in tensors.items() if k != "block_1/mlp/fc1/kernel"}
    wide = {**tensors, "head/out/kernel": np.zeros((64, 128), np.float32)}
    for name, held in (("part", part), ("wide", wide)):
        safetensors.numpy.save_file(held, tmp_path / f"{name}.safetensors")
    for flags, said in [
        ({"init_from": str(tmp_path / "nowhere")}, "nowhere does not exist"),
        ({"init_from": file, "d_model": 32}, f"--d-model 32 differs from 64 in --init-from {file}"),
        ({"init_from": str(tmp_path / "part.safetensors")}, "not contain tensor block_1/mlp/fc1/"),
        ({"init_from": str(tmp_path / "wide.safetensors")}, "(64, 128), the flags make (64, 256)"),
    ]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            run_uncached("shardmap_dp", steps=2, **flags)
        out, err = capsys.readouterr()
        assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
        assert said in err and "step 1/2" not in out, err


def test_a_run_that_finds_its_own_checkpoint_resumes_it_and_says_so(tmp_path, capsys):
    """--init-from beside a --checkpoint-dir holding a checkpoint: the run resumes its own,
    bit for bit as if never stopped, and says it left --init-from alone."""
    _, file = first()
    flags = dict(steps=4, checkpoint_dir=str(tmp_path), checkpoint_every=2)
    whole = run_uncached("shardmap_dp", **flags)
    shutil.rmtree(tmp_path / "4")  # as if stopped after step 2
    capsys.readouterr()
    resumed = run_uncached("shardmap_dp", **flags, init_from=file)
    record_flags(shardmap_dp, resumed.config)
    said = f"resumed from the checkpoint of step 2 in {tmp_path}, not --init-from {file}"
    assert said in capsys.readouterr().out and resumed.losses == whole.losses[2:]


def test_a_copy_starts_from_a_file(tmp_path):
    """fsdp.py and common.py alone in a folder: the file read, each device its shards."""
    _, file = first()
    small = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32", "--steps", "2"]
    done = run_script("fsdp", tmp_path, *small, "--init-from", file)
    assert done.returncode == 0 and f"started from the parameters in {file}" in done.stdout


def test_gpt2s_weights_give_hugging_faces_logits_and_go_back(tmp_path, capsys):
    """The built-in GPT from a GPT-2 that Hugging Face made, its vocabulary of 256 padded to 320,
    gives its logits within 1e-5 of the largest, and every padded row -1e4 for every input: the
    probabilities are Hugging Face's. Exported back, each tensor is GPT-2's (the key bias gone,
    the value bias moved into the out layer's). Measured: 8.2e-7, the log-probabilities 5.3e-7,
    the padded logits -1e4 to 0.017; `dev/gpt2.py --check` gives 5.4e-7 from the file sent back."""
    padded = str(tmp_path / "padded.safetensors")
    names = ["--names", "gpt2", "--heads", "4", "--vocab-size", "320", "--seq-len", "32"]
    assert export.main([*names, str(GPT2 / "model.safetensors"), padded]) == 0
    tensors = safetensors.numpy.load_file(padded)
    params = unflatten_dict({tuple(k.split("/")): v for k, v in tensors.items()})
    model = common.make_model(common.Config(**{**SMALL, **GPT2_FLAGS, "vocab_size": 320}))
    hf = np.load(GPT2 / "logits.npz")
    logits = np.asarray(jax.jit(model)(params, hf["tokens"])[0])
    largest = np.abs(hf["logits"]).max()
    assert np.abs(logits[..., :256] - hf["logits"]).max() <= 1e-5 * largest
    assert np.allclose(logits[..., 256:], export.PAD_LOGIT, rtol=1e-5)  # to 0.1
    log_p, theirs = (jax.nn.log_softmax(x)[..., :256] for x in (logits, hf["logits"]))
    assert np.abs(log_p - theirs).max() <= 1e-5 * np.abs(theirs).max()
    back = tmp_path / "model.safetensors"
    assert export.main(["--names", "gpt2", padded, str(back)]) == 0
    original = safetensors.numpy.load_file(GPT2 / "model.safetensors")
    original = {k.removeprefix("transformer."): v for k, v in original.items()}
    mine = safetensors.numpy.load_file(back)
    assert mine.keys() == original.keys() and mine["wte.weight"].shape == (320, 64)
    for name, theirs in original.items():
        ours = mine[name][: len(theirs)]  # less the padded rows
        if name.endswith("attn.c_attn.bias"):
            q, k, v = np.split(theirs, 3)
            assert np.array_equal(ours, np.concatenate([q, 0 * k, 0 * v])), name
            out = name.replace("c_attn.bias", "c_proj")
            moved = original[f"{out}.bias"] + v @ original[f"{out}.weight"]
            assert np.allclose(mine[f"{out}.bias"], moved, rtol=1e-6, atol=1e-6), name
        elif not name.endswith("attn.c_proj.bias"):
            assert np.array_equal(ours, theirs), name
    _, untied = first()
    capsys.readouterr()
    assert export.main(["--names", "gpt2", untied, str(tmp_path / "no")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "GPT-2 ties its head to the token table" in err, err


@pytest.mark.parametrize("name", matrix(DENSE, []))
def test_every_script_fine_tunes_gpt2_as_one_device_does(name):
    result = run(name, init_from=gpt2(), **GPT2_FLAGS)
    flags = {"init_from": "GPT-2's", **GPT2_FLAGS}
    compare(name, result, reference(init_from=gpt2(), **GPT2_FLAGS), flags)
