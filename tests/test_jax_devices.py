"""JAX under `keras.distribution.DataParallel`: each device's partial sum.

Two simulated CPU devices (tests/conftest.py). Each device adds its shard's
gradient to its own accumulator and the close all-reduces once
(`keras_accum/_jax_devices.py`); every case equals a plain `keras.Model`
at batch B * K under the same distribution, update by update. The
communication is read from the compiled step's HLO: no gradient crosses
devices on a micro-batch that does not close the window.
"""

from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    UpdateRecorder,
    accum_mlp,
    assert_equivalent,
    batch_norm_data,
    batch_norm_model,
    mlp,
    regression_data,
    train_pair,
)

import keras_accum

pytestmark = pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="keras.distribution.DataParallel is JAX's",
)

B, K = 8, 4  # 70 samples: windows of 4, 4 and 1; the last micro-batch 6.
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def data_parallel():
    import jax

    assert len(jax.devices()) == 2
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    try:
        yield
    finally:
        keras.distribution.set_distribution(None)


def _regularized(model_cls=keras.Model, **kwargs):
    return mlp(
        model_cls,
        layer_kwargs={"kernel_regularizer": keras.regularizers.L2(0.05)},
        **kwargs,
    )


class _SeededIdentity(keras.layers.Layer):
    """Draws random numbers and adds none of them: a layer with a seed
    generator that changes nothing."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(1)

    def call(self, inputs):
        noise = keras.random.uniform(
            keras.ops.shape(inputs), seed=self.seed_generator
        )
        return inputs + 0.0 * noise


def _with_random_draws(model_cls=keras.Model, **kwargs):
    # Exact (it adds no noise); each device draws from its own stream.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    hidden = _SeededIdentity()(hidden)
    return model_cls(inputs, keras.layers.Dense(3)(hidden), **kwargs)


CASES = {
    "mean": dict(make=mlp),
    "sample_weight": dict(make=mlp, sample_weight=True),
    "mean_with_sample_weight": dict(
        make=mlp,
        loss=keras.losses.MeanSquaredError(reduction="mean_with_sample_weight"),
        sample_weight=True,
    ),
    "sum_with_regularization": dict(
        make=_regularized, loss=keras.losses.MeanSquaredError(reduction="sum")
    ),
    "mean_with_regularization": dict(make=_regularized),
    "loss_scale": dict(make=mlp, loss_scale=True),
    "random_draws": dict(make=_with_random_draws),
    # Keras loops the step on the device: updates compared at the end.
    "steps_per_execution": dict(make=mlp, compile={"steps_per_execution": 3}),
}


def _optimizer(case):
    optimizer = keras.optimizers.Adam(0.01)
    if case.get("loss_scale"):
        return keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


@pytest.mark.parametrize("name", sorted(CASES))
def test_equals_plain_model_under_data_parallel(
    name, data_parallel, report_diff
):
    case = CASES[name]
    x, y = regression_data(n=70)
    loss = case.get("loss", "mse")
    plain = case["make"]()
    compile_kwargs = case.get("compile", {})
    plain.compile(optimizer=_optimizer(case), loss=loss, **compile_kwargs)
    accum = case["make"](keras_accum.AccumModel, accum_steps=K)
    accum.compile(optimizer=_optimizer(case), loss=loss, **compile_kwargs)
    accum.set_weights(plain.get_weights())
    fit_kwargs = {}
    if case.get("sample_weight"):
        rng = np.random.default_rng(4)
        fit_kwargs["sample_weight"] = rng.uniform(0.1, 2, size=len(x))
    if compile_kwargs:
        fit_kwargs["compare_each_update"] = False
    diff, _, _ = train_pair(plain, accum, x, y, B, K, **fit_kwargs)
    report_diff(diff, f"JAX DataParallel partial sums, {name}")
    for acc, weight in zip(
        accum.accumulators, accum.trainable_variables, strict=True
    ):
        assert tuple(acc.shape) == (2, *weight.shape)


def test_carried_window_applied_outside_the_step(data_parallel, report_diff):
    """`partial_window="carry"`: an epoch of two whole windows, then three
    micro-batches carried open and applied by `apply_partial_window`."""
    x, y = regression_data(n=64)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accum = accum_mlp(K, partial_window="carry")
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accum.set_weights(plain.get_weights())
    reference = LargeBatch(plain)
    reference.fit(x, y, batch_size=B * K, epochs=1, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    diff = assert_equivalent(accum, reference)
    report_diff(diff, "JAX DataParallel partial sums, carry")
    # An open window, carried: three micro-batches in, then applied.
    accum.fit(x[:24], y[:24], batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(accum._window.counters.mini_step.value) == 3
    assert accum.apply_partial_window()
    reference.train_on_batch(x[:24], y[:24])
    diff = assert_equivalent(accum, reference)
    report_diff(diff, "JAX DataParallel partial sums, carry, flushed")


def test_logged_loss_equals_one_device(data_parallel):
    """The loss each step logs is the plain step's on the whole micro-
    batch: a mean's and a sum's with its regularization (kept on the first
    device only)."""
    x, y = regression_data(n=64)
    for loss in ("mse", keras.losses.MeanSquaredError(reduction="sum")):
        histories = []
        for distributed in (True, False):
            if not distributed:
                keras.distribution.set_distribution(None)
            model = _regularized(keras_accum.AccumModel, accum_steps=K)
            model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss)
            history = model.fit(
                x, y, batch_size=B, epochs=2, shuffle=False, verbose=0
            )
            histories.append(np.asarray(history.history["loss"]))
        np.testing.assert_allclose(histories[0], histories[1], rtol=1e-5)
        import jax

        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices())
        )


def _two_outputs():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    outputs = {
        "a": keras.layers.Dense(3, name="a")(hidden),
        "b": keras.layers.Dense(2, name="b")(hidden),
    }
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=K)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss={"a": "mse", "b": "mae"},
        loss_weights={"a": 1.0, "b": 0.5},
        metrics={"a": ["mae"]},
    )
    return model


def test_two_outputs_log_as_one_device(data_parallel):
    """Each output's loss tracker, updated inside the per-device pass,
    adds up every device's change; weights and every log equal one
    device's."""
    import jax

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 5)).astype("float32")
    y = {
        "a": rng.normal(size=(64, 3)).astype("float32"),
        "b": rng.normal(size=(64, 2)).astype("float32"),
    }
    found = []
    for distribution in (
        keras.distribution.DataParallel(devices=jax.devices()),
        None,
    ):
        keras.distribution.set_distribution(distribution)
        model = _two_outputs()
        history = model.fit(
            x, y, batch_size=B, epochs=2, shuffle=False, verbose=0
        )
        found.append((history.history, model.get_weights()))
    (logs, weights), (one_logs, one_weights) = found
    assert set(logs) == {"loss", "a_loss", "b_loss", "a_mae"}
    for name, values in one_logs.items():
        np.testing.assert_allclose(logs[name], values, rtol=1e-5)
    for a, b in zip(weights, one_weights, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_noise_scale_equals_one_device(data_parallel):
    """The noise estimates need each micro-batch's whole gradient and the
    window's: summed over devices where sampled."""
    x, y = regression_data(n=64)
    found = []
    for distributed in (True, False):
        if not distributed:
            keras.distribution.set_distribution(None)
        model = accum_mlp(K)
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        logger = keras_accum.PseudoBatchLogger(
            noise_scale=True, noise_scale_every=1
        )
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[logger],
        )
        found.append(
            [(u.trace, u.grad_sq) for u in logger.updates if u.trace == u.trace]
        )
    assert len(found[0]) == len(found[1]) == 4
    np.testing.assert_allclose(found[0], found[1], rtol=1e-4, atol=1e-7)


