"""What the memory benchmarks share: models, readings, measured processes.

`bench_memory.py`, `bench_data_memory.py` and `bench_gpu_memory.py` run
each measurement in a fresh process (the script itself with `--child`),
so that no run's memory carries into the next. This module holds what
those processes and the scripts that start them have in common. It imports
no Keras at import time: a measured process sets its backend first.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# (variant, k) compared on each model, at micro-batch B.
CONFIGS = [
    ("plain", 1),
    ("accum", 4),
    ("accum", 16),
    ("accum", 64),
    ("keras_ga", 16),
    ("large", 4),
    ("large", 16),
]

# `fit` on in-memory arrays: the CNN at B = 32 and this k, for n images.
DATA_K = 4
DATA_BATCH = 32
DATA_SAMPLES = (1024, 4096, 16384)
DATA_VARIANTS = ("plain", "accum")


def child_env():
    """A measured process's defaults, set before Keras is imported."""
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # Allocator statistics on every CPU (TensorFlow keeps them only as the
    # BFC allocator, its default only where it enables oneDNN).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    # On JAX or PyTorch, no TensorFlow in the process measured.
    from _workers import without_tensorflow

    without_tensorflow()


# -- Models -------------------------------------------------------------------


def wide_mlp():
    """Memory mostly parameters: 1024-4096-4096-10 (P = 80 MiB)."""
    import keras

    inputs = keras.Input((1024,))
    x = keras.layers.Dense(4096, activation="relu")(inputs)
    x = keras.layers.Dense(4096, activation="relu")(x)
    return inputs, keras.layers.Dense(10)(x), (1024,)


def cnn():
    """Memory mostly activations: a small CNN on 64 x 64 images."""
    import keras

    inputs = keras.Input((64, 64, 3))
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(inputs)
    x = keras.layers.Conv2D(64, 3, padding="same", activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(128, 3, padding="same", activation="relu")(x)
    x = keras.layers.GlobalAveragePooling2D()(x)
    return inputs, keras.layers.Dense(10)(x), (64, 64, 3)


MODELS = {"wide_mlp": wide_mlp, "cnn": cnn}


def _compiled(inputs, outputs, variant, k, **compile_kwargs):
    # Imports Keras: only once the measured process has chosen a backend.
    from _variants import compiled

    return compiled(inputs, outputs, variant, k, **compile_kwargs)


def variant_model(model_name, variant, micro_batch, k, **compile_kwargs):
    """(model, x, y, P): the compiled variant, one batch, P in bytes.

    The batch is B·k for `large`, B otherwise; P is the float32 size of
    the trainable weights.
    """
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    inputs, outputs, shape = MODELS[model_name]()
    model = _compiled(inputs, outputs, variant, k, **compile_kwargs)
    batch = micro_batch * (k if variant == "large" else 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch).astype("int32")
    params = sum(int(np.prod(w.shape)) for w in model.trainable_weights) * 4
    return model, x, y, params


def data_model(variant, samples, **compile_kwargs):
    """(model, x, y): the CNN variant at `DATA_K`, and `samples` images."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(0)
    inputs, outputs, shape = cnn()
    model = _compiled(inputs, outputs, variant, DATA_K, **compile_kwargs)
    rng = np.random.default_rng(0)
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, size=samples).astype("int32")
    return model, x, y


def fit_arrays(model, x, y, steps):
    """`fit` on the in-memory arrays, `DATA_BATCH` samples a step."""
    model.fit(x, y, batch_size=DATA_BATCH, steps_per_epoch=steps, verbose=0)


def forever(x, y):
    """The batch (x, y) again and again: `fit` from a Python generator."""
    while True:
        yield x, y


# -- The resident set ---------------------------------------------------------


def read_status(field):
    """`field` of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def reset_peak_rss():
    """Resets VmHWM, the peak resident set, to the resident set now."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def rss_growth(fit):
    """How far the peak resident set rose above the resident set in `fit()`."""
    before = read_status("VmRSS")
    reset_peak_rss()
    fit()
    return read_status("VmHWM") - before


# -- Measured processes -------------------------------------------------------


def run_child(script, child_args, env, timeout):
    """Runs `script *child_args`: its last line's JSON, or {"error": ...}."""
    try:
        out = subprocess.run(
            [sys.executable, str(script), *map(str, child_args)],
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if out.returncode != 0:
        return {"error": out.stderr.strip()[-3000:] or f"rc {out.returncode}"}
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no JSON: {out.stdout[-500:]} {out.stderr[-2000:]}"}


def measure_on_cpu(script, child_args, backend):
    """One measured process on `backend`, on the CPU; fails if it failed."""
    env = {**os.environ, "KERAS_BACKEND": backend, "JAX_PLATFORMS": "cpu"}
    result = run_child(script, child_args, env, timeout=900)
    if "error" in result:
        name = Path(script).name
        raise RuntimeError(f"{name} {child_args}: {result['error']}")
    return result


def spread(name, values):
    """{name: median, name_min: min, name_max: max} (None if no values)."""
    values = list(values)
    if not values:
        return dict.fromkeys((name, f"{name}_min", f"{name}_max"))
    return {
        name: statistics.median(values),
        f"{name}_min": min(values),
        f"{name}_max": max(values),
    }


def parse_configs(text):
    """`plain:1,accum:4` as [("plain", 1), ("accum", 4)]; None: CONFIGS."""
    if not text:
        return CONFIGS
    return [(v, int(k)) for v, k in (c.split(":") for c in text.split(","))]


def results_path(stem, backend):
    """results/<stem>.json on TensorFlow, <stem>_<backend>.json otherwise."""
    suffix = "" if backend == "tensorflow" else f"_{backend}"
    return RESULTS / f"{stem}{suffix}.json"


def write_results(path, backend, repeats, rows):
    """Writes {"backend", "repeats", "rows"} as JSON to `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report = {"backend": backend, "repeats": repeats, "rows": rows}
    path.write_text(json.dumps(report, indent=1))
    print(f"wrote {path}")
