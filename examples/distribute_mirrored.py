"""Accumulation across replicas with `tf.distribute.MirroredStrategy`.

Uses every GPU of the machine, or, without GPUs, splits the CPU into two
logical devices so the example runs anywhere. Global micro-batch 64 over
R replicas (64 / R each) with `accum_steps=4` trains like batch 256 on one
device; the script checks that against a plain single-device model.

    python examples/distribute_mirrored.py
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

# --8<-- [start:setup]
import tensorflow as tf

if not tf.config.list_physical_devices("GPU"):
    # Two logical CPU devices stand in for GPUs. Only possible before
    # TensorFlow starts: in a process that already ran TensorFlow (a
    # notebook), the strategy gets the one CPU device instead.
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
    except RuntimeError:
        pass

import keras
import numpy as np

import keras_accum


def build(model_cls, **kwargs):
    keras.utils.set_random_seed(7)  # Same initial weights for both runs.
    inputs = keras.Input((20,))
    hidden = keras.layers.Dense(32, activation="relu")(inputs)
    outputs = keras.layers.Dense(4, activation="softmax")(hidden)
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-3, global_clipnorm=1.0),
        loss="sparse_categorical_crossentropy",
    )
    return model


# --8<-- [end:setup]


def main():
    # --8<-- [start:mirrored]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2000, 20)).astype("float32")
    y = rng.integers(0, 4, size=2000)

    devices = tf.config.list_logical_devices(
        "GPU"
    ) or tf.config.list_logical_devices("CPU")
    strategy = tf.distribute.MirroredStrategy([d.name for d in devices])
    with strategy.scope():  # Create and compile under the scope.
        model = build(keras_accum.AccumModel, accum_steps=4)
    # batch_size is the global micro-batch: 64 / replicas per device.
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=2)
    # --8<-- [end:mirrored]

    reference = build(keras.Model)
    reference.fit(x, y, batch_size=256, epochs=2, shuffle=False, verbose=0)
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            model.get_weights(), reference.get_weights(), strict=True
        )
    )
    print(f"replicas: {strategy.num_replicas_in_sync}")
    print(f"max |weight difference| from batch 256 on one device: {diff:.3e}")
    if diff > 1e-5:
        raise SystemExit("distributed accumulation diverged from large-batch")


if __name__ == "__main__":
    main()