def test_saved_window_loads_on_one_device_and_back(data_parallel, tmp_path):
    """The file holds the devices' sum, the weight's shape: it loads with
    no distribution, and back on two devices, the same window."""
    x, y = regression_data(n=24)
    model = accum_mlp(K, partial_window="carry")
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert int(model._window.counters.mini_step.value) == 3
    summed = [np.asarray(a.value).sum(axis=0) for a in model.accumulators]
    path = tmp_path / "open.weights.h5"
    model.save_weights(path)

    keras.distribution.set_distribution(None)
    single = accum_mlp(K, partial_window="carry")
    single.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    single.fit(x[:8], y[:8], batch_size=B, epochs=1, verbose=0)
    single.load_weights(path)
    for acc, expected in zip(single.accumulators, summed, strict=True):
        np.testing.assert_allclose(np.asarray(acc.value), expected, rtol=1e-6)
    single.save_weights(tmp_path / "single.weights.h5")

    import jax

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    again = accum_mlp(K, partial_window="carry")
    again.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    again.fit(x[:8], y[:8], batch_size=B, epochs=1, verbose=0)
    again.load_weights(tmp_path / "single.weights.h5")
    for acc, expected in zip(again.accumulators, summed, strict=True):
        value = np.asarray(acc.value)
        np.testing.assert_allclose(value.sum(axis=0), expected, rtol=1e-6)
        assert not value[1:].any()  # Loaded on the first device.
    assert int(again._window.counters.mini_step.value) == 3


