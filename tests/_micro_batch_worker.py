"""`micro_batch_size` under `tf.distribute.MirroredStrategy` on two logical
CPUs, against a plain `keras.Model` at the same global batch; run in a
fresh process by `test_micro_batch.py` (the devices must be set up before
TensorFlow starts), every case in one process. Prints `RESULTS {...}`:
each case's figures, or its traceback."""

import json
import traceback

import numpy as np
import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)

import keras  # noqa: E402
from _helpers import (  # noqa: E402
    LargeBatch,
    assert_equivalent,
    batches_taken_eagerly,
    eager_batches,
    mlp,
    regression_data,
)

# The out-of-memory layer (a real allocation refused) and its data, as
# test_auto_micro_batch.py injects them on one device.
from test_auto_micro_batch import _armed_fit, _oom_data, _oom_model  # noqa: E402

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


def split(strategy):
    """Arrays: each replica splits its part of every global batch of 32."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(70, 5)).astype("float32")
    y = rng.normal(size=(70, 2)).astype("float32")
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
    return {
        "diff": diff,
        "updates": int(accum.optimizer.iterations.numpy()),
        "plain_updates": int(plain.optimizer.iterations.numpy()),
        "logs": logs,
    }


def graph(strategy):
    """A `tf.data` pipeline: the batches the split train function (three
    steps per execution) and `keras.Model`'s (one: Keras's own fails
    under `MirroredStrategy` with more) take out of the distributed
    iterator eagerly."""
    x, y = regression_data(n=70)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
    with strategy.scope():
        accum = mlp(keras_accum.AccumModel, micro_batch_size=7)
        accum.compile(optimizer="adam", loss="mse", steps_per_execution=3)
        plain = mlp()
        plain.compile(optimizer="adam", loss="mse")
    reference = LargeBatch(plain)
    return {
        "eager": eager_batches(accum, data),
        "plain_eager": eager_batches(reference, data),
        "updates": int(accum.optimizer.iterations.numpy()),
        "diff": assert_equivalent(accum, reference),
    }


def out_of_memory(strategy):
    """Three steps per execution; replica 1's second micro-batch of 4 in
    the second step runs out of memory (a cost of 8 above 4.5): undone and
    redone at 2, and the call's third step runs after it."""
    x, y = _oom_data()
    x, y = np.concatenate([x, x[:16]]), np.concatenate([y, y[:16]])
    # Each global batch of 16 gives each replica 8 rows. Only rows 28 to
    # 31 cost (2 each): replica 1's second piece of the second batch.
    x[:, 0] = 0.0
    x[28:32, 0] = 2.0
    with strategy.scope():
        model = _oom_model(
            keras_accum.AccumModel, 4.5, allocate=True, micro_batch_size=4
        )
        model.compile(
            optimizer="adam",
            loss="mse",
            metrics=["mae"],
            steps_per_execution=3,
        )
    reference, expected, history, messages, taken = _armed_fit(
        model, x, y, during=batches_taken_eagerly()
    )
    logs = {
        key: float(np.max(np.abs(np.subtract(history.history[key], value))))
        for key, value in expected.history.items()
    }
    return {
        "eager": len(taken),
        "shrinks": [m for m in messages if "ran out of memory" in m],
        "updates": int(model.optimizer.iterations.numpy()),
        "diff": assert_equivalent(model, reference, update=2),
        "logs": logs,
        "choices": model.micro_batch_choices,
    }


def main():
    strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
    results = {"replicas": strategy.num_replicas_in_sync}
    for case in (split, graph, out_of_memory):
        try:
            results[case.__name__] = case(strategy)
        except Exception:  # noqa: BLE001 (reported to the test)
            results[case.__name__] = {"traceback": traceback.format_exc()}
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
