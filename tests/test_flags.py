"""Every flag is set away from its default in some compared run: a run compared with one device,
with a definition written in a test, or with a formula. A flag no such run sets guards code that
could be wrong in any way, and nothing would notice. docs/flags.md's table says which tests set
each flag (dev/flags.py writes it from what every compared run records); conftest.py checks,
after the tests, that those of its examples that ran still do."""

import dataclasses

from dev import flags


def test_every_flag_is_set_by_a_compared_run():
    """Every flag of every script (a shared one once, a script's own in that script's runs, and
    each one a script's own code reads in that script's runs) has a row in docs/flags.md with at
    least one test, and the table names no flag that is gone."""
    rows, needed = flags.read_table(), flags.rows()
    unset = sorted(
        f"{flags.flag(name)} ({whose})"
        for name, whose in needed
        if not rows.get((name, whose), (0,))[0]
    )
    assert not unset, f"no compared run sets {', '.join(unset)}"
    assert set(rows) == needed, sorted(set(rows) ^ needed)
    assert all(len(examples) == min(count, flags.EXAMPLES) for count, examples in rows.values())


def test_every_pair_one_function_reads_is_set_together():
    """Every pair of flags one function reads (dev/flags.py finds them in the code) has a row in
    dev/flag_pairs.md's table with a test that sets both in one run, or that shows them
    refused together; and the table names no pair the code no longer reads."""
    rows, needed = flags.read_pairs(), flags.required_pairs()
    alone = sorted(
        f"{flags.flag(a)} {flags.flag(b)} ({whose})"
        for (a, b, whose), (count, _) in rows.items()
        if not count
    )
    assert not alone, f"no test sets together {', '.join(alone)}"
    assert set(rows) == set(needed), sorted(set(rows) ^ set(needed))
    assert all(len(examples) == 1 for _, examples in rows.values())


def test_a_flag_a_script_adds_or_redefines_is_its_own():
    """pipeline.py's --microbatches (its own default, 8, and meaning: micro-batches in flight)
    and expert_parallel.py's --experts need runs of those scripts; --lr, shared, a run of any."""
    needed = flags.required()
    assert ("microbatches", "pipeline") in needed and ("microbatches", flags.SHARED) in needed
    assert ("experts", "expert_parallel") in needed and ("min_shard_size", "fsdp") in needed
    assert ("lr", flags.SHARED) in needed and not any(
        name == "lr" and whose != flags.SHARED for name, whose in needed
    )
    import common

    shared = len(dataclasses.fields(common.Config))
    assert sum(whose == flags.SHARED for _, whose in needed) == shared


def test_flags_one_function_reads_pair_up():
    """Pairs are read from the code: the model's layer loop with its dropout (common.py, so a run
    of any script), each train_step's micro-batches with clipping, pipeline.py's schedule with
    its micro-batches (its own runs, as every flag a script's own code reads); a run setting both
    covers a pair, each alone does not."""
    pairs = flags.required_pairs()
    assert "common.py:Model.__call__" in pairs["dropout", "scan_layers", flags.SHARED]
    assert pairs["clip_norm", "microbatches", "fsdp"] == ["fsdp.py:train_step"]
    assert "pipeline.py:main" in pairs["microbatches", "schedule", "pipeline"]
    assert "common.py:eval_due" not in str(pairs)  # it reads one flag
    assert {("clip_norm", "pmap_dp"), ("schedule", "pipeline")} <= flags.read_by_scripts().keys()
    alone = [
        {"test": "a", "script": "fsdp", "flags": ["clip_norm"]},
        {"test": "b", "script": "fsdp", "flags": ["microbatches"]},
    ]
    together = [{"test": "c", "script": "fsdp", "flags": ["clip_norm", "lr", "microbatches"]}]
    assert ("clip_norm", "microbatches", "fsdp") not in flags.covered_pairs(alone)
    assert {("clip_norm", "microbatches", "fsdp"), ("clip_norm", "microbatches", flags.SHARED)} <= (
        flags.covered_pairs(together).keys()
    )


def test_a_refusal_covers_the_pairs_its_checks_read_and_no_others():
    """A run only checked (refused, or its example passing every check) sets a pair together
    for a function that refuses flags (common.py's check_training), not for one that computes
    with them (common.py's GPT.__init__); a refusal naming one flag of a pair whose example
    leaves the other out shows the two refused together, which no run can set."""
    test = "tests/test_command_line.py::test_bad_input_exits_2_with_one_line[...]"
    shared = flags.SHARED
    refused = {"test": test, "script": "fsdp", "flags": ["d_model", "tie_embeddings", "steps"]}
    refused |= {"checked": True, "refused": "tie_embeddings"}
    example = {"test": test, "script": "fsdp", "flags": ["tie_embeddings", "steps"]}
    found = flags.pair_tests([refused, example | {"checked": True}])
    assert "common.py:check_training" in flags.refusing()
    assert "common.py:GPT.__init__" not in flags.refusing()
    assert flags.required_pairs()["d_model", "tie_embeddings", shared] == [
        "common.py:GPT.__init__",
        "common.py:check_training",
    ]
    assert found["d_model", "tie_embeddings", shared] == (set(), {test})  # refused together
    assert not found["attention", "d_model", shared][1]  # the refusal names neither
    alone = flags.pair_tests([{**refused, "refused": "steps"}])  # no example: not shown
    assert alone["d_model", "tie_embeddings", shared] == (set(), set())


def test_new_tests_records_add_to_the_tables_counts():
    """dev/flags.py --added: the records of tests the tables have not counted add to each row's
    count (a flag's, a pair's), a row the tables lack holds theirs alone, and a pair refused
    together stays so until a run sets it."""
    new = [
        {"test": "new", "script": "fsdp", "flags": ["clip_norm", "keep_gathered", "microbatches"]}
    ]
    counted = {("clip_norm", flags.SHARED): (7, ["a", "b"])}
    rows = flags.read_table(
        flags.table(new, set(), counted).join(["<!-- flags:start -->\n", "\n<!-- flags:end -->"])
    )
    assert rows["clip_norm", flags.SHARED] == (8, ["a", "b"])
    assert rows["microbatches", flags.SHARED] == (1, ["new"])  # not counted before: theirs
    assert rows["lr", flags.SHARED] == (0, [])
    pairs = {("clip_norm", "microbatches", "fsdp"): (2, ["c"])}
    pairs["keep_gathered", "remat", "fsdp"] = ("refused together", ["d"])
    text = flags.pair_table(new, set(), pairs).join(
        ["<!-- pairs:start -->\n", "\n<!-- pairs:end -->"]
    )
    read = flags.read_pairs(text)
    assert read["clip_norm", "microbatches", "fsdp"] == (3, ["c"])
    assert read["clip_norm", "keep_gathered", "fsdp"] == (1, ["new"])
    assert read["keep_gathered", "remat", "fsdp"] == ("refused together", ["d"])