def test_training_goes_on_once_the_distribution_is_unset(data_parallel):
    """Partial sums made under a distribution take the reduced gradient
    on the first device once it is unset: still the large batch."""
    x, y = regression_data(n=64)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accum = accum_mlp(K)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    accum.set_weights(plain.get_weights())
    reference = LargeBatch(plain)
    for _ in range(2):
        reference.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
        accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
        keras.distribution.set_distribution(None)
    assert int(accum.optimizer.iterations) == 4
    assert_equivalent(accum, reference)


def test_batch_normalization_equals_one_device(data_parallel):
    """`AccumBatchNormalization` normalizes with the whole micro-batch's
    moments: its model takes the reduced gradient, and trains (moving
    statistics included) as on one device."""
    import jax

    x, y = batch_norm_data((4,), n=64)
    found = []
    for distribution in (
        keras.distribution.DataParallel(devices=jax.devices()),
        None,
    ):
        keras.distribution.set_distribution(distribution)
        model = batch_norm_model(
            keras_accum.AccumModel,
            keras_accum.AccumBatchNormalization,
            (4,),
            accum_steps=K,
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
        found.append(model.get_weights())
    for a, b in zip(*found, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_batch_statistics_keep_the_reduced_gradient():
    from keras_accum import _jax_devices

    axis = _jax_devices.BatchAxis(None, "batch", 2)
    x = np.zeros((8, 5), "float32")
    assert _jax_devices.maps_over_devices(mlp(), axis, x)
    assert not _jax_devices.maps_over_devices(mlp(), axis, x[:7])
    assert _jax_devices.maps_over_devices(_with_random_draws(), axis, x)
    inputs = keras.Input((5,))
    normalized = keras.layers.BatchNormalization()(inputs)
    model = keras.Model(inputs, keras.layers.Dense(1)(normalized))
    assert not _jax_devices.maps_over_devices(model, axis, x)


# -- Communication, read from the compiled step --------------------------------


def _step_bytes(model, batch):
    """`{"every_step", "in_branches"}`: bytes all-reduced by the compiled
    train step, outside and inside conditionals' branches
    (`benchmarks/bench_communication.py`)."""
    from _collectives import step_bytes

    x, y = regression_data(n=batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return step_bytes(model, x, y)


def test_no_gradient_crosses_devices_until_the_close(data_parallel):
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    gradient = 4 * sum(int(np.prod(w.shape)) for w in plain.trainable_weights)
    found = _step_bytes(plain, 2 * B)
    # The plain step all-reduces the gradient on every step: the reading
    # finds it, so the assertion below can fail.
    assert found["every_step"] >= gradient, found
    accum = accum_mlp(K)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    found = _step_bytes(accum, B)
    # Every micro-batch: the loss's share of the window and the logged
    # loss, 4 float32 summed over devices, as a plain step's logs are.
    assert found["every_step"] <= 16, found
    # At the close: the gradient once (and the finiteness flag).
    assert gradient <= found["in_branches"] <= gradient + 16, found


class _Noise(keras.layers.Layer):
    """In training, uniform noise in the inputs' shape."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seed_generator = keras.random.SeedGenerator(7)

    def call(self, inputs, training=False):
        if not training:
            return inputs
        noise = keras.random.uniform(
            keras.ops.shape(inputs), seed=self.seed_generator
        )
        return inputs * 0.0 + noise


class _HalvesEqual(keras.metrics.Metric):
    """The fraction of predictions in the batch's first half equal to the
    same position's in its second half."""

    def __init__(self, **kwargs):
        super().__init__(name="halves_equal", **kwargs)
        self.equal = self.add_variable(shape=(), initializer="zeros")
        self.count = self.add_variable(shape=(), initializer="zeros")

    def update_state(self, y_true, y_pred, sample_weight=None):
        half = keras.ops.shape(y_pred)[0] // 2
        same = keras.ops.equal(y_pred[:half], y_pred[half:])
        self.equal.assign_add(keras.ops.sum(keras.ops.cast(same, "float32")))
        self.count.assign_add(keras.ops.cast(keras.ops.size(same), "float32"))

    def result(self):
        return self.equal / self.count


def test_each_device_draws_its_own_random_numbers(data_parallel):
    """The first device's shard is the micro-batch's first half: with the
    same stream on both devices, the halves' noise would be equal. The
    generator's state moves as one device's does."""
    import jax

    found = []
    for distribution in (
        keras.distribution.DataParallel(devices=jax.devices()),
        None,
    ):
        keras.distribution.set_distribution(distribution)
        keras.utils.set_random_seed(1)
        inputs = keras.Input((4,))
        noise = _Noise()(keras.layers.Dense(4)(inputs))
        model = keras_accum.AccumModel(inputs, noise, accum_steps=K)
        model.compile(
            optimizer=keras.optimizers.SGD(0.0),
            loss="mse",
            metrics=[_HalvesEqual()],
        )
        x = np.ones((B * K, 4), "float32")
        history = model.fit(x, x, batch_size=B, epochs=1, verbose=0)
        state = model.layers[-1].seed_generator.state
        found.append((history.history["halves_equal"][0], np.asarray(state)))
    (distributed, state), (_, one_device_state) = found
    assert distributed == 0.0
    np.testing.assert_array_equal(state, one_device_state)
    assert state[1] == K  # One draw per micro-batch.


class _RunningMean(keras.layers.Layer):
    """Keeps the mean of its last batch in a non-trainable variable."""

    def build(self, input_shape):
        self.mean = self.add_weight(
            shape=(input_shape[-1],), initializer="zeros", trainable=False
        )

    def call(self, inputs, training=False):
        if training:
            self.mean.assign(keras.ops.mean(inputs, axis=0))
        return inputs


def test_state_that_follows_the_data_is_refused(data_parallel):
    """A custom layer whose non-trainable state changes with the data
    would keep one device's value: refused, naming the problem."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = _RunningMean()(keras.layers.Dense(8)(inputs))
    model = keras_accum.AccumModel(
        inputs, keras.layers.Dense(3)(hidden), accum_steps=K
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = regression_data(n=16)
    with pytest.raises(ValueError, match="changes with the data"):
        model.fit(x, y, batch_size=B, epochs=1, verbose=0)


def test_weights_sharded_over_the_batch_axis_keep_their_layout(report_diff):
    """FSDP-style layouts (KerasHub's Gemma `get_layout_map` shards weights
    over the data axis too): a device holds a slice of such a weight, so
    the accumulators keep the weights' layouts (no partial sums) and the
    model trains as the plain one does."""
    import jax

    mesh = keras.distribution.DeviceMesh(
        (2, 1), ["batch", "model"], jax.devices()
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["dense.*kernel"] = ("batch", None)
    keras.distribution.set_distribution(
        keras.distribution.ModelParallel(
            layout_map=layout_map, batch_dim_name="batch"
        )
    )
    try:
        # 4 features: both kernels' first dimension splits over 2.
        x, y = regression_data(n=70, features=4)
        plain = mlp(features=4)
        plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        accum = accum_mlp(K, features=4)
        accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        accum.set_weights(plain.get_weights())
        assert "batch" in str(accum.trainable_variables[0].value.sharding)
        diff, _, _ = train_pair(plain, accum, x, y, B, K)
        report_diff(diff, "JAX ModelParallel, weights sharded over batch")
        for acc, weight in zip(
            accum.accumulators, accum.trainable_variables, strict=True
        ):
            assert tuple(acc.shape) == tuple(weight.shape)
            assert acc.value.sharding == weight.value.sharding
    finally:
        keras.distribution.set_distribution(None)


# -- A batch split inside the step (`micro_batch_size`) ------------------------
#
# Each device splits its own rows of the batch: a micro-batch takes as many
# rows from every device, and the window closes once per batch, with one
# gradient all-reduce.

SPLIT_CASES = ("mean", "sample_weight", "sum_with_regularization", "loss_scale")


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_split_batches_equal_plain_model_under_data_parallel(
    name, data_parallel, report_diff
):
    """Batches of 16 (8 rows a device: micro-batches of 3, 3 and 2) and a
    last of 6 (3 a device: one micro-batch)."""
    case = CASES[name]
    x, y = regression_data(n=70)
    loss = case.get("loss", "mse")
    plain = case["make"]()
    plain.compile(optimizer=_optimizer(case), loss=loss, metrics=["mae"])
    split = case["make"](keras_accum.AccumModel, micro_batch_size=3)
    split.compile(optimizer=_optimizer(case), loss=loss, metrics=["mae"])
    split.set_weights(plain.get_weights())
    fit_kwargs = {"batch_size": 16, "epochs": 2, "shuffle": False, "verbose": 0}
    if case.get("sample_weight"):
        rng = np.random.default_rng(4)
        fit_kwargs["sample_weight"] = rng.uniform(0.1, 2, size=len(x))
    reference = LargeBatch(plain)
    recorder = UpdateRecorder()
    expected = reference.fit(x, y, **fit_kwargs)
    history = split.fit(x, y, callbacks=[recorder], **fit_kwargs)
    assert len(recorder.updates) == 10
    for index, (_, weights) in enumerate(recorder.updates):
        diff = assert_equivalent(weights, reference, update=index)
    report_diff(diff, f"JAX DataParallel, micro_batch_size, {name}")
    for key in ("loss", "mae"):
        np.testing.assert_allclose(
            history.history[key], expected.history[key], rtol=1e-5
        )
    # Each device's partial sum, as in the classic mode.
    for acc, weight in zip(
        split.accumulators, split.trainable_variables, strict=True
    ):
        assert tuple(acc.shape) == (2, *weight.shape)


def test_split_evaluate_and_predict_equal_plain_under_data_parallel(
    data_parallel,
):
    x, y = regression_data(n=70)
    plain = mlp()
    plain.compile(optimizer="adam", loss="mse", metrics=["mae"])
    split = mlp(keras_accum.AccumModel, micro_batch_size=3)
    split.compile(optimizer="adam", loss="mse", metrics=["mae"])
    split.set_weights(plain.get_weights())
    np.testing.assert_allclose(
        split.evaluate(x, y, batch_size=16, verbose=0),
        plain.evaluate(x, y, batch_size=16, verbose=0),
        rtol=1e-6,
    )
    # The rows come back in the batch's order.
    np.testing.assert_allclose(
        split.predict(x, batch_size=16, verbose=0),
        plain.predict(x, batch_size=16, verbose=0),
        rtol=1e-5,
        atol=1e-6,
    )


def test_split_step_all_reduces_the_gradient_once_per_batch(data_parallel):
    split = mlp(keras_accum.AccumModel, micro_batch_size=2)
    split.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    gradient = 4 * sum(int(np.prod(w.shape)) for w in split.trainable_weights)
    # Batches of 16: 8 rows a device, micro-batches of 2, 4 of them.
    found = _step_bytes(split, 16)
    # The micro-batches: the loss's share and the logged loss as scalars.
    assert found["every_step"] <= 64, found
    # At the close: the gradient once (and the finiteness flag).
    assert gradient <= found["in_branches"] <= gradient + 16, found
