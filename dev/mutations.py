"""Put plausible bugs into the scripts and common.py, one at a time, and check that the tests
catch each.

A catalogue of bugs that a careful person could write (a sum where a mean belongs, a collective
left out or added, a ring turned the wrong way, a shared dropout key, a preset that splits
nothing, a schedule that ends early, ...), each one a single edit of the lines that matter in a
strategy's code or the lesson's. For each bug the tool copies the project
into a temporary folder, makes the edit there, and runs the tests of `pytest` (not `-m full`)
that should catch it, stopping at the first failure. A bug is caught when a test fails; the
table says which test and how long it took. A bug the tests let through is a hole in the
proof: the tool exits 1.

The tests each bug runs are a part of the suite chosen to catch it quickly; every one of them
is also in a plain `pytest`, so the whole suite catches it too. Before the bugs, the same tests
run on the unchanged code and must pass (skip with --no-clean), so that a failure means the bug.

  python dev/mutations.py                 # every bug; about 15 minutes on 2 cores
  python dev/mutations.py --only 3 7      # some of them
  python dev/mutations.py --write         # and rewrite the table in dev/mutations.md
  python dev/mutations.py --only 30 --write   # rewrite that bug's row, keep the others

The generated part (--generated) needs no catalogue: every comparison (< and <=, > and >=, ==
and !=), + 1 or - 1 and integer axis= of the lesson (common.py from the model to the data, the
scripts' functions but main) flipped one at a time, each against the tests that reach its lines,
the fastest first: a map that one run of the plain `pytest` under coverage makes (pytest-cov,
each test its own context; pip install pytest-cov). Survivors are listed in dev/mutations.md, each
argued equivalent in EQUIVALENT or killed by a new test.

  python dev/mutations.py --generated --map /tmp/reach.json           # map (an hour), then all
  python dev/mutations.py --generated --map /tmp/reach.json --only 5  # one, by number
  python dev/mutations.py --generated --map /tmp/reach.json --fastest-only  # 2.6 hours
"""

import argparse
import ast
import dataclasses
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "dev" / "mutations.md"
MARKER = re.compile(r"<!-- mutations:start -->\n.*?<!-- mutations:end -->", re.DOTALL)
EQ = "test_equivalence.py"
TPU = "tests/test_tpu.py"
DROPOUT = "tests/test_dropout.py::test_dropout_is_on_and_every_mask_is_drawn_once"
LESSON = "tests/test_lesson.py"
EXPERTS = "tests/test_experts.py"
MEANT = f"{EQ}::test_every_preset_is_what_its_strategy_means"
DATA = "tests/test_data.py"
MESHES = "tests/test_meshes.py::test_every_auto_mesh_is_what_its_script_says"


@dataclasses.dataclass(frozen=True)
class Bug:
    file: str  # the file the bug goes into
    old: str  # the text it replaces: it must occur exactly once in the file
    new: str
    what: str  # the bug, for the table
    tests: tuple  # pytest node ids (or files) that should catch it


