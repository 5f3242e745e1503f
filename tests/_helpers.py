"""Shared builders for the equivalence tests.

Every equivalence test trains two models from the same initial weights on
the same data in the same order: a plain `keras.Model` at batch `B * k` and
an `AccumModel` at batch `B` with `accum_steps=k`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np

import keras_accum


def regression_data(n=70, features=5, outputs=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, outputs)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(n, outputs))).astype("float32")
    return x, y


def classification_data(n=70, features=6, classes=4, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes)).astype("float32")
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1)
    return x, y.astype("int32")


def batch_norm_data(shape, n=70, seed=0):
    rng = np.random.default_rng(seed)
    # Far from the initial moving statistics (0 and 1), unevenly scaled.
    x = 3.0 + rng.normal(size=(n, *shape)) * np.arange(1, shape[-1] + 1)
    y = rng.normal(size=(n, 1))
    return x.astype("float32"), y.astype("float32")


def batch_norm_model(model_cls, norm_cls, shape, **kwargs):
    """Two `norm_cls` layers: on the inputs, and on a dense layer's
    activations; compiled with learning rate 0."""
    keras.utils.set_random_seed(3)
    inputs = keras.Input(shape)
    normalized = keras.layers.Flatten()(norm_cls(momentum=0.5)(inputs))
    # The second one is not after the first: micro-batch normalization
    # would change its inputs (see the layer's docstring).
    hidden = keras.layers.Dense(6, activation="tanh")(
        keras.layers.Flatten()(inputs)
    )
    hidden = norm_cls(momentum=0.8)(hidden)
    x = keras.layers.Concatenate()([normalized, hidden])
    outputs = keras.layers.Dense(1)(x)
    model = model_cls(inputs, outputs, **kwargs)
    # Weights fixed, so the second layer's inputs are too: the moving
    # statistics can then be compared exactly.
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    return model


def mlp(model_cls=keras.Model, features=5, outputs=3, seed=1, **kwargs):
    """A small MLP, identical weights for the same `seed`."""
    keras.utils.set_random_seed(seed)
    layer_kwargs = kwargs.pop("layer_kwargs", {})
    activation = kwargs.pop("activation", None)
    inputs = keras.Input((features,))
    hidden = keras.layers.Dense(8, activation="tanh", **layer_kwargs)(inputs)
    outputs = keras.layers.Dense(
        outputs, activation=activation, **layer_kwargs
    )(hidden)
    return model_cls(inputs, outputs, **kwargs)


def accum_mlp(accum_steps, **kwargs):
    return mlp(keras_accum.AccumModel, accum_steps=accum_steps, **kwargs)


class UpdateRecorder(keras.callbacks.Callback):
    """Records the weights after every optimizer update.

    For an `AccumModel` only batches that end a window change
    `optimizer.iterations`; those are the updates to compare.
    """

    def __init__(self):
        super().__init__()
        self.updates = []
        self._last = 0

    def on_train_batch_end(self, batch, logs=None):
        self._record()

    def on_epoch_end(self, epoch, logs=None):
        self._record()

    def _record(self):
        iterations = int(self.model.optimizer.iterations.numpy())
        if iterations != self._last:
            self._last = iterations
            self.updates.append(
                (iterations, [w.copy() for w in self.model.get_weights()])
            )


def max_weight_diff(a, b):
    return max(
        float(np.max(np.abs(u - v)))
        for u, v in zip(a.get_weights(), b.get_weights(), strict=True)
    )


def assert_same_weights(a, b, atol=1e-6, rtol=1e-5):
    for u, v in zip(a.get_weights(), b.get_weights(), strict=True):
        np.testing.assert_allclose(u, v, atol=atol, rtol=rtol)


def train_pair(
    plain,
    accum,
    x,
    y,
    batch_size,
    accum_steps,
    epochs=2,
    compare_each_update=True,
    atol=1e-6,
    **fit_kwargs,
):
    """Fits both models; asserts equal updates; returns the max diff."""
    plain_rec, accum_rec = UpdateRecorder(), UpdateRecorder()
    plain_hist = plain.fit(
        x,
        y,
        batch_size=batch_size * accum_steps,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[plain_rec],
        **fit_kwargs,
    )
    accum_hist = accum.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[accum_rec],
        **fit_kwargs,
    )
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    if compare_each_update:
        assert [i for i, _ in accum_rec.updates] == [
            i for i, _ in plain_rec.updates
        ]
        for (_, wa), (_, wp) in zip(
            accum_rec.updates, plain_rec.updates, strict=True
        ):
            for u, v in zip(wa, wp, strict=True):
                np.testing.assert_allclose(u, v, atol=atol, rtol=1e-5)
    assert_same_weights(plain, accum, atol=atol)
    return max_weight_diff(plain, accum), plain_hist, accum_hist


def train_to_an_open_window(model, x, y, batch_size):
    """Adam on 70 samples, `accum_steps=4`, "carry": 2 updates, 1 open.

    What each backend does before saving a model for another one
    (test_backends.py).
    """
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)


def continue_one_epoch(model, x, y, batch_size):
    """The weights after one more epoch."""
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model.get_weights()


def numpy_weights(model, seed=1):
    """Sets the weights from numpy's generator: the same on every backend.

    Keras's initialisers draw from the backend's own generator, so `mlp`'s
    weights for one seed differ between backends.
    """
    rng = np.random.default_rng(seed)
    model.set_weights(
        [
            rng.normal(scale=0.5, size=w.shape).astype("float32")
            for w in model.get_weights()
        ]
    )


def tensorboard_scalars(directory, tag):
    """`(step, value)` of the scalars `tag` in the event files there."""
    import tensorflow as tf

    scalars = []
    for path in sorted(Path(directory).glob("events.out.tfevents.*")):
        for record in tf.data.TFRecordDataset(str(path)):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                if value.tag == tag:
                    number = tf.make_ndarray(value.tensor)
                    scalars.append((int(event.step), float(number)))
    return scalars


def run_in_fresh_process(args, env):
    """Runs `python *args` in a fresh process; returns its RESULTS JSON.

    For what one process cannot hold: `tf.distribute`'s logical devices
    and workers (test_distribute.py), Keras on JAX beside TensorFlow
    (test_embeddings.py). The script prints one line `RESULTS {...}`.
    """
    result = subprocess.run(
        [sys.executable, *map(str, args)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(
        (x for x in result.stdout.splitlines() if x.startswith("RESULTS ")),
        None,
    )
    assert line is not None, result.stdout[-3000:] + result.stderr[-3000:]
    return json.loads(line[len("RESULTS ") :])
