"""TensorFlow's graph step: the memory its tensors need beyond the state.

    python _tf_graph_memory_worker.py

For `test_memory.py`, in a fresh process (the executor's threads must be
set before TensorFlow starts; one each, so that ops run one at a time in
an order that does not vary). For each model, plain and `AccumModel`, one
window's `fit` runs under TensorFlow's profiler, whose allocator events
give each tensor's requested bytes: their running sum's peak above the
state held at the start is the step's transient peak, the same in every
process to within a few small buffers.

The allocator's own in-use peak (`get_memory_info`) also counts the
unused tail of a free block handed out whole: its allocator gives a
block of less than twice the request unsplit. That tail varies by
process with where earlier buffers were freed (measured here: +0 to
+0.66 P for the same step), so it is reported, not tested.

Prints `RESULTS {"<model>": {"p": ..., "plain": ..., "accum": ...,
"plain_in_use": ..., "accum_in_use": ...}, ...}` in bytes.
"""

from __future__ import annotations

import glob
import json
import os
import tempfile

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

tf.config.threading.set_inter_op_parallelism_threads(1)
tf.config.threading.set_intra_op_parallelism_threads(1)

import keras  # noqa: E402
import numpy as np  # noqa: E402
from tensorflow.tsl.profiler.protobuf import xplane_pb2  # noqa: E402

import keras_accum  # noqa: E402

FEATURES = 1024


def wide_mlp(model_cls, **kwargs):
    """96 MiB of weights in two large kernels: one dominates the update."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((2048,))
    hidden = keras.layers.Dense(4096, activation="relu")(inputs)
    hidden = keras.layers.Dense(4096, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def deep_mlp(model_cls, **kwargs):
    """24 MiB of weights in six equal kernels, as a stack of blocks has:
    a plain step holds about one layer's gradient at a time."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((FEATURES,))
    hidden = inputs
    for _ in range(6):
        hidden = keras.layers.Dense(FEATURES, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def requested_peak(logdir):
    """The peak of the running sum of requested bytes in a profile."""
    (path,) = glob.glob(f"{logdir}/**/*.xplane.pb", recursive=True)
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    events = []
    for plane in space.planes:
        names = {k: v.name for k, v in plane.event_metadata.items()}
        stats = {k: v.name for k, v in plane.stat_metadata.items()}
        for line in plane.lines:
            for event in line.events:
                name = names[event.metadata_id]
                if name not in ("MemoryAllocation", "MemoryDeallocation"):
                    continue
                size = next(
                    s.int64_value or s.uint64_value
                    for s in event.stats
                    if stats.get(s.metadata_id) == "requested_bytes"
                )
                sign = 1 if name == "MemoryAllocation" else -1
                time = line.timestamp_ns * 1000 + event.offset_ps
                events.append((time, sign * size))
    if not events:
        raise RuntimeError(f"No allocator events in {path}")
    running = peak = 0
    for _, change in sorted(events):
        running += change
        peak = max(peak, running)
    return peak


def step_peaks(model, x, y):
    info = tf.config.experimental.get_memory_info
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    # A first window: optimizer slots, accumulators, the traced step.
    model.fit(x, y, batch_size=16, verbose=0)
    model.fit(x, y, batch_size=16, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    held = info("CPU:0")["current"]
    with tempfile.TemporaryDirectory() as logdir:
        tf.profiler.experimental.start(logdir)
        model.fit(x, y, batch_size=16, verbose=0)
        tf.profiler.experimental.stop()
        requested = requested_peak(logdir)
    return requested, info("CPU:0")["peak"] - held


def main():
    rng = np.random.default_rng(0)
    results = {}
    for name, build, features in (
        ("wide", wide_mlp, 2048),
        ("deep", deep_mlp, FEATURES),
    ):
        # One window of 4 micro-batches of 16.
        x = rng.random((64, features), dtype=np.float32)
        y = rng.integers(0, 10, size=(64,))
        plain, plain_in_use = step_peaks(build(keras.Model), x, y)
        model = build(keras_accum.AccumModel, accum_steps=4)
        accum, accum_in_use = step_peaks(model, x, y)
        p = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
        results[name] = {
            "p": p,
            "plain": plain,
            "accum": accum,
            "plain_in_use": plain_in_use,
            "accum_in_use": accum_in_use,
        }
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
