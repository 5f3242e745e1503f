"""AccumModel at batch B with accum_steps=k equals keras.Model at batch B*k.

Runs under every `KERAS_BACKEND`. Where a backend differs legitimately
(PyTorch's `jit_compile=True` is `torch.compile`, Keras's PyTorch trainer
and `steps_per_execution`, `keras.distribution` on JAX), the case asserts
each backend's behaviour. TensorFlow runs every optimizer; JAX and PyTorch
a few, as the window code they share with it is the same for all.
"""

import re

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    accum_mlp,
    assert_equivalent,
    assert_same_weights,
    build_optimizer,
    classification_data,
    max_weight_diff,
    mlp,
    regression_data,
    train_pair,
)

import keras_accum

BACKEND = keras.backend.backend()
B, K = 8, 4  # 70 samples: windows of 4, 4 and a short one (2 + 6 samples).


def _pair(
    optimizer_fn,
    loss="mse",
    compile_kwargs=None,
    plain_compile_kwargs=None,
    **model_kwargs,
):
    compile_kwargs = compile_kwargs or {}
    if plain_compile_kwargs is None:
        plain_compile_kwargs = compile_kwargs
    plain = mlp(**model_kwargs)
    plain.compile(optimizer=optimizer_fn(), loss=loss, **plain_compile_kwargs)
    accum = accum_mlp(K, **model_kwargs)
    accum.compile(optimizer=optimizer_fn(), loss=loss, **compile_kwargs)
    return plain, accum


# -- Optimizers, stateful ones included --------------------------------------

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.1),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    "sgd_nesterov": lambda: keras.optimizers.SGD(
        0.1, momentum=0.9, nesterov=True
    ),
    "adam": lambda: keras.optimizers.Adam(0.01),
    "adam_amsgrad": lambda: keras.optimizers.Adam(0.01, amsgrad=True),
    "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.1),
    "rmsprop_momentum": lambda: keras.optimizers.RMSprop(0.01, momentum=0.5),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.01),
    "nadam": lambda: keras.optimizers.Nadam(0.01),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1, l1_regularization_strength=0.01),
    "lion": lambda: keras.optimizers.Lion(0.001),
    "lamb": lambda: keras.optimizers.Lamb(0.01),
    "adafactor": lambda: keras.optimizers.Adafactor(0.01),
    "sgd_ema": lambda: keras.optimizers.SGD(0.1, use_ema=True),
    # Decoupled weight decay and clipping both see the window's gradient.
    "adamw_clipped": lambda: keras.optimizers.AdamW(
        0.01, weight_decay=0.05, global_clipnorm=0.5
    ),
}
# On JAX and PyTorch: a stateless, a stateful and a decoupled-decay one.
EVERY_BACKEND_OPTIMIZERS = ("sgd", "adam", "adamw_clipped")


@pytest.mark.parametrize(
    "name",
    sorted(OPTIMIZERS) if BACKEND == "tensorflow" else EVERY_BACKEND_OPTIMIZERS,
)
def test_every_optimizer_matches_large_batch(name, report_diff):
    x, y = regression_data()
    # TensorFlow without XLA (not every optimizer compiles there); JAX and
    # PyTorch in their default mode (without `jit`, JAX runs op by op).
    compile_kwargs = {"jit_compile": False} if BACKEND == "tensorflow" else {}
    plain, accum = _pair(OPTIMIZERS[name], compile_kwargs=compile_kwargs)
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)
    # 2 epochs of 70 samples at 32: 3 updates each, the last one short.
    assert int(accum.optimizer.iterations) == 6
    assert accum.mini_step == 0
    # The window's state is not a weight of the model.
    assert len(accum.weights) == len(plain.weights)


COMPILE_MODES = {
    "graph": {"jit_compile": False},
    "jit_compile": {"jit_compile": True},
    "run_eagerly": {"run_eagerly": True},
}
# Without `jit_compile` JAX runs eagerly, as `run_eagerly`; PyTorch runs
# eagerly unless `jit_compile=True` (`torch.compile`), whose case is
# `test_jit_compile_with_one_sample_per_micro_batch` there: the same
# window step, whose `torch.compile` costs 20-40 CPU-s a case.
MODES_HERE = {
    "tensorflow": ["graph", "jit_compile", "run_eagerly"],
    "jax": ["jit_compile", "run_eagerly"],
    "torch": ["graph"],
}[BACKEND]