BUGS = [
    Bug(
        "shardmap_dp.py",
        'grads = lax.pmean(grads, "data")',
        'grads = lax.psum(grads, "data")',
        "data parallelism sums the devices' gradients instead of averaging them (a wrong mean)",
        (f"{EQ}::test_matches_single_device_reference[shardmap_dp]",),
    ),
    Bug(
        "pmap_dp.py",
        'metrics = lax.psum(metrics, "data")',
        "metrics = metrics",
        "pmap's metrics are not summed over the devices: the loss logged is one device's (a "
        "missing psum)",
        (f"{EQ}::test_matches_single_device_reference[pmap_dp]",),
    ),
    Bug(
        "fsdp.py",
        'mean = grad.get_value() / lax.axis_size("data")',
        "mean = grad.get_value()",
        "FSDP keeps the reduce-scattered sum of a shard's gradient, not its mean",
        (f"{EQ}::test_matches_single_device_reference[fsdp]",),
    ),
    Bug(
        "fsdp.py",
        'mean = lax.pmean(mean, "replica")',
        "mean = mean",
        "HSDP: the shards' gradients are not all-reduced across the replica groups (a missing "
        "psum)",
        (f"{EQ}::test_matches_single_device_reference[hsdp]",),
    ),
    Bug(
        "common.py",
        "return jnp.sqrt(jax.lax.psum(pieces, axis) + whole)",
        "return jnp.sqrt(pieces + whole)",
        "FSDP clips by the norm of the device's own shards: a local norm",
        (f"{EQ}::test_clipping_matches[fsdp]", f"{EQ}::test_matches_single_device_reference[fsdp]"),
    ),
    Bug(
        "expert_parallel.py",
        'return lax.psum(grad, "data") / lax.axis_size(("data", "expert"))',
        'return lax.psum(grad, "data") / lax.axis_size("data")',
        "an expert's gradient, already summed over 'expert' by the all-to-all, is divided as if "
        "it were not (4 times too large)",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "expert_parallel.py",
        "split = jax.tree.map(is_split, specs, is_leaf=is_spec)",
        "split = jax.tree.map(lambda spec: False, specs, is_leaf=is_spec)",
        "expert parallelism clips by a norm that counts only the device's own experts",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "context_parallel.py",
        "ring = [(d, (d + 1) % devices) for d in range(devices)]",
        "ring = [(d, (d - 1) % devices) for d in range(devices)]",
        "ring attention sends keys and values the wrong way round the ring (wrong ppermute "
        "direction)",
        (f"{EQ}::test_matches_single_device_reference[context_parallel]",),
    ),
    Bug(
        "context_parallel.py",
        "running = lax.cond(k_piece <= q_piece, update, lambda running: running, running)",
        "running = update(running)",
        "ring attention's mask is not causal across hops: a query sees the pieces after its own",
        (f"{EQ}::test_matches_single_device_reference[context_parallel]",),
    ),
    Bug(
        "context_parallel.py",
        'jax.random.fold_in(state.rng, state.step), lax.axis_index(("data", "context"))',
        "jax.random.fold_in(state.rng, state.step), 0",
        "context parallelism's dropout keys are shared: every device draws the same masks",
        (f"{DROPOUT}[context_parallel]",),
    ),
    Bug(
        "context_parallel.py",
        'return lax.all_gather(x, "context", axis=1, tiled=True)',
        "return x",
        "a mixture of experts routes each device's pieces of a sequence, not the whole sequence",
        (f"{EQ}::test_a_mixture_of_experts_matches[context_parallel]",),
    ),
    Bug(
        "pipeline.py",
        'arrived = [lax.ppermute(sent, "stage", up), lax.ppermute(sent, "stage", down), sent]',
        'arrived = [lax.ppermute(sent, "stage", down), lax.ppermute(sent, "stage", up), sent]',
        "the pipeline keeps what the stage above sent as what came from below (the two "
        "collective-permutes swapped)",
        (f"{EQ}::test_matches_single_device_reference[pipeline_1f1b]",),
    ),
    Bug(
        "pipeline.py",
        "grads = jax.tree.map(jnp.add, grads, grad_params)",
        "grads = jax.tree.map(lambda g, d: g + jnp.where(m == 0, 0, d), grads, grad_params)",
        "the pipeline drops the first micro-batch's gradient",
        (f"{EQ}::test_matches_single_device_reference[pipeline_1f1b]",),
    ),
    Bug(
        "pipeline.py",
        'return lax.psum_scatter(g, "stage", scatter_dimension=spec.index("stage"), tiled=True)',
        'axis, size = spec.index("stage"), g.shape[spec.index("stage")] // lax.axis_size("stage")\n'
        '        return lax.dynamic_slice_in_dim(g, lax.axis_index("stage") * size, size, axis)',
        "the embedding's and head's gradients are not reduce-scattered over 'stage': each device "
        "keeps its slice of its own stage's gradient",
        (f"{EQ}::test_matches_single_device_reference[pipeline_1f1b]",),
    ),
    Bug(
        "common.py",
        "add_piece, piece_grads(pieces[0], 0), (pieces[1:], jnp.arange(1, microbatches))",
        "add_piece,\n        jax.tree.map(jnp.zeros_like, piece_grads(pieces[0], 0)),\n        "
        "(pieces[1:], jnp.arange(1, microbatches)),",
        "gradient accumulation drops the first micro-batch's gradient",
        (f"{EQ}::test_microbatches_match[shardmap_dp]",),
    ),
    Bug(
        "logical_pjit.py",
        "create = jax.jit(create, out_shardings=state_shardings(boxed, mesh, RULES[config.rules]))",
        "shardings = state_shardings(boxed, mesh, RULES[config.rules])\n    replicated = "
        "jax.tree.map(lambda _: NamedSharding(mesh, P()), shardings.opt_state)\n    create = "
        "jax.jit(create, out_shardings=shardings.replace(opt_state=replicated))",
        "logical_pjit.py keeps Adam's moments whole on every device (moments unsharded)",
        (f"{EQ}::test_matches_single_device_reference[logical_fsdp_tp]",),
    ),
    Bug(
        "pjit_tp.py",
        "lambda path, x: NamedSharding(mesh, state_spec(path, x, specs)), abstract_state\n    )",
        "lambda path, x: NamedSharding(mesh, state_spec(path, x, specs)), abstract_state\n    "
        ").replace(opt_state=jax.tree.map(lambda x: NamedSharding(mesh, P()), "
        "abstract_state.opt_state))",
        "pjit_tp.py keeps Adam's moments whole on every device (moments unsharded)",
        (f"{EQ}::test_matches_single_device_reference[pjit_tp]",),
    ),
    Bug(
        "pjit_tp.py",
        '(r"mlp/(shared/)?fc2/kernel", P("model", None)),',
        '(r"mlp/(shared/)?fc2/kernel", P(None, "model")),',
        "tensor parallelism splits fc2 by output columns instead of input rows (not Megatron's "
        "layout: the compiler gathers instead)",
        (f"{EQ}::test_tensor_parallelism_is_megatron[pjit_tp]",),
    ),
    Bug(
        "shardmap_dp.py",
        'jax.random.fold_in(state.rng, state.step), lax.axis_index("data")',
        "jax.random.fold_in(state.rng, state.step), 0",
        "data parallelism's dropout keys are shared: every device draws the same masks",
        (f"{DROPOUT}[shardmap_dp]",),
    ),
    Bug(
        "common.py",
        "zeros_init(), names[-1:]),\n        dtype=config.dtype,",
        "zeros_init(), names[-1:]),\n        dtype=jnp.float32,",
        "--dtype bfloat16 is ignored by the dense layers: everything computes in float32",
        (
            f"{LESSON}::test_bfloat16_runs_every_matmul_in_bfloat16",
            f"{EQ}::test_bfloat16_matches[shardmap_dp]",
        ),
    ),
    Bug(
        "pipeline.py",
        "loss_scale = 1.0 / (pieces.shape[0] * pieces.shape[1] * config.seq_len)",
        "loss_scale = 1.0 / (pieces.shape[1] * config.seq_len)",
        "the pipeline's gradient is the sum over micro-batches, not the mean",
        (f"{EQ}::test_matches_single_device_reference[pipeline_1f1b]",),
    ),
    Bug(
        "pipeline.py",
        "checkpoints = common.Checkpoints(config, *saved)",
        "checkpoints = common.Checkpoints(config)",
        "the pipeline saves and restores its own stacked layout, not the checkpoints' one: "
        "another script's checkpoint is read into the wrong layout",
        ("tests/test_checkpoints.py::test_another_script_resumes",),
    ),
    Bug(
        "expert_parallel.py",
        'return lax.psum(grad, "data") / lax.axis_size(("data", "expert"))',
        'return lax.psum(lax.psum(grad, "expert"), "data") / lax.axis_size(("data", "expert"))',
        "an extra psum: each expert's gradient summed with the other experts' of its group",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "pipeline.py",
        'jax.random.fold_in(state.rng, state.step), lax.axis_index("data")',
        "jax.random.fold_in(state.rng, state.step), 0",
        "the pipeline's dropout keys are shared by the data shards: their devices draw the same "
        "masks",
        (f"{DROPOUT}[pipeline_1f1b]",),
    ),
    Bug(
        "common.py",
        "return range(process * rows, (process + 1) * rows)",
        "return range(0, rows)",
        "with several processes, every process builds the same rows of the batch",
        (f"{EQ}::test_two_processes_match_one[shardmap_dp]",),
    ),
    Bug(
        "expert_parallel.py",
        'return lax.psum_scatter(out, "expert", tiled=True)',
        'return out.reshape(lax.axis_size("expert"), -1, *out.shape[1:])[lax.axis_index("expert")]',
        "dropless expert parallelism keeps its own experts' outputs for its tokens: the other "
        "devices' experts never reach them (a missing reduce-scatter)",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "expert_parallel.py",
        'out = mixture(x, expert, gate, lax.axis_index("expert"), lax.axis_size("expert"))',
        'out = mixture(x, expert, gate, 0, lax.axis_size("expert"))',
        "dropless expert parallelism numbers every device's experts as the first device's",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "expert_parallel.py",
        "global_norm(common.learned(grads), ",
        "global_norm(grads, ",
        "the balance bias's entry (its experts' load) counted in the gradient's norm, for clipping",
        (f"{EQ}::test_matches_single_device_reference[expert_parallel]",),
    ),
    Bug(
        "common.py",
        "lambda load, _: -rate * jnp.sign(load)",
        "lambda load, _: rate * jnp.sign(load)",
        "the balance bias moves towards the loaded experts (the sign of DeepSeek's rule turned)",
        ("tests/test_experts.py::test_the_bias_moves_against_each_experts_excess_load",),
    ),
    Bug(
        "context_parallel.py",
        "back = np.argsort(order)",
        "back = order",
        "Ulysses puts the gathered sequence in the wrong order: the permutation where its "
        "inverse belongs",
        (f"{EQ}::test_matches_single_device_reference[context_ulysses]",),
    ),
    Bug(
        "context_parallel.py",
        "key_positions = jnp.asarray(balanced_order(k.shape[1], devices))",
        "key_positions = jnp.arange(k.shape[1])",
        "all-gather attention masks by the keys' places in the gathered array, not by their "
        "positions in the sequence",
        (f"{EQ}::test_matches_single_device_reference[context_all_gather]",),
    ),
    Bug(
        "pjit_tp.py",
        """    ("length", "model"),
)""",
        ")",
        "--sequence-parallel's rules leave the sequence whole: tensor parallelism alone, "
        "nothing split between the matmuls (no number changes)",
        (f"{EQ}::test_sequence_parallelism_splits_the_residual_stream[pjit_tp_sp]",),
    ),
    Bug(
        "explicit_sharding.py",
        'split = None if piece.name == "head" else sequence',
        "split = None",
        "--rules tp_sp in the types gathers every piece's input whole: no sequence split "
        "(no number changes)",
        (f"{EQ}::test_sequence_parallelism_splits_the_residual_stream[explicit_tp_sp]",),
    ),
    Bug(
        "pipeline.py",
        "            p = with_kernels(p, calls, kernels)\n",
        "",
        "zero-bubble's B makes the dense kernels' gradients as well as W: each counted twice",
        (f"{EQ}::test_matches_single_device_reference[pipeline_zero-bubble]",),
    ),
    # What equivalence cannot see, by construction. A bug in the lesson (common.py) is on both
    # sides of every comparison with one device:
    Bug(
        "common.py",
        'lambda path, _: _leaf_name(path) in ("kernel", "embedding"), params',
        'lambda path, _: _leaf_name(path) != "bias", params',
        "AdamW decays the norms' scales too: the decay mask is 'everything but biases'",
        (f"{LESSON}::test_adamw_decays_the_kernels_and_embeddings_only",),
    ),
    Bug(
        "common.py",
        "decay_steps=max(config.steps, config.warmup_steps + 1),",
        "decay_steps=max(config.steps - config.warmup_steps, 1),",
        "the cosine reaches its floor --warmup-steps early: optax's decay_steps counts the "
        "warm-up, and it was taken out twice",
        (f"{LESSON}::test_the_learning_rate_warms_up_then_falls_along_a_cosine_to_a_tenth",),
    ),
    Bug(
        "common.py",
        "lambda g: jnp.where(norm < max_norm, g, (g / norm * max_norm).astype(g.dtype)), grads",
        "lambda g: (g / norm * max_norm).astype(g.dtype), grads",
        "clipping normalises every gradient to the bound: small gradients are scaled up",
        (f"{LESSON}::test_clipping_scales_down_to_the_bound_and_never_up",),
    ),
    Bug(
        "common.py",
        "queue = choices.swapaxes(1, 2).reshape(rows, k * length, experts)  # first choices "
        "first\n    places = (jnp.cumsum(queue, axis=1) - 1).reshape(rows, k, length, experts)"
        ".swapaxes(1, 2)",
        "queue = choices.reshape(rows, length * k, experts)\n"
        "    places = (jnp.cumsum(queue, axis=1) - 1).reshape(rows, length, k, experts)",
        "a full expert queues the choices token by token, not every first choice before any "
        "second: a token's second choice can take the room of a later token's first",
        (f"{EXPERTS}::test_capacity_routing_is_gshards_order",),
    ),
    Bug(
        "common.py",
        "c.experts, use_bias=False, dtype=jnp.float32, kernel_init=init, rngs=rngs",
        "c.experts, use_bias=False, dtype=c.dtype, kernel_init=init, rngs=rngs",
        "under --dtype bfloat16 the router computes its logits in bfloat16: which experts a "
        "token goes to hangs on rounding",
        (f"{EXPERTS}::test_the_router_computes_in_float32_under_bfloat16",),
    ),
    Bug(
        "common.py",
        "if c.remat:  # keep only each block's input",
        "if c.remat and not c.scan_layers:  # keep only each block's input",
        "--remat is dropped under --scan-layers: the same numbers, every block's activations kept",
        (f"{LESSON}::test_remat_lowers_the_temporaries_with_or_without_scanned_layers",),
    ),
    # A preset that states the wrong layout agrees with itself: held to what its strategy means.
    Bug(
        "explicit_sharding.py",
        '"fsdp": (("batch", ("data", "model")), ("embed", ("data", "model"))),',
        '"fsdp": (("batch", ("data", "model")),),',
        "explicit_sharding.py's fsdp preset splits no weight: data parallelism under FSDP's "
        "name (no number changes)",
        (f"{MEANT}[explicit_fsdp]",),
    ),
    Bug(
        "explicit_sharding.py",
        '"hsdp": (("batch", ("data", "model")), ("embed", "model")),',
        '"hsdp": (("batch", ("data", "model")), ("embed", "data")),',
        "explicit_sharding.py's hsdp shards over the 2 replicas instead of within the groups "
        "of 4: half the state per device, not a quarter (no number changes)",
        (f"{MEANT}[explicit_hsdp]",),
    ),
    Bug(
        "explicit_sharding.py",
        '"fsdp_tp": (*TP, ("embed", "data")),',
        '"fsdp_tp": TP,',
        "explicit_sharding.py's default, fsdp_tp, leaves out FSDP's split over 'data': tensor "
        "parallelism alone (no number changes)",
        (f"{MEANT}[explicit_fsdp_tp]",),
    ),
    # The held-out loss: on the wrong split, or on part of the batches
    Bug(
        "common.py",
        'return [host_batch(dataset, config, i, "eval") for i in range(count)]',
        "return [host_batch(dataset, config, i) for i in range(count)]",
        "the runs evaluate on training batches, not held-out ones",
        (f"{EQ}::test_matches_single_device_reference[shardmap_dp]",),
    ),
    Bug(
        "common.py",
        'SPLITS = {"train": 0, "eval": 1}',
        'SPLITS = {"train": 0, "eval": 0}',
        "the synthetic source's held-out split draws the training split's sequences",
        (f"{LESSON}::test_the_held_out_batches_are_the_held_out_splits_and_never_trained_on",),
    ),
    Bug(
        "pmap_dp.py",
        'return lax.psum(common.eval_metrics(state, batch), "data")',
        "return common.eval_metrics(state, batch)",
        "pmap's held-out loss is one device's rows, not the batch's (a missing psum)",
        (f"{EQ}::test_matches_single_device_reference[pmap_dp]",),
    ),
    # Kinds no test looked at (issue 64's rules). A flag no compared run set:
    Bug(
        "fsdp.py",
        "return lax.pmean(grad, every_device())",
        "return lax.psum(grad, every_device())",
        "FSDP sums the gradient of a parameter it leaves whole (--min-shard-size) over the "
        "devices instead of averaging it",
        (f"{EQ}::test_parameters_below_min_shard_size_stay_whole_and_match[fsdp]",),
    ),
    Bug(
        "pipeline.py",
        'return lax.psum(g, "stage")',
        "return g",
        "a parameter no stage count divides keeps its own stage's gradient: the last stage's "
        "for the final norm, zero on the others",
        (f"{EQ}::test_a_parameter_no_stage_count_divides_stays_whole_and_matches",),
    ),
    # Where the run starts, and its randomness
    Bug(
        "common.py",
        "return 1 / math.sqrt(2 * config.layers)",
        "return 1 / math.sqrt(config.layers)",
        "the projections into the residual stream start at 1/sqrt(layers), not GPT-2's "
        "1/sqrt(2 x layers), of 0.02",
        (f"{LESSON}::test_the_run_starts_where_gpt2_says",),
    ),
    Bug(
        "common.py",
        "key = jax.random.fold_in(rng, i)",
        "key = rng",
        "every micro-batch of a step draws the same dropout masks",
        (f"{DROPOUT}[shardmap_dp]",),
    ),
    Bug(
        "common.py",
        'x, more = block(params[f"block_{i}"], x, key(i + 1))',
        'x, more = block(params[f"block_{i}"], x, key(1))',
        "every block draws the first block's dropout masks: one key for every layer",
        (f"{DROPOUT}[shardmap_dp]",),
    ),
    Bug(
        "common.py",
        "losses, _ = token_losses(state.params, state.apply_fn, tokens)",
        "losses, _ = token_losses(state.params, state.apply_fn, tokens, state.rng)",
        "the held-out loss is computed with dropout on",
        (f"{DROPOUT}[shardmap_dp]",),
    ),
    # The data's rows
    Bug(
        "common.py",
        "rng = np.random.default_rng((self.seed, SPLITS[split], step, row))",
        "rng = np.random.default_rng((self.seed, SPLITS[split], step))",
        "a text file's batch is one window of the text, repeated in every row",
        (f"{DATA}::test_the_rows_of_a_batch_are_different_sequences",),
    ),
    # The meshes chosen for device and host counts the tests do not run on
    Bug(
        "expert_parallel.py",
        "expert = math.gcd(self.experts, max(1, jax.device_count() // 2), "
        "jax.local_device_count())",
        "expert = math.gcd(self.experts, max(1, jax.device_count() // 2))",
        "expert parallelism's 'auto' splits the experts over more devices than a host has: its "
        "all-to-all crosses hosts (the same mesh on 8 devices)",
        (f"{MESHES}[expert_parallel]",),
    ),
    Bug(
        "pjit_tp.py",
        "model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0 and m <= max(1, n // 2))",
        "model = max(m for m in (1, 2, 4) if n % m == 0 and kv % m == 0)",
        "tensor parallelism's 'auto' puts all 4 devices of a 4-device host on 'model', leaving "
        "no data parallelism (the same mesh on 8 devices)",
        (f"{MESHES}[pjit_tp]",),
    ),
    # The tools' own figures
    Bug(
        "tools/hlo.py",
        '("tpu v5", 459e12),  # v5p',
        '("tpu v5", 495e12),  # v5p',
        "v5p's peak is 495 TFLOP/s, not its maker's 459: every v5p MFU and predicted step off",
        ("tests/test_tpu.py::test_the_chips_figures_are_their_makers",),
    ),
    Bug(
        "common.py",
        "seconds, self.last_time = (now - self.last_time) / count, now",
        "seconds, self.last_time = now - self.last_time, now",
        "with --log-every above 1, the time a step logged is the whole interval's",
        ("tests/test_command_line.py::test_the_logged_speed_is_the_wall_clocks",),
    ),
    # The lesson against a plain implementation of it
    Bug(
        "common.py",
        "c.d_model, epsilon=1e-5,",
        "c.d_model, epsilon=1e-6,",
        "the norms' epsilon is Flax's 1e-6, not GPT-2's 1e-5",
        ("tests/test_oracle.py",),
    ),
    Bug(
        "common.py",
        'ADAM = {"b1": 0.9, "b2": 0.95, "eps": 1e-8}',
        'ADAM = {"b1": 0.9, "b2": 0.999, "eps": 1e-8}',
        "AdamW's second moment decays by optax's default 0.999, not GPT-3's 0.95",
        ("tests/test_oracle.py",),
    ),
    # What several processes print: the error line, whatever else the runtime prints
    Bug(
        "common.py",
        'fields = [f.name for f in dataclasses.fields(config) if f.name != "process_id"]',
        'fields = [f.name for f in dataclasses.fields(config) if f.name not in ("process_id", '
        '"batch_size")]',
        "processes given different --batch-size values train on, unnoticed until one refuses it",
        ("tests/test_multi_process.py::test_a_bad_flag_on_one_process_stops_both",),
    ),
    # A promise of the TPU program (issue 65): FSDP gathers again for the backward pass
    Bug(
        "fsdp.py",
        "keep, policy = gather_and_keep(run), jax.checkpoint_policies.dots_saveable",
        "keep, policy = gather_and_keep(run), lambda p, *_, **__: p is not lax.all_gather_p",
        "FSDP's remat saves everything but the all-gathers: under bfloat16 it keeps the blocks' "
        "casts of their gathered weights, and gathers nothing again",
        (f"{EQ}::test_fsdp_gathers_again_for_the_backward_pass_unless_told_to_keep",),
    ),
    Bug(
        "logical_pjit.py",
        'NO_COLLECTIVE_MATMUL = {"xla_tpu_enable_windowed_einsum_for_reduce_scatter": False}',
        "NO_COLLECTIVE_MATMUL = {}",
        "the compiler's FSDP on a TPU computes the head's gradient as a collective matmul, which "
        "keeps the logits and their gradient both: more HBM than data parallelism",
        (
            f"{TPU}::test_fsdp_needs_less_hbm_than_data_parallelism_by_the_state_it_shards[logical_fsdp]",
        ),
    ),
    # One reduction a step with micro-batches (issue 84): explicit_sharding.py's reduced types
    Bug(
        "explicit_sharding.py",
        "local = state.replace(params=summed_once(state.apply_fn, state.params, batch_axes))",
        "local = state",
        "explicit_sharding.py sums the gradients over the devices at every micro-batch: no "
        "parameter typed reduced, so none stays unreduced through the loop",
        ("tests/test_cost_report.py::test_explicit_sharding_reduces_the_gradients_once",),
    ),
    Bug(
        "explicit_sharding.py",
        "if spec.reduced <= {a for s in split for a in axes_of(s)}:",
        "if True:",
        "explicit_sharding.py keeps the position table reduced beside activations split over no "
        "batch axis: JAX has summed its gradient over the devices, and the step sums it again",
        (f"{EQ}::test_microbatches_match[explicit_tp]",),
    ),
    Bug(
        "pipeline.py",
        "np.concatenate([chunks[:stages], chunks[stages:][::-1]])",
        "np.concatenate([chunks[:stages], chunks[stages:]])",
        "zbv's stages hold their second groups of layers in the model's order, not the V's: "
        "stage s runs chunk stages + s where the schedule sends it chunk 2 stages - 1 - s's input",
        (f"{EQ}::test_matches_single_device_reference[pipeline_zbv]",),
    ),
]


