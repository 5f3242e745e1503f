"""What the TensorFlow timing benchmarks share: data, models, `fit` timed
in process CPU time, and the machine's description.

Imported by `bench_throughput.py`, `bench_noise_overhead.py` and
`bench_window_positions.py` (none imports another script).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
import tensorflow as tf

import keras_accum

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _variants import MODELS, compiled

ROOT = Path(__file__).resolve().parents[1]


# -- Models -------------------------------------------------------------------


def data(model_name, samples):
    rng = np.random.default_rng(0)
    _, _, shape, high = MODELS[model_name]()
    if model_name == "transformer":
        x = rng.integers(0, high, size=(samples, *shape)).astype("int32")
    else:
        x = rng.normal(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y


def build(model_name, variant, k, jit, spe):
    keras.utils.set_random_seed(0)
    inputs, outputs, _, _ = MODELS[model_name]()
    return compiled(
        inputs, outputs, variant, k, jit_compile=jit, steps_per_execution=spe
    )


# -- Timing -------------------------------------------------------------------


def dataset(x, y, batch):
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        batch, drop_remainder=True
    )
    return ds.cache().repeat().prefetch(tf.data.AUTOTUNE)


def time_fit(model, ds, steps, callbacks=None):
    """(wall seconds, CPU seconds of all the process's threads)."""
    wall, cpu = time.perf_counter(), time.process_time()
    model.fit(
        ds, epochs=1, steps_per_epoch=steps, verbose=0, callbacks=callbacks
    )
    return time.perf_counter() - wall, time.process_time() - cpu


def machine():
    gpus = tf.config.list_physical_devices("GPU")
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpu": [
            tf.config.experimental.get_device_details(g).get(
                "device_name", g.name
            )
            for g in gpus
        ],
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_accum": keras_accum.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }
