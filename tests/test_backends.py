"""What needs two backends, or a fresh process: a `.keras` file saved on
one backend and loaded on another, and what `import keras_accum` imports.

Everything else runs in this process under `KERAS_BACKEND` (the suite runs
once per backend, `.ci/test`). The TensorFlow run pairs TensorFlow with JAX
and with PyTorch, both ways; the JAX and PyTorch runs leave the pairs to it.
"""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import (
    accum_mlp,
    continue_one_epoch,
    regression_data,
    suite_xla_flags,
    train_to_an_open_window,
)

import keras_accum

BACKEND = keras.backend.backend()
PAIRED = pytest.mark.full_run_only(
    reason="the TensorFlow run pairs TensorFlow with JAX and with PyTorch"
)
TESTS = Path(__file__).parent
B = 8

# Run under the other backend in `directory` (argv[1]): loads ours, saves
# its own, and writes what it saw and what it trained to `.npz` files.
OTHER_SIDE = """
import sys
from pathlib import Path

import keras
import numpy as np
from _helpers import (
    accum_mlp, continue_one_epoch, regression_data, train_to_an_open_window
)

import keras_accum

directory = Path(sys.argv[1])
x, y = regression_data(n=70)
loaded = keras.saving.load_model(directory / "ours.keras")
seen = {
    "is_accum_model": isinstance(loaded, keras_accum.AccumModel),
    "mini_step": loaded.mini_step,
    "iterations": int(loaded.optimizer.iterations),
    "predictions": loaded.predict(x, verbose=0),
}
np.savez(directory / "loaded.npz", *continue_one_epoch(loaded, x, y, 8), **seen)
model = accum_mlp(4, partial_window="carry")
train_to_an_open_window(model, x, y, 8)
model.save(directory / "theirs.keras")
predictions = model.predict(x, verbose=0)
np.savez(
    directory / "saved.npz",
    *continue_one_epoch(model, x, y, 8),
    predictions=predictions,
)
"""


def _env(backend):
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHONPATH": os.pathsep.join(
            [str(TESTS), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
        ),
    }
    # Not the suite's devices; its quicker XLA compiles (tests/conftest.py),
    # which compile the JAX side's small steps in a fraction of the CPU.
    env["XLA_FLAGS"] = suite_xla_flags("xla_force_host_platform_device_count")
    return env


def _run(backend, *args, cwd=None):
    result = subprocess.run(
        [sys.executable, *args],
        env=_env(backend),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def test_import_brings_only_the_backend_in_use():
    # TensorFlow is optional: on JAX and PyTorch neither Keras nor the
    # package imports it.
    out = _run(
        BACKEND,
        "-c",
        "import sys, keras_accum; print('tensorflow' in sys.modules)",
    )
    assert out.split() == [str(BACKEND == "tensorflow")]


def _weights(npz):
    """The weights `np.savez` stored positionally, in order."""
    count = sum(name.startswith("arr_") for name in npz.files)
    return [npz[f"arr_{i}"] for i in range(count)]


@pytest.fixture(scope="module", params=["jax", "torch"])
def exchange(request, tmp_path_factory):
    """Our model, saved with a window open; the other backend's run."""
    directory = tmp_path_factory.mktemp(f"exchange_{request.param}")
    x, y = regression_data(n=70)
    model = accum_mlp(4, partial_window="carry")
    train_to_an_open_window(model, x, y, B)
    # Adam, 70 samples at 8, windows of 4: 2 updates, 1 micro-batch open.
    assert (model.mini_step, int(model.optimizer.iterations)) == (1, 2)
    model.save(directory / "ours.keras")
    predictions = model.predict(x, verbose=0)
    continued = continue_one_epoch(model, x, y, B)
    _run(request.param, "-c", OTHER_SIDE, str(directory), cwd=TESTS)
    return {
        "directory": directory,
        "x": x,
        "y": y,
        "predictions": predictions,
        "continued": continued,
    }


@PAIRED
def test_a_saved_model_loads_and_trains_on_the_other_backend(exchange):
    # The other backend gets the weights, the optimizer and the open
    # window, and its next epoch equals ours.
    loaded = np.load(exchange["directory"] / "loaded.npz")
    assert bool(loaded["is_accum_model"])
    assert (int(loaded["mini_step"]), int(loaded["iterations"])) == (1, 2)
    np.testing.assert_allclose(
        loaded["predictions"], exchange["predictions"], atol=1e-6
    )
    theirs = _weights(loaded)
    assert len(theirs) == len(exchange["continued"]) == 4
    for u, v in zip(theirs, exchange["continued"], strict=True):
        np.testing.assert_allclose(u, v, atol=1e-6)


@PAIRED
def test_the_other_backend_s_model_loads_and_trains_here(exchange):
    x, y = exchange["x"], exchange["y"]
    saved = np.load(exchange["directory"] / "saved.npz")
    loaded = keras.saving.load_model(exchange["directory"] / "theirs.keras")
    assert isinstance(loaded, keras_accum.AccumModel)
    assert (loaded.mini_step, int(loaded.optimizer.iterations)) == (1, 2)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), saved["predictions"], atol=1e-6
    )
    ours = continue_one_epoch(loaded, x, y, B)
    assert (loaded.mini_step, int(loaded.optimizer.iterations)) == (2, 4)
    for u, v in zip(ours, _weights(saved), strict=True):
        np.testing.assert_allclose(u, v, atol=1e-6)