# ----------------------------------------------------------------------------------------------
# The generated part (--generated): every comparison, off-by-one and integer axis argument of the
# lesson flipped, one at a time, against the tests that reach its line
# ----------------------------------------------------------------------------------------------

FILES = ["common.py"] + [
    f"{name}.py"
    for name in (
        "pmap_dp shardmap_dp fsdp pjit_tp logical_pjit pipeline context_parallel expert_parallel "
        "explicit_sharding"
    ).split()
]
# common.py's lesson: its sections from the model to the data (not the flags, costs, devices,
# checkpoints and logging after them); a script's: its functions but main()
LESSON = ("# Model. ", "# The model and the dataset a flag names")
FLIP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt}
FLIP |= {ast.Eq: ast.NotEq, ast.NotEq: ast.Eq}
GENERATED = re.compile(r"<!-- generated:start -->\n.*?<!-- generated:end -->", re.DOTALL)
# Survivors that compute the same as the code: {"file:function: edit": why, in one line}
EQUIVALENT = {
    "common.py:clip: norm < max_norm -> norm <= max_norm": "at the bound, g / n x c is g",
    "common.py:grouped_by_expert: expert >= here -> expert > here": "the next device's first "
    "expert keeps its weight, but its slot lies past the groups, where both matmuls and their "
    "biases give 0",
    "common.py:_gmm: rows > 1 -> rows >= 1": "one row's slots are in their experts' order: the "
    "sort is the identity",
    "common.py:_gmm: rows > 1 -> rows >= 1 (2)": "the identity sort undone",
    "common.py:SyntheticData: vocab <= 2048 -> vocab < 2048": "the constructions' border: at "
    "exactly 2,048 the sparse one instead of the dense, both exact (tests/test_data.py)",
    "common.py:SyntheticData: change < 1e-12 -> change <= 1e-12": "a change of exactly 1e-12: "
    "converged either way",
    "common.py:_gmm: rows * slots > 256 -> rows * slots >= 256": "a tile of 128 or 512 rows at "
    "256 slots: either tiling makes the same product",
    "fsdp.py:make_mesh: size > 1 -> size >= 1": "a replica axis of size 1 splits nothing: the "
    "same layouts",
    "pjit_tp.py:param_specs: set(names) <= {*config.mesh_axes(), None} -> set(names) < "
    "{*config.mesh_axes(), None}": "equal sets name every mesh axis, and then `whole` holds",
    "pipeline.py:pipeline_gradients: config.dropout > 0 -> config.dropout >= 0": "at rate 0 "
    "nnx.Dropout returns its input, given a key or not",
    "pipeline.py:pipeline_gradients: config.dropout > 0 -> config.dropout >= 0 (2)": "the same",
}


