"""Accumulation schedules: `accum_steps` by epoch or by update count."""

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    UpdateRecorder,
    accum_mlp,
    assert_equivalent,
    mlp,
    regression_data,
)

from keras_accum._validation import steps_for_epoch

BACKEND = keras.backend.backend()
B = 8


def _optimizer():
    # A learning-rate schedule: it must count updates, not micro-batches.
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.7)
    return keras.optimizers.Adam(schedule)


def _count_traces(model):
    """Counts traces of `model`'s train step (Python runs once per trace):
    `train_step`, the step Keras compiles on every backend."""
    model.traces = 0
    step = model.train_step

    def counted(*args):
        model.traces += 1
        return step(*args)

    model.train_step = counted


def _assert_traced_once(model, batch_shapes=1):
    """One trace of the train step for the whole run: the window length
    is a variable. `jax.jit` traces once per input shape (TensorFlow's
    step takes any batch size); PyTorch's Keras (without `jit_compile`)
    runs the step eagerly: there is no trace to count."""
    if BACKEND == "tensorflow":
        assert model.traces == 1
    elif BACKEND == "jax":
        assert model.traces == batch_shapes


def test_schedule_by_epoch_equals_each_phase_large_batch(report_diff):
    # 70 samples: every phase ends its epochs with a partial window.
    x, y = regression_data(n=70)
    schedule = {0: 1, 1: 2, 2: 4}
    accum = accum_mlp(schedule)
    accum.compile(optimizer=_optimizer(), loss="mse")
    _count_traces(accum)
    plain = mlp()
    plain.compile(optimizer=_optimizer(), loss="mse")
    plain = LargeBatch(plain)

    recorder = UpdateRecorder()
    accum.fit(
        x,
        y,
        batch_size=B,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[recorder],
    )
    for epoch in range(4):
        k = steps_for_epoch(schedule, epoch)
        plain.fit(x, y, batch_size=B * k, shuffle=False, verbose=0)
    # 9 updates (batch 8), then 5 (16), then 3 (32), then 3 (32).
    assert [i for i, _ in recorder.updates] == list(range(1, 21))
    assert [i for i, _ in plain.updates.updates] == list(range(1, 21))
    diff = max(
        assert_equivalent(weights, plain, update=index)
        for index, (_, weights) in enumerate(recorder.updates)
    )
    report_diff(diff, "schedule by epoch {0: 1, 1: 2, 2: 4}")
    # One trace for the whole schedule (on JAX one per batch shape: 8, 6).
    _assert_traced_once(accum, batch_shapes=2)
    assert accum.window_length == 4


def test_schedule_by_update_count_equals_each_phase(report_diff):
    # 3 updates of one micro-batch, then windows of 4: 24 + 64 samples.
    x, y = regression_data(n=88)
    accum = accum_mlp(lambda u: keras.ops.where(u < 3, 1, 4))
    accum.compile(optimizer=_optimizer(), loss="mse")
    _count_traces(accum)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)

    plain = mlp()
    plain.compile(optimizer=_optimizer(), loss="mse")
    plain = LargeBatch(plain)
    plain.fit(x[:24], y[:24], batch_size=B, shuffle=False, verbose=0)
    plain.fit(x[24:], y[24:], batch_size=4 * B, shuffle=False, verbose=0)
    assert int(accum.optimizer.iterations) == 5
    assert int(plain.model.optimizer.iterations) == 5
    diff = assert_equivalent(accum, plain)
    report_diff(diff, "schedule by update count (1 x 3, then 4)")
    _assert_traced_once(accum)
    assert accum.window_length == 4


def test_changing_an_int_or_epoch_schedule_never_retraces():
    x, y = regression_data(n=64)
    accum = accum_mlp(2)
    accum.compile(optimizer="sgd", loss="mse")
    _count_traces(accum)
    accum.fit(x, y, batch_size=B, verbose=0)
    function = accum.train_function
    accum.accum_steps = {0: 4, 1: 8}
    accum.fit(x, y, batch_size=B, epochs=2, verbose=0)
    accum.accum_steps = 1
    accum.fit(x, y, batch_size=B, verbose=0)
    assert accum.train_function is function
    _assert_traced_once(accum)
    # 4 + (2 + 1) + 8 updates.
    assert int(accum.optimizer.iterations) == 4 + 3 + 8


