"""`micro_batch_size` under `tf.distribute.MirroredStrategy` on two logical
CPUs, against a plain `keras.Model` at the same global batch; run in a
fresh process by `test_micro_batch.py` (the devices must be set up before
TensorFlow starts). Prints `RESULTS {...}`."""

import json

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from _helpers import assert_equivalent  # noqa: E402

import keras_accum  # noqa: E402


def build(cls, **kwargs):
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = keras.layers.Dense(2)(hidden)
    model = cls(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"]
    )
    return model


def main():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = rng.normal(size=(70, 2)).astype("float32")
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    with strategy.scope():
        accum = build(keras_accum.AccumModel, micro_batch_size=7)
    plain = build(keras.Model)
    common = {"batch_size": 32, "epochs": 2, "shuffle": False, "verbose": 0}
    accum_history = accum.fit(x, y, **common)
    plain_history = plain.fit(x, y, **common)
    diff = assert_equivalent(accum, plain.get_weights())
    logs = {
        key: float(
            np.max(np.abs(np.subtract(value, plain_history.history[key])))
        )
        for key, value in accum_history.history.items()
    }
    print(
        "RESULTS "
        + json.dumps(
            {
                "replicas": strategy.num_replicas_in_sync,
                "diff": diff,
                "updates": int(accum.optimizer.iterations.numpy()),
                "plain_updates": int(plain.optimizer.iterations.numpy()),
                "logs": logs,
            }
        )
    )


if __name__ == "__main__":
    main()