@dataclasses.dataclass(frozen=True)
class Mutant:
    file: str
    function: str  # the top-level function or class it is in
    start: tuple  # (line, column) of the text replaced, as ast gives them
    end: tuple
    new: str
    what: str  # the edit: "a < b -> a <= b"

    @property
    def key(self) -> str:
        return f"{self.file}:{self.function}: {self.what}"


def lesson_nodes(file: str, tree) -> list:
    """The top-level functions and classes a mutant may change."""
    if file != "common.py":
        return [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name != "main"]
    lines = (ROOT / file).read_text().splitlines()
    first, last = (next(i for i, t in enumerate(lines, 1) if t.startswith(h)) for h in LESSON)
    kinds = (ast.FunctionDef, ast.ClassDef)
    return [n for n in tree.body if isinstance(n, kinds) and first < n.lineno < last]


def generate(file: str) -> list:
    """Every mutant of a file's lesson: a comparison flipped (< and <=, > and >=, == and !=), a
    + 1 or - 1 dropped, an integer axis= moved by one."""
    text = (ROOT / file).read_text()
    tree, found = ast.parse(text), []
    for top in lesson_nodes(file, tree):

        def add(node, new, what, name=top.name):
            start, end = (node.lineno, node.col_offset), (node.end_lineno, node.end_col_offset)
            found.append(Mutant(file, name, start, end, new, what))

        for node in ast.walk(top):
            if isinstance(node, ast.Compare):
                for i, op in enumerate(node.ops):
                    if type(op) in FLIP:
                        copy = ast.parse(f"({ast.get_source_segment(text, node)})", mode="eval")
                        copy.body.ops[i] = FLIP[type(op)]()
                        new = ast.unparse(copy.body)
                        add(node, new, f"{ast.unparse(node)} -> {new}")
            elif (
                isinstance(node, ast.BinOp)
                and isinstance(node.op, (ast.Add, ast.Sub))
                and isinstance(node.right, ast.Constant)
                and node.right.value == 1
            ):
                left = ast.get_source_segment(text, node.left)
                add(node, left, f"{ast.unparse(node)} -> {ast.unparse(node.left)}")
            elif isinstance(node, ast.keyword) and node.arg == "axis":
                value, axis = node.value, None
                if isinstance(value, ast.Constant):
                    axis = value.value
                elif isinstance(value, ast.UnaryOp) and isinstance(value.operand, ast.Constant):
                    axis = -value.operand.value
                if isinstance(axis, int) and not isinstance(axis, bool):
                    moved = axis + 1 if axis >= 0 else axis - 1
                    add(value, str(moved), f"axis={axis} -> axis={moved}")
    seen = {}  # the same edit twice in a function: numbered, so that each key is one mutant
    for i, m in enumerate(found):
        seen[m.function, m.what] = seen.get((m.function, m.what), 0) + 1
        if seen[m.function, m.what] > 1:
            found[i] = dataclasses.replace(m, what=f"{m.what} ({seen[m.function, m.what]})")
    return found


