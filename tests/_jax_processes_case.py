"""The training case of `test_jax_processes.py`, shared by the test (one
process, the plain large batch) and `_jax_processes_worker.py` (each of
two processes, `AccumModel`)."""

import keras
import numpy as np

import keras_accum

# Global micro-batch B (B / 2 per process), window length K, samples N:
# 11 micro-batches an epoch, so that with `partial_window="carry"` windows
# cross the epoch boundary: 3 updates and 2 micro-batches open after the
# first epoch, 7 updates and 1 open after the second.
B, K, N = 8, 3, 88
FEATURES, HIDDEN, CLASSES = 8, 16, 3


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(N, FEATURES)).astype("float32")
    y = rng.integers(0, CLASSES, size=N).astype("int32")
    return x, y


def local_half(array, process):
    """What process `process` feeds `fit` at batch B / 2: its half of
    every global micro-batch of B, in order."""
    half = B // 2
    rows = [
        np.arange(start + process * half, start + (process + 1) * half)
        for start in range(0, N, B)
    ]
    return array[np.concatenate(rows)]


def build(accum_steps=None):
    """The plain model, or with `accum_steps` the `AccumModel`."""
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(HIDDEN, activation="tanh")(inputs)
    outputs = keras.layers.Dense(CLASSES)(hidden)
    if accum_steps is None:
        model = keras.Model(inputs, outputs)
    else:
        model = keras_accum.AccumModel(
            inputs, outputs, accum_steps=accum_steps, partial_window="carry"
        )
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def initial_weights():
    rng = np.random.default_rng(0)
    shapes = [(FEATURES, HIDDEN), (HIDDEN,), (HIDDEN, CLASSES), (CLASSES,)]
    return [(0.5 * rng.normal(size=s)).astype("float32") for s in shapes]
