"""Test setup: the backend from `KERAS_BACKEND` (default TensorFlow), quiet
logs, deterministic Keras.

The suite runs once per backend (`.ci/test`):

    KERAS_BACKEND=jax .venv/bin/python -m pytest -q

Cases that exist only on TensorFlow carry `@pytest.mark.tensorflow_only`
(or a module's `pytestmark`) and are skipped, with the reason, elsewhere.
Slow cases whose coverage another case duplicates on JAX and PyTorch carry
`@pytest.mark.full_run_only(reason=...)`: they run in the TensorFlow run,
and the JAX and PyTorch runs skip them naming the covering case.
"""

import gc
import os

import pytest


def _versions_at_least(**minimums):
    """Whether each distribution installed of `minimums` (name: (major,
    minor)) is at least that version; one not installed passes."""
    from importlib.metadata import PackageNotFoundError, version

    for name, minimum in minimums.items():
        try:
            found = version(name)
        except PackageNotFoundError:
            continue
        if tuple(int(part) for part in found.split(".")[:2]) < minimum:
            return False
    return True


os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
# TensorFlow's CPU allocator keeps statistics (`get_memory_info`, which
# tests/test_memory.py reads) only where it is the BFC allocator: by default
# on CPUs where TensorFlow enables oneDNN (Intel's), not on others (AMD's).
# Set for every CPU, before TensorFlow starts; subprocesses inherit it.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")

# XLA, JAX's compiler and TensorFlow's under `jit_compile=True`: the tests'
# models are tiny, and XLA's compiles, not their runs, are most of the JAX
# run's CPU time. Its CPU backend compiles much faster without LLVM's
# optimization passes (level 0) and with its older emitters for fusions
# instead of its MLIR ones, to the same values within the suite's
# tolerances: each test compares models compiled alike. One process,
# CPU-s: JAX's tests/test_whole_batch_loss.py 136 with XLA's defaults,
# 87-96 at level 0, 43 with the older emitters too; TensorFlow's `-k "xla
# or jit"` 101 with XLA's defaults, 65 with both. The tests' subprocesses
# inherit the flags. No test times a step (benchmarks/ do, outside the
# suite, with XLA's defaults).
flags = os.environ.get("XLA_FLAGS", "")
if "xla_backend_optimization_level" not in flags:
    flags += " --xla_backend_optimization_level=0"
# An XLA that does not know a flag aborts the process: TensorFlow 2.16's
# (the oldest set, .ci/compat) has no such emitter flag. From the versions
# CI tests (constraints.txt), for every XLA installed (a subprocess may
# start the other backend).
if "xla_cpu_use_fusion_emitters" not in flags and _versions_at_least(
    tensorflow=(2, 21), jaxlib=(0, 10)
):
    flags += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = flags.strip()
if os.environ["KERAS_BACKEND"] == "jax":
    # The equivalence is measured on CPU; two CPU devices for
    # `keras.distribution` (tests/test_model.py). Before JAX is imported.
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] += " --xla_force_host_platform_device_count=2"
    # One compilation cache for the run: the tests build the same small
    # models again and again, and XLA compiles each step anew in every
    # test (a new function each time) where the cache hands back the
    # executable of the same program (tests/test_auto.py, one process:
    # 97 CPU-s without, 83 with).
    # The controller's directory, which the workers and the tests'
    # subprocesses inherit; removed at its exit.
    if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
        import atexit
        import shutil
        import tempfile

        cache = tempfile.mkdtemp(prefix="keras-accum-jax-cache-")
        atexit.register(shutil.rmtree, cache, ignore_errors=True)
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache
        os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# Keras reads `KERAS_BACKEND`, set above, before its own config file. Keras
# itself is imported where a test needs it, not here: pytest-xdist's
# controller loads this file too, runs no test, and would spend 4-7 CPU-s
# importing Keras and its backend before starting the workers.
BACKEND = os.environ["KERAS_BACKEND"]


def pytest_report_header(config):
    from importlib.metadata import version

    return f"keras backend: {BACKEND} (keras {version('keras')})"


def _reason(marker, default):
    return marker.kwargs.get("reason") or (
        marker.args[0] if marker.args else default
    )


# The files that take longest in CI (.ci/test's --durations lists), about
# longest first; a file that is skipped on a backend costs nothing there.
# .ci/test's two workers take a file each in the order collected (`--dist
# loadfile --no-loadscope-reorder`): xdist's own order, most tests first,
# put these files of few, long tests last, where one left a worker
# running it alone for minutes while the other had finished.
LONGEST_FIRST = (
    "tests/test_benchmarks.py",
    "tests/test_auto_micro_batch.py",
    "tests/test_examples.py",
    "tests/test_distribute.py",
    "tests/test_memory.py",
    "tests/test_robustness.py",
    "tests/test_jax_processes.py",
    "tests/test_low_precision.py",
    "tests/test_auto.py",
    "tests/test_micro_batch.py",
    "tests/test_keras_hub.py",
    "tests/test_sharding.py",
    "tests/test_jax_devices.py",
    "tests/test_window_saving.py",
)


def _longest_first(items):
    """`items` by file: `LONGEST_FIRST`'s, then the others by number of
    tests, most first (as xdist orders them); each file's own order kept."""
    files = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    order = sorted(
        files, key=lambda name: (rank.get(name, len(rank)), -len(files[name]))
    )
    items[:] = [item for name in order for item in files[name]]


def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # A pytest-xdist worker.
        _longest_first(items)
    if BACKEND == "tensorflow":
        return
    for item in items:
        marker = item.get_closest_marker("tensorflow_only")
        if marker is not None:
            reason = _reason(marker, "TensorFlow only")
            item.add_marker(
                pytest.mark.skip(reason=f"{reason} (backend: {BACKEND})")
            )
        marker = item.get_closest_marker("full_run_only")
        if marker is not None:
            reason = _reason(marker, "covered by another case")
            item.add_marker(
                pytest.mark.skip(
                    reason=f"trimmed from the {BACKEND} run: {reason}"
                )
            )


def pytest_collection_finish(session):
    # What is alive once the tests are collected (Keras, the backend, the
    # test modules, pytest: millions of objects that live as long as the
    # process) out of Python's garbage collector's reach: its full
    # collections, automatic and below, then scan only what the tests
    # made. TensorFlow's tests/test_model.py and test_construction.py:
    # 124-128 CPU-s without, 111-116 with; PyTorch's test_auto.py and
    # test_construction.py 17.1, 14.9; JAX's unchanged.
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_keras_state():
    import keras

    # Without Python's full garbage collection: in a process that holds
    # TensorFlow, KerasHub and the test suite it takes 0.3 to 1 s, which
    # per test was a third of the run. Once per module instead (below).
    keras.backend.clear_session(free_memory=False)
    keras.utils.set_random_seed(0)
    yield


@pytest.fixture(autouse=True, scope="module")
def _collect_garbage():
    # The models a module made, freed before the next module runs.
    yield
    gc.collect()


@pytest.fixture
def report_diff(request):
    """Records a measured max weight difference for the run's summary."""

    def record(value, label=None):
        # On the test's report: with pytest-xdist (.ci/test) the summary is
        # written by the controller, which runs no test itself.
        request.node.user_properties.append(
            ("equivalence", (label or request.node.name, float(value)))
        )

    return record


@pytest.fixture(autouse=True)
def _float64_verdicts(request):
    # `_helpers.FLOAT64_VERDICTS` gains a line where a comparison fell back
    # to a float64 replay; carried on the report, as `report_diff`'s.
    from _helpers import FLOAT64_VERDICTS

    before = len(FLOAT64_VERDICTS)
    yield
    for verdict in FLOAT64_VERDICTS[before:]:
        request.node.user_properties.append(("float64_verdict", verdict))


def _recorded(terminalreporter, kind):
    found = []
    for reports in terminalreporter.stats.values():
        for report in reports:
            if getattr(report, "when", None) != "teardown":
                continue
            found += [v for k, v in report.user_properties if k == kind]
    return found


def pytest_terminal_summary(terminalreporter):
    verdicts = _recorded(terminalreporter, "float64_verdict")
    if verdicts:
        # Where a plain model's float32 rounding on this platform put it
        # more than the tolerance from AccumModel (tests/_helpers.py).
        terminalreporter.section(
            f"judged against a float64 replay on {BACKEND}"
        )
        for verdict in verdicts:
            terminalreporter.write_line(verdict)
    equivalence = _recorded(terminalreporter, "equivalence")
    if not equivalence:
        return
    terminalreporter.section(
        f"equivalence with plain large-batch training on {BACKEND}: "
        "max |difference|"
    )
    for label, value in equivalence:
        terminalreporter.write_line(f"{value:10.3e}  {label}")