def mutated(text: str, m: Mutant) -> str:
    """The text with the mutant's edit."""
    starts = [0]
    for line in text.encode().splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    raw = text.encode()
    begin, end = starts[m.start[0] - 1] + m.start[1], starts[m.end[0] - 1] + m.end[1]
    return (raw[:begin] + m.new.encode() + raw[end:]).decode()


def reach_map(folder: Path, tests: tuple, timeout: int) -> dict:
    """{file: {line: [tests]}}: which tests run each line of the lesson's files, the fastest
    first, from one run of `tests` under coverage, each test its own context (pytest-cov)."""
    import coverage

    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not full"]
    command += ["--cov=.", "--cov-context=test", "--cov-report=", "--junitxml=junit.xml"]
    subprocess.run([*command, *tests], cwd=folder, capture_output=True, timeout=timeout)
    seconds = {}
    for case in ET.parse(folder / "junit.xml").iter("testcase"):
        module, _, cls = case.get("classname").partition(".Test")
        path = module.replace(".", "/") + ".py"
        seconds[f"{path}::{case.get('name')}"] = float(case.get("time"))
    data = coverage.CoverageData(basename=str(folder / ".coverage"))
    data.read()
    reach = {}
    for file in FILES:
        lines = data.contexts_by_lineno(str(folder / file))
        reach[file] = {
            line: sorted(
                {c.rsplit("|", 1)[0] for c in contexts if c} & seconds.keys(), key=seconds.get
            )
            for line, contexts in lines.items()
        }
    return reach


