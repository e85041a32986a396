"""The documentation cannot go stale: its excerpts are the scripts' code and output, and
README.md stays what a newcomer reads first."""

import ast
import re
import subprocess
import sys

import pytest

import pipeline
from tests.harness import ROOT, SCRIPTS, matrix

# Read beside the chain, after the script each names
BRANCHES = {
    "pipeline": "shardmap_dp",
    "context_parallel": "shardmap_dp",
    "expert_parallel": "shardmap_dp",
    "explicit_sharding": "pjit_tp",
}


def test_readme_transitions_match_the_scripts():
    """docs/transitions.md's diff excerpts, one per neighbouring pair (the chain from pmap_dp.py
    to logical_pjit.py, and the branches from shardmap_dp.py and pjit_tp.py), are what
    dev/transitions.py makes from the scripts today; README.md has a paragraph for each."""
    done = subprocess.run(
        [sys.executable, ROOT / "dev" / "transitions.py", "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    pairs = re.findall(r"<!-- diff (\S+) (\S+):", (ROOT / "docs" / "transitions.md").read_text())
    chain = [name for name in SCRIPTS if name not in BRANCHES]
    expected = list(zip(chain[:-1], chain[1:], strict=True)) + [
        (parent, name) for name, parent in BRANCHES.items()
    ]
    assert pairs == [(f"{a}.py", f"{b}.py") for a, b in expected]
    readme = (ROOT / "README.md").read_text()
    for a, b in expected:
        assert f"(`{a}.py` → `{b}.py`)" in readme


def test_the_schedules_shown_are_pipeline_pys():
    """docs/strategies.md's picture of the pipeline schedules is what pipeline.py's
    --show-schedule prints, and README.md's table of them is what their tables say: both are
    what dev/schedules.py makes today."""
    done = subprocess.run(
        [sys.executable, ROOT / "dev" / "schedules.py", "--check"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    for kind in pipeline.SCHEDULES:
        assert f"--schedule {kind} on 4 stages" in (ROOT / "docs" / "strategies.md").read_text()
        assert f"| {kind} |" in (ROOT / "README.md").read_text()


def test_readme_error_examples_are_what_the_scripts_say():
    """Every '$ python SCRIPT FLAGS' example in the documentation followed by an error line is
    that command's real, one-line answer."""
    readme = "".join(
        path.read_text() for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    )
    examples = re.findall(
        r"^\$ python (\S+\.py) ?(.*)\n(\S+\.py: error: .*)$", readme, re.MULTILINE
    )
    assert examples
    for script, flags, expected in examples:
        done = subprocess.run(
            [sys.executable, script, *flags.split()],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and done.stderr.strip() == expected, (
            script,
            flags,
            done.stderr,
        )


def test_a_benchmark_run_changes_no_tracked_file(tmp_path):
    """benchmarks/benchmark.py prints its table; benchmarks/results.* change only with --write
    (before: a 20-step trial run rewrote them)."""
    tracked = [
        ROOT / "benchmarks" / "results.md",
        ROOT / "benchmarks" / "results.png",
    ]
    before = [path.read_bytes() for path in tracked]
    done = subprocess.run(
        [
            sys.executable,
            "benchmarks/benchmark.py",
            "--only",
            "shardmap_dp",
            "--no-remat",
            "--",
            "--steps=2",
            "--batch-size=8",
            "--seq-len=16",
            "--layers=1",
            "--d-model=32",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| shardmap_dp" in done.stdout and "wrote" not in done.stdout
    assert [path.read_bytes() for path in tracked] == before


def test_the_readmes_test_counts_are_the_suites():
    """README.md's counts of tests: `pytest`'s, and how many more `pytest -m full` adds."""
    counts = []
    for marks in ("not full", "full"):
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-m", marks],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        counts.append(int(re.search(r"^(\d+)/\d+ tests collected", done.stdout, re.M).group(1)))
    readme = (ROOT / "README.md").read_text()
    assert f"`pytest` ({counts[0]} tests)" in readme and f"({counts[1]} more tests;" in readme


def test_readme_is_what_a_newcomer_needs():
    """What a newcomer needs first, on its first screen (what and why, the two commands, the
    scripts table), then the transitions and your own model, in 2,000 words at most (3,994
    before issue 67), the rest in docs/; every docs page it names exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200 and len(readme.split()) <= 2000
    first = readme.split("\n## ")[0]
    assert "pip install -r requirements.txt" in first and "&& pytest" in first
    assert all(f"[`{name}.py`]({name}.py)" in first for name in SCRIPTS)
    for page in re.findall(r"\]\((docs/[\w.]+)\)", readme):
        assert (ROOT / page).exists(), page


def test_the_docs_do_not_grow():
    """README and docs in at most 35,000, issue 83's bound (51,297 at 5a3040a; 47,135 at 20bf228,
    before the flag pairs' record moved to dev/flag_pairs.md; 43,683 at a19a392, before the parity
    matrix and the mutation catalogue moved to dev/parity.md and dev/mutations.md; 39,181 at
    e61b755, before the TPU slices' table moved to benchmarks/tpu_slices.md and the benchmark
    table's copy left docs/costs.md for benchmarks/results.md), the learner's path (README,
    docs/concepts.md, the nine scripts, docs/transitions.md) in at most 32,550 (32,161 at 57027be;
    31,450 before issue 86's ZB-V in pipeline.py, 567 words, and its forwards keeping what their
    backwards read, 485; issue 83 aims at 25,000): what is said once is read once."""
    words = lambda paths: sum(len((ROOT / p).read_text().split()) for p in paths)  # noqa: E731
    pages = ["README.md", *(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))]
    path = ["README.md", "docs/concepts.md", "docs/transitions.md", *(f"{s}.py" for s in SCRIPTS)]
    assert words(pages) <= 35_000 and words(path) <= 32_550


def test_the_count_of_bad_inputs_is_the_tests_own():
    """docs/operations.md says how many bad inputs the command-line test tries."""
    from tests.test_command_line import BAD_INPUTS

    cases = sum(len(scripts) for _, scripts, _ in BAD_INPUTS)
    text = (ROOT / "docs" / "operations.md").read_text()
    assert f"({len(BAD_INPUTS)} of them, {cases} cases over the scripts they apply to)" in text


def benchmark_rows(page):
    """{strategy: {column: cell}} of the benchmark table in a page."""
    lines = [line for line in page.read_text().splitlines() if line.startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return {
        cells[0]: dict(zip(header, cells, strict=True))
        for cells in ([cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:])
    }


# What a benchmark row says that does not depend on the machine's speed or on the 200 steps'
# training: the layout's bytes and the compiled step's collectives, the same on any x86 CPU.
STRUCTURE = [
    "state MB/device",
    "× total/N",
    "compiled args MB",
    "all-reduce n / MB",
    "all-gather n / MB",
    "reduce-scatter n / MB",
    "other n / MB",
]


sys.path.insert(0, str(ROOT / "benchmarks"))
import benchmark  # noqa: E402

# One row in every pytest (FSDP by hand), every row with -m full: each row compiles the default
# model.
TABLE_ROWS = ["fsdp"]


@pytest.mark.parametrize("strategy", matrix(list(benchmark.STRATEGIES), TABLE_ROWS))
def test_the_benchmark_table_is_what_the_scripts_compile(strategy):
    """benchmarks/results.md's benchmark table holds each
    strategy's bytes of state per device and collectives per step as the scripts make them
    today: the strategy runs one step on the table's configuration, here, and its report fills
    those columns as benchmarks/benchmark.py does. (The timings, the compile times and the
    losses after 200 steps are the benchmark run's own.)"""
    import common

    table = benchmark_rows(ROOT / "benchmarks" / "results.md")
    assert list(table) == list(benchmark.STRATEGIES)
    command = benchmark.STRATEGIES[strategy]
    module = SCRIPTS[command[0].removesuffix(".py")]
    config = common.parse_config(module.Config, argv=[*command[1:], "--steps=1", "--eval-every=0"])
    s = module.main(config).summary
    c = s["collectives"]
    other = {key: c["all-to-all"][key] + c["collective-permute"][key] for key in ("count", "bytes")}
    mine = [
        benchmark.megabytes(s["state_bytes_per_device"]),
        f"{s['state_bytes_per_device'] * s['devices'] / s['state_bytes_total']:.2f}",
        benchmark.megabytes(s["compiled_argument_bytes"]),
        *map(
            benchmark.collective_cell,
            (c["all-reduce"], c["all-gather"], c["reduce-scatter"], other),
        ),
    ]
    print(f"\n{strategy}: {mine}; temporaries {benchmark.megabytes(s['compiled_temp_bytes'])} MB")
    assert mine == [table[strategy][column] for column in STRUCTURE]


def test_the_mutation_table_is_the_catalogues():
    """dev/mutations.md's table has a row for each bug of dev/mutations.py, in order, each
    caught: the table dev/mutations.py --write made from the catalogue as it is today (the run
    itself is not a test: about 11 minutes); and each bug's edit still finds its text, once, in
    the code as it is."""
    sys.path.insert(0, str(ROOT / "dev"))
    import mutations

    text = (ROOT / "dev" / "mutations.md").read_text()
    rows = re.findall(r"^\| (\d+) \| `([\w./]+)` \| (.+?) \| `(\S+)` \|", text, re.MULTILINE)
    assert [(int(i), file, what) for i, file, what, _ in rows] == [
        (i, bug.file, bug.what) for i, bug in enumerate(mutations.BUGS, 1)
    ]
    assert len(rows) >= 15 and "not caught" not in text
    for i, bug in enumerate(mutations.BUGS, 1):  # and each still applies: its text there once
        assert (ROOT / bug.file).read_text().count(bug.old) == 1, f"bug {i}: {bug.old!r}"


def test_each_generated_mutant_is_one_edit_of_the_lesson():
    """dev/mutations.py --generated: each mutant of the lesson (common.py's model to data, the
    scripts' functions) is a program that differs from the code only inside the node it names,
    by the edit it names; every kind found, each mutant named once, each argued one among them."""
    sys.path.insert(0, str(ROOT / "dev"))
    import mutations

    mutants = [m for file in mutations.FILES for m in mutations.generate(file)]
    assert len({m.key for m in mutants}) == len(mutants) > 100
    for kind in (" <= ", " > ", " != ", " == ", "axis=-2", "+ 1 ->", "- 1 ->"):
        assert any(kind in m.what for m in mutants), kind
    assert not any(m.function == "main" for m in mutants)
    assert set(mutations.EQUIVALENT) <= {m.key for m in mutants}  # each argument still a mutant's
    for m in mutants:
        text = (ROOT / m.file).read_text()
        new = mutations.mutated(text, m)
        ast.parse(new)
        lines, changed = text.splitlines(), new.splitlines()
        after = len(lines) - m.end[0]  # the lines after the node's, unchanged
        assert changed[: m.start[0] - 1] == lines[: m.start[0] - 1], m.key
        assert changed[len(changed) - after :] == lines[len(lines) - after :], m.key
        assert m.new in new and new != text, m.key


def test_the_parity_matrix_is_the_tests():
    """dev/parity.md has a row for every strategy and model the tests train, and every figure
    within the bound the tests hold it to (dev/parity.py --write measures them: about 15
    minutes, not a test)."""
    import test_equivalence as eq

    text = (ROOT / "dev" / "parity.md").read_text()
    rows = re.findall(r"^\| `([\w-]+)` \| ([^|]+) \| (.+) \|$", text, re.MULTILINE)
    names = {"GPT": "gpt", "GPT, 8 experts": "moe", "tests/llama.py": "llama"}
    found = [(strategy, names[model.strip()]) for strategy, model, _ in rows]
    expected = [
        (strategy, model)
        for strategy in eq.STRATEGIES
        for model in (["moe"] if eq.model_flags(strategy).get("experts") else names.values())
    ]
    assert found == expected
    for (strategy, model), (*_, figures) in zip(found, rows, strict=True):
        cells = [cell.strip() for cell in figures.split("|")]
        bf16 = eq.BF16_MOE_RTOL if model == "moe" else eq.BF16_RTOL
        for measured, tested in ((cells[0:3], (eq.RTOL,) * 3), (cells[3:6], bf16)):
            assert all(float(x) <= bound for x, bound in zip(measured, tested, strict=True)), (
                strategy,
                model,
                measured,
            )


def test_the_three_ways_table_is_the_code():
    """docs/three_ways.md has a row for each of the three ways, and its count of the lines that
    state the layout is the code's today (dev/three_ways.py --write measures the rest: about a
    minute, not a test)."""
    from dev import three_ways

    text = (ROOT / "docs" / "three_ways.md").read_text()
    rows = re.findall(r"^\| (\w+) \| .* \| (\d+) \|$", text, re.MULTILINE)
    assert [mode for mode, _ in rows] == list(three_ways.MODES)
    for mode, lines in rows:
        assert int(lines) == three_ways.code_lines(*three_ways.LAYOUT[mode]), mode


def concept_snippets():
    text = (ROOT / "docs" / "concepts.md").read_text()
    return re.findall(r"```python\n(.*?)```", text, re.DOTALL)


@pytest.mark.parametrize("index", range(len(concept_snippets())))
def test_the_concepts_snippets_run(index, tmp_path):
    """Every snippet of docs/concepts.md runs as it is, alone, and prints what its comments say
    it prints."""
    snippet = concept_snippets()[index]
    (tmp_path / "snippet.py").write_text(snippet)
    done = subprocess.run(
        [sys.executable, "snippet.py"], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    printed = done.stdout.splitlines()
    # What each print's comment says it prints: the comment up to a colon or an " as"
    said = [
        line.split("# ", 1)[1].split(":")[0].split(" as ")[0]
        for line in snippet.splitlines()
        if line.strip().startswith("print(") and "# " in line
    ]
    assert len(printed) == len(said)
    for out, claim in zip(printed, said, strict=True):
        assert claim in out, (out, claim)


def test_the_readmes_line_counts_are_the_files():
    """Every 'N lines' the README gives a file of tests/ is that file's length now."""
    text = (ROOT / "README.md").read_text()
    found = re.findall(r"\[`(tests/\w+\.py)`\]\(tests/\w+\.py\)[^\[]{0,200}?(\d+) lines", text)
    assert len(found) >= 2, found
    for path, lines in found:
        assert len((ROOT / path).read_text().splitlines()) == int(lines), path


def test_common_py_keeps_its_parts_within_their_bounds():
    """common.py: the lesson, then the cost report (at most 138 lines: issue 83's one HLO reader,
    a TPU loop's trips read as tools/hlo.py reads them), then the harness (at most 563: issue 83,
    the loop's exits the loop's, Orbax's own errors; issue 85's loader), at most 2,155 in all
    (the TPU's kernels moved in so that a copy of two files runs on a TPU; TFDS left for
    tests/tfds_text.py); what a copier of fsdp.py carries is what the README says (issue 83's
    bound: 1,650). pipeline.py in at most 810 lines (700 in issue 83; issue 86's ZB-V, 46, and
    its forwards keeping what their backwards read, 62), test_equivalence.py in at most 1,500
    (issue 83)."""
    lines = (ROOT / "common.py").read_text().splitlines()
    cost = (
        lines.index("# What a run costs, measured from the real arrays and the compiled step") - 1
    )
    harness = next(i for i, line in enumerate(lines) if line.startswith("# THE HARNESS")) - 1
    assert 0 < cost < harness and harness - cost <= 138 and len(lines) - harness <= 563
    assert len(lines) <= 2155  # 2,098 before --init-from (52 lines); 2,143 before Checkpoints.wait
    count = lambda name: len((ROOT / name).read_text().splitlines())  # noqa: E731
    assert count("pipeline.py") <= 810 and count("test_equivalence.py") <= 1500
    readme = (ROOT / "README.md").read_text()
    carried = int(
        re.search(r"A copier of `fsdp.py` carries ([\d,]+) lines", readme)[1].replace(",", "")
    )
    assert carried == len(lines) + len((ROOT / "fsdp.py").read_text().splitlines())


def test_the_tpu_tables_formulas_are_the_tools_and_its_states_the_measured():
    """benchmarks/tpu_slices.md's table: each row's formula is tools/tpu_slices.py's for that row's
    mesh (a formula changed without the table compiled again fails), and the state it counts, 12 of
    its 16 bytes a parameter, is the state per chip the compiled program measured (within 2%: the
    step counters, expert parallelism's balance biases, and at 64 chips the norms and biases fsdp_tp
    keeps whole, 1.5% of 0.20 GiB at 1.1B)."""
    sys.path.insert(0, str(ROOT / "tools"))
    import tpu_slices

    slices = {name: topology for topology, name in tpu_slices.SLICES.items()}
    rows = [
        [cell.strip() for cell in line.strip("|").split("|")]
        for line in tpu_slices.MARKER.search(tpu_slices.PAGE.read_text())[0].splitlines()
        if line.startswith("| ") and not line.startswith("| script")
    ]
    assert len(rows) == len(tpu_slices.SCRIPTS) * len(tpu_slices.SIZES) * len(slices)
    checked = 0
    for cells in rows:
        script, size, name = cells[0].split(" ", 2)
        if not cells[3]:  # no mesh: the script stopped before it made one
            continue
        axes = cells[3].split(":")[0]
        mesh = {a: int(n) for a, n in re.findall(r"(\w+)=(\d+)", axes)}
        assert cells[3] == tpu_slices.needs(script, size, slices[name], mesh), cells[0]
        if cells[4]:  # compiled: the state it holds
            state = tpu_slices.formula(script, size, slices[name], mesh)[0] * 12 / 16
            state /= 2**30  # the table's cell is rounded to 0.01 GiB
            assert abs(float(cells[4].split()[0]) - state) <= 0.02 * state + 0.005, cells[0]
            checked += 1
    assert checked >= 50
