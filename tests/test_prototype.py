"""The TF1 prototype's checks, ported: what the project was founded on.

The prototype showed (1) that gradients accumulated one example at a time
equal the full-batch gradient to < 1e-7 for 1, 10 and 64 examples, and
(2) that batch 64 x 1 step and batch 1 x 64 steps train to the same
accuracy and the same loss mean and standard deviation.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from _helpers import (
    LargeBatch,
    UpdateRecorder,
    assert_equivalent,
    float64,
)

import keras_accum

pytestmark = pytest.mark.tensorflow_only(
    reason="the TF1 prototype's checks use tf.GradientTape"
)

FEATURES, CLASSES = 20, 3


def data(n, seed=0):
    # Pixel-like inputs in [0, 1], as the prototype's MNIST images were.
    rng = np.random.default_rng(seed)
    x = rng.uniform(size=(n, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, CLASSES)).astype("float32")
    y = np.argmax((x - 0.5) @ w + 0.3 * rng.normal(size=(n, CLASSES)), axis=1)
    return x, y.astype("int32")


def softmax_regression(model_cls=keras.Model, seed=42, **kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((FEATURES,))
    outputs = keras.layers.Dense(CLASSES, activation="softmax")(inputs)
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss="sparse_categorical_crossentropy",
        metrics=["accuracy"],
    )
    return model


def test_same_initial_weights_after_recreating_the_model():
    first = softmax_regression(keras_accum.AccumModel, accum_steps=4)
    second = softmax_regression(keras.Model)
    for u, v in zip(first.get_weights(), second.get_weights(), strict=True):
        np.testing.assert_array_equal(u, v)


def test_accumulators_mirror_the_trainable_variables():
    model = softmax_regression(keras_accum.AccumModel, accum_steps=4)
    x, y = data(8)
    model.fit(x, y, batch_size=1, verbose=0)
    accumulators = model.accumulators
    assert len(accumulators) == len(model.trainable_weights) == 2
    for acc, var in zip(accumulators, model.trainable_weights, strict=True):
        assert tuple(acc.shape) == tuple(var.shape)
        assert acc.dtype == "float32"
        assert not acc.trainable
    # 8 micro-batches, windows of 4: both applied, none open.
    assert model.mini_step == 0
    assert int(model.optimizer.iterations) == 2
    # A closed window's sum is not cleared: the next window's first
    # micro-batch overwrites it rather than adding to it.
    assert any(np.any(acc.numpy() != 0) for acc in accumulators)
    model.partial_window = "carry"
    model.fit(x[:1], y[:1], batch_size=1, verbose=0)
    assert model.mini_step == 1
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            keras.losses.sparse_categorical_crossentropy(
                y[:1], model(x[:1], training=True)
            )
        )
    gradients = tape.gradient(loss, model.trainable_weights)
    for acc, grad in zip(accumulators, gradients, strict=True):
        # One sample: weight 1, so the accumulator is that gradient alone.
        np.testing.assert_allclose(acc.numpy(), grad.numpy(), atol=1e-7)


@pytest.mark.parametrize("examples", [1, 10, 64])
def test_accumulated_gradient_equals_full_batch_gradient(examples, report_diff):
    x, y = data(examples)
    # A window longer than the data, carried past the epoch's end, stays
    # open to be inspected.
    model = softmax_regression(
        keras_accum.AccumModel, accum_steps=examples + 1, partial_window="carry"
    )
    model.fit(x, y, batch_size=1, shuffle=False, verbose=0)
    assert model.mini_step == examples
    assert int(model.optimizer.iterations) == 0
    # Each one-example micro-batch weighs 1: the window mean is sum / count.
    accumulated = [acc.numpy() / examples for acc in model.accumulators]

    weights = softmax_regression(keras.Model).get_weights()

    def full_batch_gradient():
        reference = softmax_regression(keras.Model)
        reference.set_weights(weights)
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(
                y, reference(x, training=True)
            )
            loss = tf.reduce_mean(loss)
        gradient = tape.gradient(loss, reference.trainable_weights)
        return [g.numpy() for g in gradient]

    full_batch = full_batch_gradient()
    with float64():  # Exact arithmetic, for a platform that rounds coarsely.
        exact = full_batch_gradient()
    diff = assert_equivalent(
        accumulated, full_batch, atol=1e-7, rtol=0, exact=exact
    )
    report_diff(diff)


def _pseudo_batch_losses(updates, initial, x, y, window):
    """The loss each update saw: its window, under the weights before it."""
    model = softmax_regression(keras.Model)
    losses = []
    weights = initial
    for i, (_, after) in enumerate(updates):
        model.set_weights(weights)
        xs, ys = (
            x[i * window : (i + 1) * window],
            y[i * window : (i + 1) * window],
        )
        # What `evaluate` at batch `window` returns, without its set-up
        # (iterator, callbacks, metrics) once per window.
        losses.append(
            float(
                keras.ops.mean(
                    keras.losses.sparse_categorical_crossentropy(
                        ys, model(xs, training=False)
                    )
                )
            )
        )
        weights = after
    return np.array(losses)


def test_batch_64_x_1_equals_batch_1_x_64(report_diff):
    updates, window = 50, 64
    x, y = data(updates * window)
    large = LargeBatch(softmax_regression(keras.Model))
    initial = large.model.get_weights()
    small = softmax_regression(keras_accum.AccumModel, accum_steps=window)
    small_rec = UpdateRecorder()
    large.fit(x, y, batch_size=window, shuffle=False, verbose=0)
    small.fit(
        x, y, batch_size=1, shuffle=False, verbose=0, callbacks=[small_rec]
    )
    assert len(small_rec.updates) == len(large.updates.updates) == updates

    diff = assert_equivalent(small, large, atol=1e-5)
    report_diff(diff)
    # The same predictions, but where rounding tips a sample at a class
    # boundary (on a platform that rounds the plain model differently):
    # one sample in 3,200 at most.
    _, large_acc = large.model.evaluate(x, y, verbose=0)
    _, small_acc = small.evaluate(x, y, verbose=0)
    assert abs(small_acc - large_acc) <= 1 / len(x)

    def losses(updates):
        return _pseudo_batch_losses(updates, initial, x, y, window)

    large_losses = losses(large.updates.updates)
    small_losses = losses(small_rec.updates)

    def exact(statistic):
        # The float64 run's updates, evaluated alike: only if needed.
        return lambda: [statistic(losses(large.float64()[1]))]

    for statistic, rtol in ((np.mean, 1e-5), (np.std, 1e-4)):
        assert_equivalent(
            [statistic(small_losses)],
            [statistic(large_losses)],
            atol=0,
            rtol=rtol,
            exact=exact(statistic),
        )
    # Training did something: the loss fell.
    assert large_losses[-10:].mean() < 0.8 * large_losses[:10].mean()
