"""Start JAX with 8 emulated CPU devices before any test touches a device.

The tests compile far more than they run (a few steps of a tiny model, hundreds of times), so
they ask XLA:CPU for less optimised machine code and its older fusion emitter: each shortens a
compilation by about a quarter. Neither changes what the tests compare: the collectives and
shardings are the same, and every comparison is between programs compiled alike. The older
emitter sizes some temporaries otherwise: the tests that check a figure docs/ states in bytes
compile as users do (users_compile, below). The scripts' subprocesses inherit both.
"""

import os
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
).strip()
# Many runs compile the same programs (a resumed run, the same script in another test, the
# processes of a multi-process run): a compilation cache for this session, shared with the
# scripts' subprocesses, compiles each once.
# (Set once, by pytest's main process: its test workers inherit it, and share the one cache.)
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", tempfile.mkdtemp(prefix="jax-cache-"))
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Every compared run notes its flags here (tests/harness.py's record_flags; dev/flags.py).
os.environ.setdefault("FLAGS_RECORD", tempfile.mkdtemp(prefix="flags-"))

import jax  # noqa: E402

# As the scripts do (common.start_devices): enough threads that XLA's CPU client cannot deadlock.
os.environ.setdefault("PJRT_NPROC", str(max(os.cpu_count() or 1, 2 * 8)))
jax.config.update("jax_num_cpu_devices", 8)


@pytest.fixture
def users_compile(monkeypatch):
    """The scripts' steps compiled with XLA:CPU's own fusion emitter, as users' are: for the
    figures docs/ states in bytes."""
    import common

    options = {**common.CPU_COMPILER_OPTIONS, "xla_cpu_use_fusion_emitters": True}
    monkeypatch.setattr(common, "CPU_COMPILER_OPTIONS", options)


def group(nodeid: str) -> str:
    """The tests that run on one worker together: a test file's, as they share the runs it
    caches (tests/harness.py), but test_equivalence.py's by strategy (its parameters' first
    part), so that the headline proof, a third of the suite, spreads over the workers."""
    path, _, test = nodeid.partition("::")
    if path != "test_equivalence.py" or "[" not in test:
        return path
    return f"{path}::{test.split('[', 1)[1].split('-', 1)[0].rstrip(']')}"


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's --dist=loadscope, its scopes group() (its loadgroup reads a test's group
    from a suffix it can no longer add to the test's id under pytest 9: no group at all)."""
    from xdist.scheduler import LoadScopeScheduling

    # Loudly, if a newer xdist scopes otherwise: overridden in silence, it would group by file
    assert hasattr(LoadScopeScheduling, "_split_scope"), "pytest-xdist: no _split_scope"

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            return group(nodeid)

    return ByGroup(config, log)


PASSED = set()  # the tests that passed in this session, as pytest-xdist reports them


def pytest_runtest_logreport(report):
    if report.when == "call" and report.passed:
        PASSED.add(report.nodeid)


def pytest_sessionfinish(session):
    """docs/flags.md names tests that set each flag in a compared run: every one that passed
    here must have (dev/flags.py --write makes the table anew)."""
    if os.environ.get("PYTEST_XDIST_WORKER") or not PASSED:
        return
    from dev import flags

    if stale := flags.stale(os.environ["FLAGS_RECORD"], PASSED):
        print("\ndocs/flags.md is out of date (python dev/flags.py):\n" + "\n".join(stale))
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