@pytest.mark.parametrize("mode", MODES_HERE)
def test_compile_modes(mode, report_diff):
    x, y = regression_data()
    plain, accum = _pair(
        lambda: keras.optimizers.Adam(0.01), compile_kwargs=COMPILE_MODES[mode]
    )
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)
    assert int(accum.optimizer.iterations) == 6


def test_jit_compile_with_one_sample_per_micro_batch(report_diff):
    # Micro-batches of one sample under XLA (TensorFlow, JAX) and
    # `torch.compile` (PyTorch): 8 samples, windows of 4.
    x, y = regression_data(n=8)
    # On PyTorch the large-batch reference trains eagerly: the compiled
    # AccumModel is held to PyTorch's own ops, and the reference's
    # `torch.compile` (about half of this case's CPU) is saved.
    jit = {"jit_compile": True}
    plain, accum = _pair(
        lambda: keras.optimizers.Adam(0.01),
        compile_kwargs=jit,
        plain_compile_kwargs={} if BACKEND == "torch" else jit,
    )
    diff, _, _ = train_pair(plain, accum, x, y, 1, K, epochs=1)
    report_diff(diff)
    assert int(accum.optimizer.iterations) == 2


def test_steps_per_execution(report_diff):
    x, y = regression_data()
    plain, accum = _pair(
        lambda: keras.optimizers.Adam(0.01),
        compile_kwargs={"steps_per_execution": 3},
    )
    if BACKEND == "torch":
        # Keras's PyTorch trainer runs one step per call and refuses more,
        # for the plain model as for the window.
        for model in (plain, accum):
            with pytest.raises(
                ValueError,
                match="`steps_per_execution` must be 1 with the PyTorch",
            ):
                model.fit(x, y, batch_size=B, verbose=0)
            assert int(model.optimizer.iterations) == 0
        return
    diff, _, _ = train_pair(plain, accum, x, y, B, K, compare_each_update=False)
    report_diff(diff)
    assert int(accum.optimizer.iterations) == 6


# -- Schedules see updates, not micro-steps -----------------------------------


@pytest.mark.parametrize(
    "base", ["sgd", "adam"] if BACKEND == "tensorflow" else ["sgd"]
)
def test_learning_rate_schedule_counts_updates(base, report_diff):
    def optimizer():
        schedule = keras.optimizers.schedules.ExponentialDecay(
            0.1 if base == "sgd" else 0.01, decay_steps=1, decay_rate=0.5
        )
        if base == "sgd":
            return keras.optimizers.SGD(schedule, momentum=0.9)
        return keras.optimizers.Adam(schedule)

    x, y = regression_data()
    plain, accum = _pair(optimizer)
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)
    np.testing.assert_allclose(
        float(accum.optimizer.learning_rate),
        float(plain.optimizer.learning_rate),
    )


# -- Clipping applies once, to the window's gradient --------------------------


CLIPS = [{"clipnorm": 0.05}, {"clipvalue": 0.01}]
if BACKEND == "tensorflow":
    # On JAX and PyTorch the optimizer case adamw_clipped covers it.
    CLIPS.append({"global_clipnorm": 0.05})


@pytest.mark.parametrize("clip", CLIPS)
def test_gradient_clipping_applies_to_the_window(clip, report_diff):
    x, y = regression_data()
    plain, accum = _pair(
        lambda: keras.optimizers.SGD(0.5, momentum=0.5, **clip)
    )
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)
    # The thresholds bite: clipping every micro-batch instead would differ.
    reference = mlp()
    reference.compile(
        optimizer=keras.optimizers.SGD(0.5, momentum=0.5), loss="mse"
    )
    build_optimizer(reference)
    reference.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    assert (
        np.max(np.abs(reference.get_weights()[0] - plain.get_weights()[0]))
        > 1e-3
    )


# -- Sample weights, class weights, regularization ---------------------------


@pytest.mark.full_run_only(
    reason="test_loss_reductions_with_uneven_last_batch weights samples"
)
def test_sample_weight(report_diff):
    x, y = regression_data()
    weights = np.random.default_rng(3).uniform(0, 2, size=len(x))
    plain, accum = _pair(lambda: keras.optimizers.Adam(0.01))
    diff, _, _ = train_pair(
        plain, accum, x, y, B, K, sample_weight=weights.astype("float32")
    )
    report_diff(diff)


