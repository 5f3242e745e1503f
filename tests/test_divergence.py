"""No silent divergence: cases that once trained a quietly different model.

Each test here failed on an earlier version (the figure it measured then is
in its docstring) and now either equals plain large-batch training or
fails loudly. The module runs under every backend.
"""

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    assert_equivalent,
    mlp,
    numpy_weights,
    regression_data,
    train_pair,
)

import keras_accum

BACKEND = keras.backend.backend()


def _sgd_momentum():
    return keras.optimizers.SGD(0.1, momentum=0.9)


def _pair(accum_steps=4, optimizer=_sgd_momentum, loss="mse", **kwargs):
    """A plain MLP and an `AccumModel` one with the same weights."""
    plain = mlp()
    accum = mlp(keras_accum.AccumModel, accum_steps=accum_steps, **kwargs)
    numpy_weights(plain)
    numpy_weights(accum)
    plain.compile(optimizer=optimizer(), loss=loss)
    accum.compile(optimizer=optimizer(), loss=loss)
    return plain, accum


# -- Phantom micro-batches -----------------------------------------------------


def _kept_samples():
    """96 samples of which a filter keeps every other one (48)."""
    x, y = regression_data(n=96)
    keep = np.arange(96) % 2 == 0
    return x, y, keep


def _filtered_dataset(batch_size):
    """Unknown length, static batch dimension: `filter` then
    `batch(drop_remainder=True)`."""
    import tensorflow as tf

    x, y, keep = _kept_samples()
    data = tf.data.Dataset.from_tensor_slices((x, y, keep))
    data = data.filter(lambda xs, ys, kept: kept)
    data = data.map(lambda xs, ys, kept: (xs, ys))
    return data.batch(batch_size, drop_remainder=True)


def _generator(batch_size, epochs):
    """The same micro-batches from a Python generator (unknown length)."""
    x, y, keep = _kept_samples()
    x, y = x[keep], y[keep]
    for _ in range(epochs):
        for start in range(0, len(x) - batch_size + 1, batch_size):
            yield x[start : start + batch_size], y[start : start + batch_size]


@pytest.mark.parametrize("source", ["tf.data", "generator"])
@pytest.mark.parametrize("partial_window", ["apply", "carry"])
def test_unknown_length_counts_only_real_micro_batches(
    source, partial_window, report_diff
):
    """Before: on TensorFlow, with a static batch dimension the call that
    finds the data exhausted counted an 8-sample micro-batch at each epoch
    end: max weight diff 2.9e-2 ("apply") and 1.4e-2 ("carry") here."""
    x, y, keep = _kept_samples()
    x, y = x[keep], y[keep]
    plain, accum = _pair(partial_window=partial_window)
    plain = LargeBatch(plain)
    if source == "tf.data":
        accum.fit(_filtered_dataset(8), epochs=2, verbose=0)
    else:
        # One pass over two epochs' batches; `fit` sees one long epoch.
        accum.fit(_generator(8, epochs=2), verbose=0)
    if partial_window == "apply" and source == "tf.data":
        # Each epoch's 6 micro-batches: windows of 4 and 2.
        plain.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    else:
        # 12 micro-batches in a row: 3 windows of 4.
        both = (np.concatenate([x, x]), np.concatenate([y, y]))
        plain.fit(*both, batch_size=32, shuffle=False, verbose=0)
    assert int(accum.optimizer.iterations) == int(
        plain.model.optimizer.iterations
    )
    assert accum.mini_step == 0
    report_diff(assert_equivalent(accum, plain))