@keras.saving.register_keras_serializable(package="test_schedules")
def grow_after_ten(updates):
    return keras.ops.where(updates < 10, 2, 8)


@pytest.mark.parametrize(
    "schedule", [{0: 1, 3: 4, 6: 16}, grow_after_ten], ids=["epochs", "fn"]
)
def test_schedule_is_saved_with_the_model(tmp_path, schedule):
    model = accum_mlp(schedule)
    model.compile(optimizer="sgd", loss="mse")
    config = model.get_config()
    if isinstance(schedule, dict):
        # Plain JSON: string keys.
        assert config["accum_steps"] == {"0": 1, "3": 4, "6": 16}
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.accum_steps == schedule
    if not isinstance(schedule, dict):
        assert int(loaded.accum_steps(keras.ops.convert_to_tensor(12))) == 8


@pytest.mark.parametrize(
    "value, error, match",
    [
        ({}, ValueError, "must not be empty"),
        ({1: 4}, ValueError, "epoch 0"),
        ({0: 0}, ValueError, "Received: accum_steps=0"),
        ({-1: 2, 0: 1}, ValueError, "epoch indices"),
        ([1, 4], TypeError, r"a dict mapping epochs.*Received: accum_steps="),
        ({0: 2, 3: 2**31}, ValueError, r"at most 2147483647.*=2147483648"),
    ],
)
def test_bad_schedules_are_refused(value, error, match):
    with pytest.raises(error, match=match):
        accum_mlp(value)


def test_callable_returning_a_bad_length_fails_at_fit_start():
    x, y = regression_data(n=16)
    model = accum_mlp(lambda u: keras.ops.where(u < 10, 0, 4))
    model.compile(optimizer="sgd", loss="mse")
    weights = model.get_weights()
    with pytest.raises(
        ValueError, match=r"callable must return an integer >= 1.*at update 0"
    ):
        model.fit(x, y, batch_size=B, verbose=0)
    for u, v in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_array_equal(u, v)


def test_callable_returning_a_length_past_int32_fails_at_fit_start():
    # Before: accepted, and the step's int32 cast wrapped it.
    x, y = regression_data(n=16)
    model = accum_mlp(lambda u: 2**31)
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(
        ValueError, match=r"callable must return at most 2147483647.*at upd"
    ):
        model.fit(x, y, batch_size=B, verbose=0)
    assert int(model.optimizer.iterations) == 0


def test_a_saved_lambda_loads_and_trains(tmp_path):
    """Before: the schedules guide's lambda loaded (with `safe_mode=False`)
    and the next `fit` failed with `NameError: name 'keras' is not
    defined`, on every backend: Keras loads a lambda's code without the
    globals of the module it was written in."""
    x, y = regression_data(n=64)
    model = accum_mlp(lambda u: keras.ops.where(u < 2, 1, 4))
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x[:16], y[:16], batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "lambda.keras")
    with pytest.warns(UserWarning, match="lambda"):  # Keras's own warning.
        model.save(path)
    loaded = keras.saving.load_model(path, safe_mode=False)
    for m in (model, loaded):
        m.fit(x[16:], y[16:], batch_size=B, shuffle=False, verbose=0)
    # 2 windows of 1, then 6 micro-batches: one window of 4, 2 left open
    # and applied at the epoch's end.
    assert int(loaded.optimizer.iterations) == 4
    for u, v in zip(loaded.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_array_equal(u, v)


def test_a_saved_lambda_that_needs_a_name_says_which(tmp_path):
    model = accum_mlp(lambda u: np.int32(2) + keras.ops.zeros_like(u))
    model.compile(optimizer="sgd", loss="mse")
    path = str(tmp_path / "lambda.keras")
    with pytest.warns(UserWarning, match="lambda"):
        model.save(path)
    with pytest.raises(ValueError, match=r"uses `np`.*custom_objects"):
        keras.saving.load_model(path, safe_mode=False)
    loaded = keras.saving.load_model(
        path, safe_mode=False, custom_objects={"np": np}
    )
    x, y = regression_data(n=32)
    loaded.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(loaded.optimizer.iterations) == 2