def generated(args):
    """--generated: make each mutant in a copy of the project, run the tests that reach its
    lines (the fastest `--fastest` first, then, if it survives, all of them), and list the
    survivors."""
    mutants = [m for file in FILES for m in generate(file)]
    mutants = [m for i, m in enumerate(mutants, 1) if not args.only or i in args.only]
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        folder = Path(tmp)
        copy_project(folder)
        if args.map and Path(args.map).exists():
            reach = json.loads(Path(args.map).read_text())
        else:
            start = time.perf_counter()
            reach = reach_map(folder, tuple(args.reach_tests), args.timeout * 4)
            print(f"reach map: {time.perf_counter() - start:.0f}s", flush=True)
            Path(args.map or "reach.json").write_text(json.dumps(reach))
            reach = json.loads(json.dumps(reach))  # its lines as the file has them: strings
        results = []
        for i, m in enumerate(mutants, 1):
            lines = range(m.start[0], m.end[0] + 1)
            tests = list(dict.fromkeys(t for n in lines for t in reach[m.file].get(str(n), [])))
            path = folder / m.file
            original = path.read_text()
            path.write_text(mutated(original, m))
            try:
                caught, seconds = None, 0.0
                rest = [] if args.fastest_only else tests[args.fastest :]
                for chosen in (tests[: args.fastest], rest):
                    if chosen and not caught:
                        status, failed, _, spent, _ = run_tests(folder, tuple(chosen), args.timeout)
                        caught, seconds = (
                            (failed or f"exit {status}") if status else None,
                            seconds + spent,
                        )
            except subprocess.TimeoutExpired:
                caught, seconds = "timeout", float(args.timeout)
            finally:
                path.write_text(original)
            missed = (
                "survived" if not args.fastest_only else f"missed by the {args.fastest} fastest"
            )
            fate = caught or ("no test reaches it" if not tests else missed)
            results.append((m, caught, len(tests), seconds))
            print(
                f"{i}/{len(mutants)} {m.key}: {fate} ({len(tests)} tests, {seconds:.0f}s)",
                flush=True,
            )
    killed = sum(bool(c) for _, c, _, _ in results)
    argued = sum(m.key in EQUIVALENT for m, c, _, _ in results if not c)
    lines = [
        f"{killed} of {len(results)} killed; {argued} of the survivors argued equivalent below.",
        "",
        "| mutant | tests that reach it | why it lives |",
        "|---|---|---|",
    ]
    for m, caught, reached, _ in results:
        if not caught:
            why = EQUIVALENT.get(m.key, "**survives**")
            lines.append(f"| `{m.key}` (line {m.start[0]}) | {reached} | {why} |")
    text = "\n".join(lines)
    print(text)
    if args.write:
        page, block = PAGE.read_text(), f"<!-- generated:start -->\n{text}\n<!-- generated:end -->"
        page = (
            GENERATED.sub(lambda _: block, page) if GENERATED.search(page) else f"{page}\n{block}\n"
        )
        PAGE.write_text(page)
    return 0 if all(c or m.key in EQUIVALENT for m, c, _, _ in results) else 1


