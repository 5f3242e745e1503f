"""TensorFlow's graph step: its allocator peak above the persistent state.

    python _tf_graph_memory_worker.py

For `test_memory.py`, in a fresh process: the executor's threads must be
set before TensorFlow starts. One thread each makes the graph executor run
its ops one at a time. Even so, the steady step's peak is one of two
values from process to process (measured for `AccumModel`: 129 or 161 MiB
with P = 96 MiB; a plain step: 128-130 MiB), and a free executor moved it
by up to 40% of the weights' size.
Prints `RESULTS {"p": ..., "plain": ..., "accum": ...}` in bytes.
"""

from __future__ import annotations

import json
import os

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum  # noqa: E402


def wide_mlp(model_cls, **kwargs):
    """96 MiB of weights, little else: the weights dominate the step."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2048,))
    hidden = keras.layers.Dense(4096, activation="relu")(inputs)
    hidden = keras.layers.Dense(4096, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def step_peak(model, x, y):
    info = tf.config.experimental.get_memory_info
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    # A first window: optimizer slots, accumulators, the traced step.
    model.fit(x[:64], y[:64], batch_size=16, verbose=0)
    peaks = []
    for _ in range(4):
        tf.config.experimental.reset_memory_stats("CPU:0")
        held = info("CPU:0")["current"]
        model.fit(x, y, batch_size=16, verbose=0)
        peaks.append(info("CPU:0")["peak"] - held)
    # The first full `fit` can peak one buffer higher (seen: 192 MiB, then
    # 161 in every later one); the median of the rest is the steady step.
    return float(np.median(peaks[1:]))


def main():
    rng = np.random.default_rng(0)
    x = rng.random((128, 2048), dtype=np.float32)
    y = rng.integers(0, 10, size=(128,))
    plain = step_peak(wide_mlp(keras.Model), x, y)
    model = wide_mlp(keras_accum.AccumModel, accum_steps=4)
    accum = step_peak(model, x, y)
    p = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    print("RESULTS " + json.dumps({"p": p, "plain": plain, "accum": accum}))


if __name__ == "__main__":
    main()