@pytest.mark.skipif(
    BACKEND == "jax",
    reason="JAX raises no error for an out-of-range label (its one-hot of "
    "it is zeros, as in a plain JAX step): the case does not exist there",
)
@pytest.mark.parametrize("partial_window", ["apply", "carry"])
def test_failed_micro_batch_leaves_the_window_as_it_was(
    partial_window, report_diff
):
    """Before: an error in micro-batch 3 (a label out of range) left
    `mini_step=3` and its normalizer in the window while the accumulators
    held 2 micro-batches; continuing was 5.5e-2 from plain training."""
    x, _ = regression_data(n=64)
    y = (np.arange(64) % 4).astype("int32")
    bad = y.copy()
    bad[16:24] = 10  # Micro-batch 3 of 8 samples; 4 classes.
    loss = "sparse_categorical_crossentropy"
    plain = mlp(outputs=4, activation="softmax")
    accum = mlp(
        keras_accum.AccumModel,
        outputs=4,
        activation="softmax",
        accum_steps=4,
        partial_window=partial_window,
    )
    for model in (plain, accum):
        numpy_weights(model)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    plain = LargeBatch(plain)
    with pytest.raises(Exception, match="(?i)label|out of (range|bounds)"):
        accum.fit(x[:32], bad[:32], batch_size=8, shuffle=False, verbose=0)
    # The delivered micro-batches stay in the window; the failed one not.
    assert accum.mini_step == 2
    assert int(accum.optimizer.iterations) == 0
    accum.fit(x[32:], y[32:], batch_size=8, shuffle=False, verbose=0)
    accum.apply_partial_window()
    delivered = np.r_[0:16, 32:64]
    plain.fit(
        x[delivered], y[delivered], batch_size=32, shuffle=False, verbose=0
    )
    assert int(accum.optimizer.iterations) == int(
        plain.model.optimizer.iterations
    )
    report_diff(assert_equivalent(accum, plain))


@pytest.mark.parametrize("partial_window", ["apply", "carry"])
def test_fit_on_empty_arrays_applies_nothing(partial_window):
    """Before: `fit` on empty arrays after training re-applied the last
    window's leftovers (SGD with momentum moved the weights 7.5e-2)."""
    x, y = regression_data(n=40)
    plain, accum = _pair(partial_window=partial_window)
    plain.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    before = [w.copy() for w in accum.get_weights()]
    open_micro_batches = accum.mini_step
    updates = int(accum.optimizer.iterations)
    # Keras 3.15 itself fails on empty arrays on JAX and PyTorch: the same
    # error, and nothing applied, is what a drop-in does there.
    errors = [
        _error_of(m.fit, x[:0], y[:0], batch_size=8) for m in (plain, accum)
    ]
    assert errors[0] == errors[1]
    assert (errors[0] is None) == (BACKEND == "tensorflow")
    if errors[0] is not None:
        # (Keras's failed `fit` on JAX also leaves every model's variables
        # unreadable, a plain model's too.)
        return
    moved = max(
        float(np.max(np.abs(u - v)))
        for u, v in zip(before, accum.get_weights(), strict=True)
    )
    assert moved == 0.0
    assert int(accum.optimizer.iterations) == updates
    assert accum.mini_step == open_micro_batches


def _error_of(fit, *args, **kwargs):
    """The type of the error `fit` raises, or None."""
    try:
        fit(*args, verbose=0, **kwargs)
    except Exception as error:  # noqa: BLE001 (compared by type)
        return type(error)
    return None


# -- Sample weights ------------------------------------------------------------


@pytest.mark.parametrize("weights", ["negative", "mixed_signs", "all_zero"])
def test_weight_totals_at_or_below_zero_divide_as_keras(weights, report_diff):
    """Keras divides a `"mean_with_sample_weight"` batch by its weight
    total, whatever its sign. Before: windows with a negative total were
    divided by 1 (the update's magnitude off by the total, here ~30x)."""
    rng = np.random.default_rng(5)
    x, y = regression_data(n=64)
    sample_weight = {
        "negative": -rng.uniform(0.5, 1.5, 64),
        "mixed_signs": rng.normal(size=64) - 0.3,
        "all_zero": np.zeros(64),
    }[weights].astype("float32")
    loss = keras.losses.MeanSquaredError(reduction="mean_with_sample_weight")
    plain, accum = _pair(
        optimizer=lambda: keras.optimizers.SGD(0.01), loss=loss
    )
    diff, _, _ = train_pair(
        plain, accum, x, y, 8, 4, sample_weight=sample_weight
    )
    report_diff(diff)


# -- Steps that bypass the window ----------------------------------------------