def copy_project(folder: Path):
    """The files git tracks (and the ones it does not ignore), as a clean clone has them."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    for name in listed:
        source = ROOT / name
        if source.is_file():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, folder / name)
    if (ROOT / ".tpu").is_dir():  # libtpu (requirements-tpu.txt), for tests/test_tpu.py
        (folder / ".tpu").symlink_to(ROOT / ".tpu")


def run_tests(folder: Path, tests: tuple, timeout: int) -> tuple:
    """(pytest's exit status, the first failed test or None, how it failed, seconds, the output's
    end)."""
    start = time.perf_counter()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-x",
            "-q",
            "-p",
            "no:cacheprovider",
            "-m",
            "not full",
            *tests,
        ],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    seconds = time.perf_counter() - start
    failed = re.search(r"^(?:FAILED|ERROR) (\S+)", done.stdout, re.MULTILINE)
    # How: an assertion of the tests, or an error JAX raised (check_vma, shapes, ...) on the way.
    error = re.search(r"^E +(\w+(?:Error|Exception)\b)", done.stdout, re.MULTILINE)
    how = error.group(1) if error and error.group(1) != "AssertionError" else None
    return done.returncode, failed.group(1) if failed else None, how, seconds, done.stdout[-3000:]


def table(results) -> str:
    lines = [
        "| # | file | the bug | caught by | how | seconds |",
        "|---|---|---|---|---|---|",
    ]
    for i, bug, caught, how, seconds in results:
        test = f"`{caught}`" if caught else "**not caught**"
        lines.append(f"| {i} | `{bug.file}` | {bug.what} | {test} | {how or '–'} | {seconds:.0f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--only", type=int, nargs="*", help="the bugs to try, by number (default: all)"
    )
    parser.add_argument(
        "--no-clean", action="store_true", help="skip the run of the tests on the unchanged code"
    )
    parser.add_argument("--write", action="store_true", help="rewrite dev/mutations.md")
    parser.add_argument(
        "--timeout", type=int, default=1800, help="seconds allowed for each bug's tests"
    )
    parser.add_argument(
        "--generated", action="store_true", help="the generated mutants of the lesson instead"
    )
    parser.add_argument(
        "--fastest-only", action="store_true", help="generated: only those, not all after them"
    )
    parser.add_argument("--map", help="the reach map's file: read if it exists, else written")
    parser.add_argument("--reach-tests", nargs="*", default=[], help="the map's tests (all)")
    parser.add_argument(
        "--fastest", type=int, default=6, help="generated: tests tried before all that reach it"
    )
    args = parser.parse_args()
    if args.generated:
        sys.exit(generated(args))
    chosen = [(i, bug) for i, bug in enumerate(BUGS, 1) if not args.only or i in args.only]
    for i, bug in chosen:  # every edit applies: its text is in the file once
        count = (ROOT / bug.file).read_text().count(bug.old)
        if count != 1:
            sys.exit(f"bug {i}: its text occurs {count} times in {bug.file}, not once")
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        folder = Path(tmp)
        copy_project(folder)
        if not args.no_clean:
            tests = tuple(dict.fromkeys(test for _, bug in chosen for test in bug.tests))
            status, failed, _, seconds, out = run_tests(folder, tests, args.timeout * 2)
            print(
                f"unchanged code: {len(tests)} test selections, exit {status}, {seconds:.0f}s",
                flush=True,
            )
            if status != 0:
                sys.exit(f"the tests fail on the unchanged code ({failed}):\n{out}")
        results = []
        for i, bug in chosen:
            path = folder / bug.file
            original = path.read_text()
            path.write_text(original.replace(bug.old, bug.new))
            try:
                status, failed, how, seconds, out = run_tests(folder, bug.tests, args.timeout)
            finally:
                path.write_text(original)
            caught = failed if status != 0 else None
            if status not in (0, 1):  # not a test failure: a crash of pytest, or nothing collected
                caught = f"pytest exit {status}" if failed is None else failed
            how = (how or "assertion") if caught else None
            results.append((i, bug, caught, how, seconds))
            print(
                f"bug {i} ({bug.file}): "
                f"{f'caught by {caught} ({how})' if caught else 'NOT CAUGHT'} in {seconds:.0f}s",
                flush=True,
            )
            if not caught:
                print(out)
    text = table(results)
    print(text)
    if args.write:
        page = PAGE.read_text()
        if args.only:  # the other bugs' rows stay as the page has them
            rows = {
                int(row.split("|")[1]): row
                for row in MARKER.search(page).group().splitlines()
                if re.match(r"\| \d+ \|", row)
            }
            rows.update({int(row.split("|")[1]): row for row in text.splitlines()[2:]})
            text = "\n".join(text.splitlines()[:2] + [rows[i] for i in sorted(rows)])
        PAGE.write_text(
            MARKER.sub(lambda _: f"<!-- mutations:start -->\n{text}\n<!-- mutations:end -->", page)
        )
        print(f"wrote {PAGE.relative_to(ROOT)}")
    sys.exit(0 if all(caught for _, _, caught, *_ in results) else 1)


if __name__ == "__main__":
    main()