def test_class_weight(report_diff):
    x, y = classification_data()
    kwargs = {"features": 6, "outputs": 4, "activation": "softmax"}
    plain, accum = _pair(
        lambda: keras.optimizers.Adam(0.01),
        loss="sparse_categorical_crossentropy",
        **kwargs,
    )
    diff, _, _ = train_pair(
        plain, accum, x, y, B, K, class_weight={0: 1.0, 1: 3.0, 2: 0.5, 3: 2.0}
    )
    report_diff(diff)


@pytest.mark.full_run_only(
    reason="test_loss_reductions_with_uneven_last_batch has a regularizer"
)
def test_regularization_losses_count_once_per_window(report_diff):
    x, y = regression_data()
    plain, accum = _pair(
        lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        layer_kwargs={
            "kernel_regularizer": keras.regularizers.L2(0.05),
            "bias_regularizer": keras.regularizers.L1(0.01),
        },
    )
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)


class _WithUnusedLayer(keras.Model):
    """A trainable layer the loss never reaches (subclassed: every Keras
    from 3.10 tracks it; attached to a functional model, 3.10 does not)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(3)
        self.unused = keras.layers.Dense(2)

    def call(self, x):
        return self.dense(x)


def test_a_weight_the_loss_never_reaches(report_diff):
    # A trainable layer the loss never reaches, under AdamW with weight
    # decay. What the plain step does with it, the window does too: JAX
    # gives it a zero gradient (weight decay moves it), TensorFlow and
    # PyTorch none (it stays).
    def build(accum_steps=None):
        keras.utils.set_random_seed(1)
        model = _WithUnusedLayer(name="with_unused")
        model(np.zeros((1, 5), "float32"))
        model.unused.build((None, 5))
        if accum_steps is not None:
            model = keras_accum.AccumModel.from_model(model, accum_steps)
        model.compile(
            optimizer=keras.optimizers.AdamW(0.01, weight_decay=0.1),
            loss="mse",
        )
        return model

    x, y = regression_data(n=64)
    # Its `unused` layer is built by hand: the float64 replay builds it so.
    plain = LargeBatch(build(), rebuild=build)
    accum = build(accum_steps=K)
    accum.set_weights(plain.model.get_weights())
    assert len(accum.trainable_weights) == 4
    unused_before = [w.copy() for w in plain.model.unused.get_weights()]
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)
    assert int(accum.optimizer.iterations) == 4
    moved = max(
        float(np.max(np.abs(u - v)))
        for u, v in zip(
            plain.model.unused.get_weights(), unused_before, strict=True
        )
    )
    assert (moved > 0) is (BACKEND == "jax"), moved


@pytest.mark.skipif(
    BACKEND != "jax", reason="keras.distribution.DataParallel is JAX's"
)
def test_jax_data_parallel_on_two_devices(report_diff):
    # Two CPU devices (conftest.py sets XLA's host device count), against
    # a plain model under the same distribution; the last micro-batch
    # holds 6 samples, 3 per device.
    import jax

    devices = jax.devices()
    assert len(devices) == 2
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=devices)
    )
    try:
        x, y = regression_data(n=70)
        plain, accum = _pair(lambda: keras.optimizers.Adam(0.01))
        accum.set_weights(plain.get_weights())
        diff, _, _ = train_pair(plain, accum, x, y, B, K)
        report_diff(diff, "JAX DataParallel, 2 devices")
        # 70 samples: windows of 4, 4 and 1 micro-batches per epoch.
        assert int(accum.optimizer.iterations) == 6
        # Each device keeps its partial sum: a leading axis of devices,
        # sharded over the batch axis, then the weight's own layout.
        for accumulator, variable in zip(
            accum.accumulators, accum.trainable_variables, strict=True
        ):
            assert tuple(accumulator.shape) == (2, *variable.shape)
            spec = tuple(variable.value.sharding.spec)
            spec += (None,) * (len(variable.shape) - len(spec))
            assert tuple(accumulator.value.sharding.spec) == ("batch", *spec)
    finally:
        keras.distribution.set_distribution(None)


# -- Loss reductions, with an uneven last batch ------------------------------


@pytest.mark.parametrize(
    "reduction", ["sum_over_batch_size", "sum", "mean_with_sample_weight"]
)
def test_loss_reductions_with_uneven_last_batch(reduction, report_diff):
    x, y = regression_data(n=70)  # 70 = 2 * 32 + 6
    weights = np.random.default_rng(4).uniform(0.1, 2, size=len(x))
    lr = 0.001 if reduction == "sum" else 0.05
    plain, accum = _pair(
        lambda: keras.optimizers.SGD(lr, momentum=0.5),
        loss=keras.losses.MeanSquaredError(reduction=reduction),
        layer_kwargs={"kernel_regularizer": keras.regularizers.L2(0.01)},
    )
    diff, _, _ = train_pair(
        plain, accum, x, y, B, K, sample_weight=weights.astype("float32")
    )
    report_diff(diff)


def test_multi_output_with_loss_weights(report_diff):
    x, y = regression_data(outputs=3)
    y2 = (y[:, :1] > 0).astype("float32")

    def build(cls, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((5,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        reg = keras.layers.Dense(3, name="reg")(hidden)
        cls_out = keras.layers.Dense(1, activation="sigmoid", name="cls")(
            hidden
        )
        model = cls(inputs, {"reg": reg, "cls": cls_out}, **kwargs)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss={"reg": "mse", "cls": "binary_crossentropy"},
            loss_weights={"reg": 0.3, "cls": 2.0},
        )
        return model

    plain = build(keras.Model)
    accum = build(keras_accum.AccumModel, accum_steps=K)
    diff, _, _ = train_pair(plain, accum, x, {"reg": y, "cls": y2}, B, K)
    report_diff(diff)


# -- Epoch ends ---------------------------------------------------------------


class _EpochEndWeights(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.weights = []

    def on_epoch_end(self, epoch, logs=None):
        self.weights.append([w.copy() for w in self.model.get_weights()])


def _assert_same_epochs(plain, accum, accum_hist, accum_cb):
    """3 epochs of 3 updates each; same validation and epoch-end weights.

    `plain`: the `LargeBatch`; `accum_cb`: the `AccumModel`'s
    `_EpochEndWeights`.
    """
    assert int(accum.optimizer.iterations) == 9
    assert int(plain.model.optimizer.iterations) == 9
    assert_equivalent(
        accum_hist.history["val_loss"], plain, rtol=1e-5, key="val_loss"
    )
    # An epoch ends with its third update: the weights the callbacks and
    # validation see are those of updates 3, 6 and 9.
    assert len(accum_cb.weights) == 3
    for epoch, weights in enumerate(accum_cb.weights):
        assert_equivalent(weights, plain, update=3 * epoch + 2)
    assert_equivalent(accum, plain)


def test_partial_window_applied_before_validation_and_callbacks(report_diff):
    x, y = regression_data(n=70)
    xv, yv = regression_data(n=20, seed=5)
    plain, accum = _pair(lambda: keras.optimizers.Adam(0.01))
    plain, accum_cb = LargeBatch(plain), _EpochEndWeights()
    plain.fit(
        x,
        y,
        batch_size=B * K,
        epochs=3,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
    )
    accum_hist = accum.fit(
        x,
        y,
        batch_size=B,
        epochs=3,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[accum_cb],
    )
    assert accum.mini_step == 0
    _assert_same_epochs(plain, accum, accum_hist, accum_cb)
    report_diff(max_weight_diff(plain.model, accum))


def _unknown_length(x, y, batch_size):
    """Batches in order, with no length, in the backend's own kind of
    input: a `tf.data` pipeline (TensorFlow, JAX) or a PyTorch
    `DataLoader` over an `IterableDataset`."""
    if BACKEND == "torch":
        import torch

        class Batches(torch.utils.data.IterableDataset):
            def __iter__(self):
                for start in range(0, len(x), batch_size):
                    yield (
                        x[start : start + batch_size],
                        y[start : start + batch_size],
                    )

        return torch.utils.data.DataLoader(Batches(), batch_size=None)
    import tensorflow as tf

    ds = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True)
    ds = ds.batch(batch_size)
    assert ds.cardinality() == tf.data.UNKNOWN_CARDINALITY
    return ds


def _known_length(x, y, batch_size):
    """The same batches with a known length."""
    if BACKEND == "torch":
        import torch

        data = torch.utils.data.TensorDataset(
            torch.from_numpy(x), torch.from_numpy(y)
        )
        return torch.utils.data.DataLoader(data, batch_size=batch_size)
    import tensorflow as tf

    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)


def test_unknown_steps_per_epoch_applies_after_last_step(report_diff):
    x, y = regression_data(n=70)
    xv, yv = regression_data(n=20, seed=5)
    plain, accum = _pair(lambda: keras.optimizers.SGD(0.1, momentum=0.9))
    plain, accum_cb = LargeBatch(plain), _EpochEndWeights()
    # The reference sees the same batches with a known length: Keras 3.15
    # itself counts one extra optimizer iteration per epoch (without
    # changing weights) when the length is unknown.
    plain.fit(
        _known_length(x, y, B * K),
        epochs=3,
        verbose=0,
        validation_data=(xv, yv),
    )
    accum_hist = accum.fit(
        _unknown_length(x, y, B),
        epochs=3,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[accum_cb],
    )
    _assert_same_epochs(plain, accum, accum_hist, accum_cb)
    report_diff(max_weight_diff(plain.model, accum))


def test_carried_window_on_unknown_length_counts_only_real_batches(
    report_diff,
):
    # Such an epoch ends with a call that finds the data exhausted; it must
    # not count as a micro-batch, or the carried window would close one
    # micro-batch early. Reference: the same data with a known length.
    x, y = regression_data(n=70)
    known = accum_mlp(K, partial_window="carry")
    unknown = accum_mlp(K, partial_window="carry")
    for model in (known, unknown):
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    known.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    logger = keras_accum.PseudoBatchLogger()
    unknown.fit(
        _unknown_length(x, y, B), epochs=2, verbose=0, callbacks=[logger]
    )
    assert unknown.mini_step == known.mini_step == 2
    assert int(unknown.optimizer.iterations) == 4
    # 9 micro-batches, then 9 more carried on from the 1 left open.
    assert [u.micro_batches for u in logger.updates] == [4, 4, 4, 4]
    report_diff(max_weight_diff(known, unknown))
    np.testing.assert_allclose(max_weight_diff(known, unknown), 0.0, atol=1e-6)


def test_carry_partial_window_into_next_epoch(report_diff):
    x, y = regression_data(n=70)
    accum = accum_mlp(K, partial_window="carry")
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # 2 epochs of 9 micro-batches: 4 full windows, 2 micro-batches left.
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    assert int(accum.optimizer.iterations) == 4
    assert accum.mini_step == 2

    # Windows run across the epoch boundary: the third is the first
    # epoch's short micro-batch (6 samples) plus 3 of the next epoch.
    xx, yy = np.concatenate([x, x]), np.concatenate([y, y])
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    for start, stop in [(0, 32), (32, 64), (64, 94), (94, 126)]:
        plain.train_on_batch(xx[start:stop], yy[start:stop])
    assert_same_weights(accum, plain)

    # The carried micro-batches (8 + 6 samples) are applied on demand.
    assert accum.apply_partial_window() is True
    assert accum.apply_partial_window() is False
    plain.train_on_batch(xx[126:], yy[126:])
    report_diff(assert_equivalent(accum, plain))


# -- Logs ---------------------------------------------------------------------


def test_logs_report_the_plain_micro_batch_loss_and_metrics():
    # With a zero learning rate no update changes the weights, so a plain
    # model at the micro-batch size must log exactly the same numbers.
    x, y = regression_data()

    def fit(model, batch_size):
        model.compile(
            optimizer=keras.optimizers.SGD(0.0), loss="mse", metrics=["mae"]
        )
        return model.fit(
            x, y, batch_size=batch_size, epochs=2, shuffle=False, verbose=0
        ).history

    plain = fit(mlp(), B)
    accum = fit(accum_mlp(K), B)
    assert set(plain) == {"loss", "mae"}
    # The same keys: a drop-in for `keras.Model` (tests/test_dropin.py).
    assert list(accum) == list(plain)
    for key in plain:
        np.testing.assert_allclose(accum[key], plain[key], rtol=1e-6)


def test_update_happens_once_per_window():
    x, y = regression_data(n=64)
    model = accum_mlp(K)
    model.compile(optimizer="sgd", loss="mse")
    seen = []

    class Window(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # `self.model`, not `model`: on JAX it brings the state of
            # the step into the model's variables first.
            seen.append(
                (self.model.mini_step, int(self.model.optimizer.iterations))
            )

    model.fit(
        x, y, batch_size=B, shuffle=False, verbose=0, callbacks=[Window()]
    )
    assert seen == [
        (1, 0),
        (2, 0),
        (3, 0),
        (0, 1),
        (1, 1),
        (2, 1),
        (3, 1),
        (0, 2),
    ]


def test_accum_steps_one_is_a_plain_step_and_can_grow(report_diff):
    # k = 1 is the plain step's arithmetic; switching to k = 4 in the same
    # traced step uses the windows.
    x, y = regression_data(n=64)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    accum = accum_mlp(1)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(accum.optimizer.iterations) == 8
    diff_one = max_weight_diff(plain.model, accum)
    if BACKEND == "jax":
        # Through the window, which XLA fuses otherwise: float32 rounding.
        assert diff_one < 1e-6
    else:
        # The window's gradient is the micro-batch's times 8 over 8, exact
        # in float32: the very same update as a plain step's.
        assert diff_one == 0.0
    train_function = accum.train_function
    accum.accum_steps = K
    plain.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert accum.train_function is train_function
    assert int(accum.optimizer.iterations) == 10
    report_diff(assert_equivalent(accum, plain), "accum_steps 1, then 4")


def test_accum_steps_can_change_without_retracing():
    x, y = regression_data(n=64)
    model = accum_mlp(2)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 4
    train_function = model.train_function
    model.accum_steps = 8
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations) == 5
    assert model.train_function is train_function


# -- Three ways to make an AccumModel ----------------------------------------


class PlainNet(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class AccumNet(keras_accum.AccumModel):
    def __init__(self, units=8, **kwargs):
        super().__init__(accum_steps=K, **kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="tanh")
        self.out = keras.layers.Dense(3)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


def _fresh(model_fn):
    keras.utils.set_random_seed(1)
    model = model_fn()
    model(np.zeros((1, 5), "float32"))
    return model


def test_subclassing_after_functional_use(report_diff):
    # A functional AccumModel first: Keras must not turn later subclasses
    # of AccumModel functional.
    keras_accum.AccumModel(*_io(), accum_steps=2)
    x, y = regression_data()
    plain, accum = _fresh(PlainNet), _fresh(AccumNet)
    assert not isinstance(accum, keras.src.models.functional.Functional)
    assert accum.accum_steps == K
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff)


def _io():
    inputs = keras.Input((5,))
    return inputs, keras.layers.Dense(3)(inputs)


def _sequential(seed=1):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


@pytest.mark.parametrize("kind", ["sequential", "functional", "subclassed"])
def test_from_model_converts_a_built_model(kind, report_diff):
    builders = {
        "sequential": _sequential,
        "functional": lambda: mlp(),
        "subclassed": lambda: _fresh(PlainNet),
    }
    x, y = regression_data()
    original = builders[kind]()
    reference = builders[kind]()
    accum = keras_accum.AccumModel.from_model(original, accum_steps=K)
    assert isinstance(accum, keras_accum.AccumModel)
    # Same weights, same order: a pretrained model's weights carry over.
    for u, v in zip(accum.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_array_equal(u, v)
    np.testing.assert_allclose(
        accum.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-6
    )
    reference.compile(
        optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse"
    )
    accum.compile(optimizer=keras.optimizers.SGD(0.1, momentum=0.9), loss="mse")
    diff, _, _ = train_pair(reference, accum, x, y, B, K)
    report_diff(diff)


def test_from_model_refuses_an_unbuilt_model():
    with pytest.raises(ValueError, match="must be built"):
        keras_accum.AccumModel.from_model(PlainNet(), accum_steps=2)
    with pytest.raises(TypeError, match="model"):
        keras_accum.AccumModel.from_model(keras.layers.Dense(2), accum_steps=2)


# -- Refusals -----------------------------------------------------------------


@pytest.mark.parametrize(
    "value, error",
    [
        (0, ValueError),
        (-1, ValueError),
        (2.5, TypeError),
        ("4", TypeError),
        (None, TypeError),
        (True, TypeError),
        # The window counts in int32: 2**31 wrapped to -2**31 on
        # TensorFlow (windows of 1, silently) and overflowed on JAX and
        # PyTorch; 2**32 + 3 trained windows of 3.
        (2**31, ValueError),
        (2**32 + 3, ValueError),
        (np.int64(2**31), ValueError),
    ],
)
def test_bad_accum_steps_are_refused(value, error):
    with pytest.raises(error, match=r"`accum_steps`.*Received: accum_steps="):
        keras_accum.AccumModel(*_io(), accum_steps=value)
    with pytest.raises(error, match=re.escape(f"accum_steps={value!r}")):
        keras_accum.AccumModel.from_model(mlp(), accum_steps=value)
    model = accum_mlp(2)
    with pytest.raises(error, match="`accum_steps`"):
        model.accum_steps = value
    assert model.accum_steps == 2


def test_bad_partial_window_is_refused():
    with pytest.raises(ValueError, match="partial_window='end'"):
        keras_accum.AccumModel(*_io(), accum_steps=2, partial_window="end")


def test_optimizer_that_accumulates_itself_is_refused():
    model = accum_mlp(2)
    with pytest.raises(ValueError, match="gradient_accumulation_steps=4"):
        model.compile(
            optimizer=keras.optimizers.Adam(gradient_accumulation_steps=4),
            loss="mse",
        )


@pytest.mark.full_run_only(
    reason="its fresh process runs Keras's NumPy backend, whatever backend "
    "this run has: the same case in every run"
)
def test_unsupported_backends_are_refused_with_how_to_select_one():
    import subprocess
    import sys

    code = (
        "import keras, keras_accum\n"
        "i = keras.Input((2,))\n"
        "keras_accum.AccumModel(i, keras.layers.Dense(1)(i), accum_steps=2)\n"
    )
    # TensorFlow, JAX and PyTorch are supported; Keras's inference-only
    # NumPy backend is not.
    env = {**__import__("os").environ, "KERAS_BACKEND": "numpy"}
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "RuntimeError" in result.stderr
    assert "backend='numpy'" in result.stderr
    assert "KERAS_BACKEND=tensorflow" in result.stderr


# -- Serialization ------------------------------------------------------------


def test_save_and_load_round_trip(tmp_path, report_diff):
    x, y = regression_data(n=70)
    model = accum_mlp(K, partial_window="carry")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    # 9 micro-batches: 2 updates and one micro-batch left open.
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert (model.mini_step, int(model.optimizer.iterations)) == (1, 2)
    assert model.get_config()["accum_steps"] == K
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, keras_accum.AccumModel)
    assert loaded.accum_steps == K
    assert loaded.partial_window == "carry"
    assert_same_weights(loaded, model, atol=0)
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    # The window open at the save came back with it, and the optimizer.
    assert (loaded.mini_step, int(loaded.optimizer.iterations)) == (1, 2)
    for saved, restored in zip(
        model.accumulators, loaded.accumulators, strict=True
    ):
        np.testing.assert_array_equal(
            keras.ops.convert_to_numpy(restored),
            keras.ops.convert_to_numpy(saved),
        )
    # So training continues identically: one more epoch of each equals
    # the run that was never saved (the open micro-batch starts a window
    # of 4 with 3 new ones: 2 more updates, 2 micro-batches left open).
    for m in (model, loaded):
        m.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert (loaded.mini_step, int(loaded.optimizer.iterations)) == (2, 4)
    assert (model.mini_step, int(model.optimizer.iterations)) == (2, 4)
    assert_same_weights(loaded, model, atol=1e-6)
    report_diff(max_weight_diff(model, loaded), "saved, loaded, 1 more epoch")
    np.testing.assert_allclose(
        loaded.evaluate(x, y, verbose=0),
        model.evaluate(x, y, verbose=0),
        rtol=1e-6,
    )


@pytest.mark.parametrize("kind", ["subclass", "from_model_subclassed"])
def test_save_and_load_subclassed(kind, tmp_path):
    if kind == "subclass":
        model = _fresh(AccumNet)
    else:
        model = keras_accum.AccumModel.from_model(
            _fresh(PlainNet), accum_steps=5
        )
    model.compile(optimizer="adam", loss="mse")
    x, y = regression_data()
    model.fit(x, y, batch_size=B, verbose=0)
    path = tmp_path / "m.keras"
    model.save(path)
    loaded = keras.saving.load_model(
        path, custom_objects={"PlainNet": PlainNet}
    )
    assert isinstance(loaded, keras_accum.AccumModel)
    assert loaded.accum_steps == model.accum_steps
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )


def test_weights_load_into_the_plain_model():
    x, y = regression_data()
    accum = accum_mlp(K)
    accum.compile(optimizer="adam", loss="mse")
    accum.fit(x, y, batch_size=B, verbose=0)
    plain = mlp(seed=7)
    plain.set_weights(accum.get_weights())
    np.testing.assert_allclose(
        plain.predict(x, verbose=0), accum.predict(x, verbose=0), atol=1e-6
    )
    # The accumulators are not weights of the model.
    assert len(accum.weights) == len(plain.weights)
    assert len(accum.accumulators) == len(accum.trainable_weights)


@pytest.mark.skipif(
    BACKEND == "jax", reason="JAX's train_step takes and returns its state"
)
def test_train_step_called_directly_before_fit_accumulates():
    # A custom loop may call the step itself, without `fit` having made a
    # train function first: the window still counts and applies.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((3,))
    model = keras_accum.AccumModel(
        inputs, keras.layers.Dense(1)(inputs), accum_steps=2
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x = np.ones((4, 3), "float32")
    y = np.zeros((4, 1), "float32")
    model.build((None, 3))
    model.optimizer.build(model.trainable_variables)
    before = [w.copy() for w in model.get_weights()]
    model.train_step((x, y))
    assert model.mini_step == 1
    for a, b in zip(model.get_weights(), before, strict=True):
        np.testing.assert_array_equal(a, b)
    model.train_step((x, y))
    assert model.mini_step == 0
    assert int(model.optimizer.iterations.numpy()) == 1
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(model.get_weights(), before, strict=True)
    )


def test_the_model_carries_eight_attributes_of_the_package():
    # Before: twelve, two of them (`_epoch`, `_steps_per_epoch`) copies of
    # window counters. Now the six settings, the window and its life.
    def model(cls, **kwargs):
        inputs = keras.Input((3,))
        built = cls(inputs, keras.layers.Dense(1)(inputs), **kwargs)
        built.compile(optimizer="sgd", loss="mse")
        return built

    x = np.ones((8, 3), "float32")
    y = np.ones((8, 1), "float32")
    accum = model(keras_accum.AccumModel, accum_steps=2)
    plain = model(keras.Model)
    for fitted in (accum, plain):
        fitted.fit(x, y, batch_size=2, epochs=2, verbose=0)
    assert set(vars(accum)) - set(vars(plain)) == {
        "_accum_steps",
        "_partial_window",
        "_micro_batch_size",
        "_noise_scale_every",
        "_accumulator_dtype",
        "_whole_batch_loss",
        "_window",
        "_life",
    }
    # `fit`'s position is in the window's counters, once.
    assert int(keras.ops.convert_to_numpy(accum._window.counters.epoch)) == 2
    assert accum._life.epoch is None and accum._life.steps_per_epoch is None
    # A recompile drops the window and keeps the position.
    accum.compile(optimizer="sgd", loss="mse")
    assert accum._window is None and accum._life.epoch == 2


# The methods the package defines on a model, at most, per backend: what a
# maintainer reads to know a model (61 on JAX before the split mode, 106
# with it threaded through the trainers; its steps now live behind
# `_batch_ops.BatchOps`; the `whole_batch_loss` property came in as
# `changed_weights_message` left for a module function).
METHOD_BOUNDS = {"jax": 75, "tensorflow": 75, "torch": 75}


def package_methods(model) -> list:
    """The names of the functions and properties that keras_accum's
    classes define on `model`: members of the classes of its MRO whose
    module is `keras_accum` or one of its modules; a name defined by
    several (an override) counts once. Class attributes that are not
    functions (`_batch_ops_class`, constants) do not count."""
    import inspect

    kinds = (property, staticmethod, classmethod)
    names = set()
    for cls in type(model).__mro__:
        if not cls.__module__.startswith("keras_accum"):
            continue
        for name, value in vars(cls).items():
            if inspect.isfunction(value) or isinstance(value, kinds):
                names.add(name)
    return sorted(names)


def test_the_package_defines_few_methods_on_a_model():
    inputs = keras.Input((3,))
    model = keras_accum.AccumModel(inputs, keras.layers.Dense(2)(inputs))
    found = package_methods(model)
    # The rule sees the package's methods: the step and its window's.
    assert {"train_step", "_micro_batch_step", "fit"} <= set(found)
    assert len(found) <= METHOD_BOUNDS[BACKEND], found