class _OwnStep(keras_accum.AccumModel):
    """A custom `train_step` that never calls `super().train_step`: it
    applies the optimizer on every micro-batch, in the backend's idiom."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)

    def call(self, x):
        return self.dense(x)

    def train_step(self, *args):
        if BACKEND == "jax":
            # Keras's own JAX step, handed the state that now carries the
            # window's values too.
            from keras.src.backend.jax.trainer import JAXTrainer

            return JAXTrainer.train_step(self, *args)
        (x, y), weights = args[0], self.trainable_weights
        if BACKEND == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = keras.ops.mean(keras.ops.square(self(x) - y))
            grads = tape.gradient(loss, weights)
            self._step_optimizer().apply(grads, weights)
            return {"loss": loss}
        import torch

        self.zero_grad()
        loss = keras.ops.mean(keras.ops.square(self(x) - y))
        loss.backward()
        with torch.no_grad():
            self._step_optimizer().apply(
                [w.value.grad for w in weights], weights
            )
        return {"loss": loss}

    def _step_optimizer(self):
        return self.optimizer


class _SuperStep(keras_accum.AccumModel):
    """A custom `train_step` around `super().train_step`: it accumulates."""

    def train_step(self, *args):
        if BACKEND == "jax":
            # The stateless step reads no variable (the rate is in the
            # state); a constant log stands for what a step may add.
            logs, state = super().train_step(*args)
            return {**logs, "lr": keras.ops.convert_to_tensor(0.01)}, state
        logs = super().train_step(*args)
        return {**logs, "lr": self.optimizer.learning_rate}


# On JAX the window's values ride in the state Keras hands the step: a step
# that does not pass it to `super().train_step` fails at its first call.
_JAX_BYPASS = "optimizer_variables"


def test_custom_step_without_super_fails_loudly():
    """Before: it trained with no accumulation at all (9 updates for 9
    micro-batches), silently; on JAX and PyTorch the override was ignored."""
    x, y = regression_data(n=72)
    model = _OwnStep(accum_steps=4)
    model.compile(optimizer="sgd", loss="mse")
    if BACKEND == "jax":
        with pytest.raises(ValueError, match=_JAX_BYPASS):
            model.fit(x, y, batch_size=8, verbose=0)
        return
    match = "does not call `super\\(\\).train_step\\(data\\)`"
    with pytest.raises(RuntimeError, match=match):
        model.fit(x, y, batch_size=8, verbose=0)
    # Stopped after the first step, not after the whole epoch.
    assert int(model.optimizer.iterations) == 1


def test_custom_step_without_super_is_a_plain_step_at_one_micro_batch():
    """`accum_steps=1`: a custom step is what `keras.Model` would run."""
    x, y = regression_data(n=72)
    model = _OwnStep(accum_steps=1)
    model.compile(optimizer="sgd", loss="mse")
    if BACKEND == "jax":
        with pytest.raises(ValueError, match=_JAX_BYPASS):
            model.fit(x, y, batch_size=8, verbose=0)
        return
    model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.optimizer.iterations) == 9


def test_gan_style_model_with_its_own_optimizers_fails_loudly():
    """A GAN-style subclass: its own `compile(d_optimizer, g_optimizer)`
    and a step that applies them. Before: no accumulation, silently."""

    class TwoOptimizers(_OwnStep):
        def compile(self, first, second):
            super().compile()
            self.first, self.second = first, second

        def _step_optimizer(self):
            return self.first

    x, y = regression_data(n=72)
    model = TwoOptimizers(accum_steps=4)
    model.compile(keras.optimizers.SGD(), keras.optimizers.SGD())
    if BACKEND == "jax":
        with pytest.raises(ValueError, match=_JAX_BYPASS):
            model.fit(x, y, batch_size=8, verbose=0)
        return
    with pytest.raises(RuntimeError, match="TwoOptimizers.train_step"):
        model.fit(x, y, batch_size=8, verbose=0)
    assert int(model.first.iterations) == 1


def test_custom_step_around_super_accumulates(report_diff):
    """The documented way to customize the step keeps the promise."""
    x, y = regression_data(n=70)
    plain = mlp()
    accum = mlp(_SuperStep, accum_steps=4)
    for model in (plain, accum):
        numpy_weights(model)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    diff, _, history = train_pair(plain, accum, x, y, 8, 4)
    np.testing.assert_allclose(history.history["lr"], [0.01, 0.01])
    report_diff(diff)
