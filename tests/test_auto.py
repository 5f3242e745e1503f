"""`accum_steps="auto"`: the controller's rules on hand-computed values,
and `AccumModel` under it, on every backend: each window the controller
chose equals a plain model trained on that window's samples as one batch,
its state is saved and resumed bit for bit, and damaged state is refused.
"""

import math

import keras
import numpy as np
import pytest
from _helpers import (
    KillAt,
    Killed,
    LargeBatch,
    assert_equivalent,
    mlp,
    regression_data,
    replay_windows,
)
from keras import ops

import keras_accum
from keras_accum import _auto_rules as auto
from keras_accum import _compat, _window, _window_fields
from keras_accum.auto import AutoAccumSteps

BACKEND = keras.backend.backend()
B = 8


def _value(x):
    return float(keras.ops.convert_to_numpy(x))


# -- The rules, by hand ----------------------------------------------------


@pytest.mark.parametrize(
    "ideal, expected",
    [
        (4.9, 4),  # Inside the band: 4 x 1.25 = 5 is the first change.
        (5.0, 5),
        (6.6, 7),  # Rounded.
        (100.0, 8),  # At most doubled in one decision.
        (math.inf, 8),  # |G|² not positive: grows, by at most 2.
        (3.3, 4),  # Inside the band: 4 / 1.25 = 3.2 is the first change.
        (3.2, 3),
        (0.5, 2),  # At most halved.
    ],
)
def test_next_length_moves_outside_the_band_by_at_most_two(ideal, expected):
    config = AutoAccumSteps(batch_fraction=1.0, shrink=True)
    length = auto.next_length(ops.convert_to_tensor(4, "int32"), ideal, config)
    assert int(_value(length)) == expected
    # By default the window only grows.
    grows = AutoAccumSteps(batch_fraction=1.0)
    length = auto.next_length(ops.convert_to_tensor(4, "int32"), ideal, grows)
    assert int(_value(length)) == max(expected, 4)


def test_next_length_keeps_to_the_bounds_and_the_batch_fraction():
    current = ops.convert_to_tensor(4, "int32")
    bounded = AutoAccumSteps(
        min_steps=3, max_steps=6, batch_fraction=1.0, shrink=True
    )
    assert _value(auto.next_length(current, 100.0, bounded)) == 6
    assert _value(auto.next_length(current, 0.1, bounded)) == 3
    # Half of an ideal 12 micro-batches: 6.
    half = AutoAccumSteps(batch_fraction=0.5)
    assert _value(auto.next_length(current, 12.0, half)) == 6


def _compiled(function):
    """`function` as each backend compiles a step: TensorFlow's graph and
    XLA, JAX's jit; PyTorch runs it eagerly, as its steps do."""
    if BACKEND == "tensorflow":
        import tensorflow as tf

        return [tf.function(function), tf.function(function, jit_compile=True)]
    if BACKEND == "jax":
        import jax

        return [jax.jit(function)]
    return []


@pytest.mark.parametrize(
    "current, ideal",
    [
        (2**30 + 5, math.inf),  # Doubled: past 2**31 - 1.
        (2**30 + 5, 3e9),
        (2**31 - 1, math.inf),  # At the bound already.
        (2**31 - 200, 2**31 - 150.0),  # Inside the band: unchanged.
        (2**30, 2**31 - 1000.0),  # Below the bound: as float32 rounds it.
    ],
)
def test_next_length_at_the_largest_max_steps_stays_in_int32(current, ideal):
    """Before: the bound 2**31 - 1 was 2**31 in float32, cast to int32 as
    -2147483648 on TensorFlow (graph and eager) and PyTorch; XLA
    saturated."""
    config = AutoAccumSteps(max_steps=2**31 - 1, batch_fraction=1.0)
    expected = {
        math.inf: 2**31 - 1,
        3e9: 2**31 - 1,
        2**31 - 150.0: 2**31 - 200,
        2**31 - 1000.0: int(np.float32(2**31 - 1000.0)),
    }[ideal]

    def run(length, ideal):
        return auto.next_length(length, ideal, config)

    length = ops.convert_to_tensor(current, "int32")
    ideal_tensor = ops.convert_to_tensor(ideal, "float32")
    for function in [run, *_compiled(run)]:
        got = keras.ops.convert_to_numpy(function(length, ideal_tensor))
        assert got.dtype == np.int32
        assert int(got) == expected, function


def test_noise_scale_is_the_ratio_and_infinite_without_signal():
    assert _value(auto.noise_scale(45.0, 0.03)) == pytest.approx(1500.0)
    assert math.isinf(_value(auto.noise_scale(45.0, 0.0)))
    assert math.isinf(_value(auto.noise_scale(45.0, -0.01)))
    # A negative trace estimate counts as no noise.
    assert _value(auto.noise_scale(-3.0, 0.5)) == 0.0


@pytest.mark.parametrize(
    "trace, grad_sq, scale, expected",
    [
        # σ² = 8 / 4 = 2: (2 + 1) / (2 / 4 + 1) = 2.
        (8.0, 1.0, 4.0, 2.0),
        (8.0, 0.0, 4.0, 4.0),  # Pure noise: linear scaling.
        (0.0, 1.0, 4.0, 1.0),  # No noise: no gain.
        (8.0, -1.0, 4.0, 4.0),  # Negative |G|² counts as 0.
        (8.0, 1.0, 1.0, 1.0),  # The base batch.
        (0.0, 0.0, 4.0, 1.0),  # Nothing measured.
    ],
)
def test_adascale_gain_by_hand(trace, grad_sq, scale, expected):
    gain = auto.adascale_gain(trace, grad_sq, scale, 4.0)
    assert _value(gain) == pytest.approx(expected)


def _counters(**values):
    fields = {}
    for field in _window_fields.FIELDS:
        fields[field.name] = ops.zeros(field.shape, field.dtype)
    fields["target_length"] = ops.convert_to_tensor(2, "int32")
    for name, value in values.items():
        fields[name] = ops.convert_to_tensor(value, fields[name].dtype)
    return _window.Counters.from_flat(fields.values())


def _steer(counters, estimates, window, config, rate=(None, True)):
    """`counters` with the controller and target length `steer` gives."""
    controller, length = auto.steer(
        counters.auto, counters.target_length, estimates, window, rate, config
    )
    return counters._replace(auto=controller, target_length=length)


def test_steer_smooths_then_decides_after_the_warmup():
    config = AutoAccumSteps(smoothing=0.5, warmup=2, batch_fraction=1.0)
    counters = _counters()
    taken = ops.convert_to_tensor(True)
    # First estimate: averages 0.5 x 10 = 5 and 0.5 x 0.5 = 0.25, one
    # measured: below the warmup, the length stays 2. Windows of one
    # micro-batch (the decay per window is 0.5 ** 1) of 4 samples.
    window = (1.0, 4.0)
    counters = _steer(counters, (10.0, 0.5, taken), window, config)
    assert _value(counters.auto.trace) == pytest.approx(5.0)
    assert _value(counters.auto.grad_sq) == pytest.approx(0.25)
    assert _value(counters.auto.estimates) == 1
    assert _value(counters.target_length) == 2
    # Second: 0.5 x 5 + 0.5 x 10 = 7.5 and 0.375: B_simple = 20 samples,
    # 5 micro-batches of 4; from 2, at most doubled: 4.
    counters = _steer(counters, (10.0, 0.5, taken), window, config)
    assert _value(counters.target_length) == 4
    # A change restarts the count: the next waits for `warmup` windows of
    # the new length.
    assert _value(counters.auto.estimates) == 0
    # An estimate that does not count (NaN, or no window) changes nothing.
    skipped = ops.convert_to_tensor(False)
    same = _steer(counters, (float("nan"), 0.5, skipped), window, config)
    for name in ("trace", "grad_sq", "estimates"):
        assert _value(getattr(same.auto, name)) == _value(
            getattr(counters.auto, name)
        )
    assert _value(same.target_length) == 4
    # A window of 2 micro-batches decays the averages by 0.5 ** 2.
    longer = _steer(counters, (10.0, 0.5, taken), (2.0, 4.0), config)
    expected = 0.25 * _value(counters.auto.trace) + 0.75 * 10.0
    assert _value(longer.auto.trace) == pytest.approx(expected)


def test_steer_waits_while_the_average_gradient_is_not_positive():
    config = AutoAccumSteps(smoothing=0.5, warmup=1, batch_fraction=1.0)
    taken = ops.convert_to_tensor(True)
    counters = _steer(_counters(), (10.0, -0.5, taken), (1.0, 4.0), config)
    assert _value(counters.auto.estimates) == 1
    assert _value(counters.target_length) == 2


def test_learning_rate_rules_by_hand():
    counters = _counters(auto_trace=8.0, auto_grad_sq=1.0, auto_progress=3.5)

    def rate(rule):
        config = AutoAccumSteps(min_steps=2, lr_scaling=rule)
        # 8 micro-batches of 2 samples: S = 8 / 2 = 4, base batch 4.
        return auto.learning_rate(counters.auto, config, 8, 16.0)

    assert rate(None) is None
    assert _value(rate("sqrt").scale) == pytest.approx(2.0)
    assert _value(rate("linear").scale) == pytest.approx(4.0)
    adascale = rate("adascale")
    assert _value(adascale.scale) == pytest.approx(2.0)
    assert _value(adascale.progress) == pytest.approx(3.5)


def test_scaled_learning_rate_reads_a_schedule_at_the_progress():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 10, 0.5)
    optimizer = keras.optimizers.SGD(schedule)
    rate = auto.Rate(ops.convert_to_tensor(3.0), ops.convert_to_tensor(20.0))
    with _compat.learning_rate_scaled(optimizer, rate):
        # 3 x 0.1 x 0.5 ** (20 / 10), not at `iterations` (0).
        assert _value(optimizer.learning_rate) == pytest.approx(0.075)
    assert _value(optimizer.learning_rate) == pytest.approx(0.1)
    constant = keras.optimizers.Adam(0.01)
    with _compat.learning_rate_scaled(constant, auto.Rate(2.0)):
        assert _value(constant.learning_rate) == pytest.approx(0.02)
    assert _value(constant.learning_rate) == pytest.approx(0.01)


# -- Configuration -------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"min_steps": 1}, r"`min_steps` must be an integer >= 2\. Rec.*=1"),
        ({"min_steps": 4, "max_steps": 3}, r"`max_steps` must be .*>= 4"),
        ({"batch_fraction": 0}, r"`batch_fraction` must be a positive"),
        ({"smoothing": 1.0}, r"`smoothing` must be a number in \[0, 1\)"),
        ({"warmup": 0}, r"`warmup` must be an integer >= 1"),
        ({"lr_scaling": "cubic"}, r"`lr_scaling` must be one of .*'cubic'"),
        ({"max_steps": True}, r"`max_steps` must be an integer"),
        # Window lengths and counts are int32 in the step: 2**31 wrapped
        # to -2**31 on TensorFlow, and overflowed on JAX and PyTorch.
        (
            {"min_steps": 2**31, "max_steps": 2**31},
            r"`min_steps` must be at most 2147483647.*=2147483648",
        ),
        (
            {"max_steps": 2**32 + 3},
            r"`max_steps` must be at most 2147483647.*=4294967299",
        ),
        ({"warmup": 2**31}, r"`warmup` must be at most 2147483647"),
        # Infinity doubled the window after every warmup; NaN compares
        # false everywhere.
        ({"batch_fraction": math.inf}, r"`batch_fraction` .*finite.*=inf"),
        ({"batch_fraction": math.nan}, r"`batch_fraction` .*finite.*=nan"),
        ({"smoothing": -math.inf}, r"`smoothing` must be .*=-inf"),
        # 1.0 in float32, where the controller runs: it never decided.
        (
            {"smoothing": 1 - 1e-8},
            r"`smoothing` .*below 1 in float32.*=0\.99999999",
        ),
        # 0 and inf in float32.
        ({"batch_fraction": 1e-50}, r"`batch_fraction` .*float32.*=1e-50"),
        ({"batch_fraction": 1e39}, r"`batch_fraction` .*float32.*=1e\+39"),
    ],
)
def test_bad_settings_are_refused_naming_them(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AutoAccumSteps(**kwargs)


def test_auto_string_and_other_strings():
    model = mlp(keras_accum.AccumModel, accum_steps="auto")
    assert model.accum_steps == AutoAccumSteps()
    assert model.window_length == 2
    with pytest.raises(TypeError, match=r'or "auto".*accum_steps=\'fast\''):
        mlp(keras_accum.AccumModel, accum_steps="fast")


def test_config_saves_loads_clones_and_converts(tmp_path):
    config = AutoAccumSteps(max_steps=16, lr_scaling="sqrt", warmup=3)
    model = mlp(keras_accum.AccumModel, accum_steps=config)
    path = tmp_path / "auto.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.accum_steps == config
    assert keras.models.clone_model(model).accum_steps == config
    converted = keras_accum.AccumModel.from_model(mlp(), accum_steps="auto")
    assert converted.accum_steps == AutoAccumSteps()


# -- The model -----------------------------------------------------------------

# Windows that change length within a few epochs of 25 micro-batches: the
# small model's noise scale is tens of samples, so a large fraction of it.
STEERED = {"min_steps": 2, "max_steps": 8, "warmup": 2, "smoothing": 0.5}
# How far the windows aim: far past the small model's noise scale.
FRACTION = 4.0


def _replay(plain, x, y, updates, epochs, weighted=False):
    """`replay_windows` at this module's micro-batch, with the updates'
    learning-rate scales as sample weights if `weighted`."""
    return replay_windows(plain, x, y, updates, epochs, B, lr_scaled=weighted)


def _fit_auto(config, optimizer, x, y, epochs, **kwargs):
    model = mlp(keras_accum.AccumModel, accum_steps=config, **kwargs)
    model.compile(optimizer=optimizer, loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    history = model.fit(
        x,
        y,
        batch_size=B,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    return model, logger, history


@pytest.mark.parametrize("partial_window", ["apply", "carry"])
def test_each_window_equals_the_plain_model_on_its_samples(
    partial_window, report_diff
):
    # 196 samples: each epoch ends on a micro-batch of 4.
    x, y = regression_data(n=196)
    config = AutoAccumSteps(batch_fraction=FRACTION, **STEERED)
    accum, logger, history = _fit_auto(
        config,
        keras.optimizers.Adam(0.01),
        x,
        y,
        epochs=4,
        partial_window=partial_window,
    )
    lengths = [u.micro_batches for u in logger.updates]
    # The controller moved the window: not one fixed length.
    assert len(set(lengths[:-1])) >= 3, lengths
    assert max(lengths) > STEERED["min_steps"]
    assert all(u.lr_scale == 1.0 for u in logger.updates)
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    left = _replay(plain, x, y, logger.updates, epochs=4)
    assert left == accum.mini_step
    assert int(accum.optimizer.iterations) == len(logger.updates)
    diff = assert_equivalent(accum, plain)
    report_diff(diff, f"auto, partial_window={partial_window!r}")
    # The epoch logs say which length comes next, and its batch: micro-
    # batches of 8, one of 4 per epoch (7.84 on average over an epoch;
    # `"carry"` windows straddle epochs).
    logs = history.history
    target = _value(accum._window.counters.target_length)
    assert logs["pseudo_batch_window_length"][-1] == target
    size = logs["pseudo_batch_size"][-1] / target
    assert 7.6 <= size <= 8.0, size


@pytest.mark.parametrize("lr_scaling", ["sqrt", "linear", "adascale"])
def test_scaled_learning_rates_equal_the_plain_model_given_them(
    lr_scaling, report_diff
):
    x, y = regression_data(n=196)
    config = AutoAccumSteps(
        batch_fraction=FRACTION, lr_scaling=lr_scaling, **STEERED
    )

    def sgd():
        return keras.optimizers.SGD(0.02, momentum=0.9)

    accum, logger, _ = _fit_auto(config, sgd(), x, y, epochs=3)
    scales = [u.lr_scale for u in logger.updates]
    lengths = [u.micro_batches for u in logger.updates]
    assert max(scales) > 1.0, scales
    if lr_scaling == "linear":
        expected = [n / STEERED["min_steps"] for n in lengths]
        np.testing.assert_allclose(scales, expected, rtol=1e-6)
    elif lr_scaling == "sqrt":
        expected = [math.sqrt(n / STEERED["min_steps"]) for n in lengths]
        np.testing.assert_allclose(scales, expected, rtol=1e-6)
    else:
        # Between 1 and S, and the progress is their sum.
        for scale, n in zip(scales, lengths, strict=True):
            s = n / STEERED["min_steps"]
            assert min(1, s) - 1e-6 <= scale <= max(1, s) + 1e-6
        progress = _value(accum._window.counters.auto.progress)
        assert progress == pytest.approx(sum(scales), rel=1e-5)
    plain = mlp()
    plain.compile(optimizer=sgd(), loss="mse")
    plain = LargeBatch(plain)
    _replay(plain, x, y, logger.updates, epochs=3, weighted=True)
    diff = assert_equivalent(accum, plain)
    report_diff(diff, f"auto, lr_scaling={lr_scaling!r}")


def test_adascale_reads_a_schedule_at_its_progress(report_diff):
    """Each update's learning rate is its gain times the schedule at the
    sum of the gains before it: a plain SGD at learning rate 1 given that
    product as sample weights trains the same."""
    x, y = regression_data(n=196)
    config = AutoAccumSteps(
        batch_fraction=FRACTION, lr_scaling="adascale", **STEERED
    )
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 4, 0.8)
    accum, logger, _ = _fit_auto(
        config, keras.optimizers.SGD(schedule, momentum=0.9), x, y, epochs=3
    )
    gains = np.array([u.lr_scale for u in logger.updates])
    assert gains.max() > 1.0, gains
    progress = np.concatenate([[0.0], np.cumsum(gains)[:-1]])
    rates = gains * 0.05 * 0.8 ** (progress / 4)

    plain = mlp()
    plain.compile(optimizer=keras.optimizers.SGD(1.0, momentum=0.9), loss="mse")
    plain = LargeBatch(plain)
    scaled = [
        u._replace(lr_scale=r)
        for u, r in zip(logger.updates, rates, strict=True)
    ]
    _replay(plain, x, y, scaled, epochs=3, weighted=True)
    report_diff(assert_equivalent(accum, plain), "auto, AdaScale schedule")


def _masked_model(model_cls=keras.Model, **kwargs):
    # `Masking`, not an embedding's mask: plain Keras on TensorFlow applies
    # Adam to an embedding's sparse gradient otherwise than to the same
    # dense one (see the embeddings guide), and the replay would differ.
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6, 2))
    hidden = keras.layers.Masking(0.0)(inputs)
    outputs = keras.layers.Dense(3)(keras.layers.Dense(4)(hidden))
    return model_cls(inputs, outputs, **kwargs)


@pytest.mark.parametrize("case", ["sample_weights", "masked"])
def test_weighted_and_masked_windows_replay_exactly(case, report_diff):
    """The noise scale counts what the loss averages over (sample-weight
    totals, unmasked timesteps); the windows stay exact."""
    rng = np.random.default_rng(2)
    weights = None
    if case == "masked":
        # All-zero timesteps are masked out: about a quarter of them.
        x = rng.normal(size=(196, 6, 2)).astype("float32")
        x[rng.random((196, 6)) < 0.25] = 0.0
        y = rng.normal(size=(196, 6, 3)).astype("float32")
    else:
        x, y = regression_data(n=196)
        weights = rng.uniform(0.0, 2.0, size=196).astype("float32")
    config = AutoAccumSteps(batch_fraction=FRACTION, **STEERED)
    build = _masked_model if case == "masked" else mlp
    accum = build(keras_accum.AccumModel, accum_steps=config)
    accum.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    accum.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=B,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    lengths = [u.micro_batches for u in logger.updates]
    assert len(set(lengths[:-1])) >= 2, lengths
    # Every window of two micro-batches or more measures (an epoch's last
    # may have one).
    assert all(
        math.isfinite(u.trace) and math.isfinite(u.grad_sq)
        for u in logger.updates
        if u.micro_batches >= 2
    )
    plain = build()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    replay_windows(plain, x, y, logger.updates, 3, B, sample_weight=weights)
    report_diff(assert_equivalent(accum, plain), f"auto, {case}")


@pytest.mark.skipif(
    BACKEND != "jax", reason="keras.distribution.DataParallel is JAX's"
)
def test_jax_data_parallel_replays_exactly(report_diff):
    """Under `keras.distribution` the step is one program over the devices:
    the estimates are the whole micro-batch's."""
    import jax

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    try:
        x, y = regression_data(n=196)
        config = AutoAccumSteps(batch_fraction=FRACTION, **STEERED)
        accum, logger, _ = _fit_auto(
            config, keras.optimizers.Adam(0.01), x, y, epochs=3
        )
        lengths = [u.micro_batches for u in logger.updates]
        assert len(set(lengths[:-1])) >= 2, lengths
        plain = mlp()
        plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        plain = LargeBatch(plain)
        _replay(plain, x, y, logger.updates, epochs=3)
        diff = assert_equivalent(accum, plain)
    finally:
        keras.distribution.set_distribution(None)
    report_diff(diff, "auto, JAX DataParallel, 2 devices")


def _controller(model):
    counters = model._window.counters
    names = (
        "target_length",
        "window_length",
        "mini_step",
        "auto_trace",
        "auto_grad_sq",
        "auto_estimates",
        "auto_progress",
    )
    return {n: _value(counters.get(n)) for n in names}


def test_a_killed_run_resumes_bit_identical(tmp_path):
    x, y = regression_data(n=196)
    config = AutoAccumSteps(
        batch_fraction=FRACTION, lr_scaling="adascale", **STEERED
    )

    def run(callbacks, epochs=5):
        model = mlp(
            keras_accum.AccumModel, accum_steps=config, partial_window="carry"
        )
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        return model

    whole = run([])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(Killed):
        run([backup, KillAt(3)])
    resumed = run([keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    assert _controller(resumed) == _controller(whole)
    assert _controller(whole)["auto_estimates"] > 0
    for a, b in zip(whole.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(resumed.optimizer.iterations) == int(whole.optimizer.iterations)


def test_damaged_controller_state_is_refused(tmp_path):
    import h5py

    x, y = regression_data(n=64)
    model, _, _ = _fit_auto(
        AutoAccumSteps(**STEERED), keras.optimizers.Adam(0.01), x, y, 1
    )
    path = tmp_path / "w.weights.h5"
    model.save_weights(path)
    with h5py.File(path, "r+") as h5:
        group = h5["_window/vars"]
        del group["auto_trace"]
        group["auto_trace"] = np.float32("nan")
    with pytest.raises(ValueError, match=r"`auto_trace` = nan is outside"):
        model.load_weights(path)


def test_switching_to_auto_between_fits_goes_on_from_the_length():
    x, y = regression_data(n=64)
    model = mlp(keras_accum.AccumModel, accum_steps=16)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    model.accum_steps = AutoAccumSteps(max_steps=6)
    # Within the new bounds: 16 becomes 6, where the controller starts.
    assert _value(model._window.counters.target_length) == 6
    logger = keras_accum.PseudoBatchLogger()
    model.fit(x, y, batch_size=B, epochs=1, verbose=0, callbacks=[logger])
    assert [u.micro_batches for u in logger.updates] == [6, 2]
    model.accum_steps = 4
    assert _value(model._window.counters.target_length) == 4


def test_the_largest_max_steps_is_reached_in_a_fit():
    """Before: on TensorFlow's graph and PyTorch the window that would
    reach `max_steps=2**31 - 1` set the target length to -2147483648; the
    next epoch's windows were then one micro-batch long."""
    x, y = regression_data(n=3 * B)
    # Random targets: a noise scale far above the batch, so that the
    # controller doubles the window at its first decision.
    y = np.random.default_rng(1).normal(size=y.shape).astype("float32")
    config = AutoAccumSteps(
        min_steps=2**30,
        max_steps=2**31 - 1,
        batch_fraction=1e30,
        smoothing=0.0,
        warmup=1,
    )
    model = mlp(keras_accum.AccumModel, accum_steps=config)
    model.compile(optimizer="sgd", loss="mse")
    logger = keras_accum.PseudoBatchLogger()
    model.fit(x, y, batch_size=B, epochs=2, verbose=0, callbacks=[logger])
    # Each epoch's 3 micro-batches, applied at its end.
    assert [u.micro_batches for u in logger.updates] == [3, 3]
    assert model.window_length == 2**31 - 1
    assert _value(model._window.counters.target_length) == 2**31 - 1


def test_a_recompile_keeps_the_controller():
    # Freeze, fit, unfreeze, compile: the pattern of fine-tuning. Before,
    # `compile()` dropped the window state and the controller started
    # again at `min_steps` with a fresh warmup.
    x, y = regression_data(n=64)
    config = AutoAccumSteps(batch_fraction=FRACTION, **STEERED)
    model, logger, _ = _fit_auto(
        config, keras.optimizers.Adam(0.01), x, y, epochs=4
    )
    kept = _controller(model)
    assert kept["target_length"] > STEERED["min_steps"], kept
    model.layers[-1].trainable = False
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    assert model.window_length == kept["target_length"]
    after = keras_accum.PseudoBatchLogger()
    model.fit(
        x,
        y,
        batch_size=B,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[after],
    )
    # The first window after the recompile has the length reached before.
    assert after.updates[0].micro_batches == kept["target_length"]
    # A new optimizer: AdaScale's progress restarts with its update count.
    assert _controller(model)["auto_progress"] == 0.0


def test_mixed_precision_estimates_leave_the_loss_scale_out():
    x, y = regression_data(n=196)
    # With a learning-rate rule: the scale goes to the loss-scale
    # optimizer's inner optimizer.
    config = AutoAccumSteps(
        batch_fraction=FRACTION, lr_scaling="sqrt", **STEERED
    )
    found = {}
    for policy in ("float32", "mixed_float16"):
        keras.config.set_dtype_policy(policy)
        try:
            model, logger, _ = _fit_auto(
                config, keras.optimizers.Adam(0.01), x, y, 1
            )
        finally:
            keras.config.set_dtype_policy("float32")
        found[policy] = _controller(model)
        assert max(u.lr_scale for u in logger.updates) > 1.0
    # The same estimates to float16's precision, not multiplied by the
    # loss scale (2**15) or its square.
    for name in ("auto_trace", "auto_grad_sq"):
        assert found["mixed_float16"][name] == pytest.approx(
            found["float32"][name], rel=0.05
        ), name


@pytest.mark.skipif(
    BACKEND != "tensorflow", reason="tf.function's XLA flag (TensorFlow)"
)
def test_xla_and_steps_per_execution(report_diff):
    x, y = regression_data(n=196)
    config = AutoAccumSteps(batch_fraction=FRACTION, **STEERED)
    model = mlp(keras_accum.AccumModel, accum_steps=config)
    model.compile(
        optimizer=keras.optimizers.Adam(0.01),
        loss="mse",
        jit_compile=True,
        steps_per_execution=3,
    )
    logger = keras_accum.PseudoBatchLogger()
    model.fit(
        x,
        y,
        batch_size=B,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    assert len({u.micro_batches for u in logger.updates}) >= 2
    plain = mlp()
    plain.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    plain = LargeBatch(plain)
    _replay(plain, x, y, logger.updates, epochs=3)
    report_diff(assert_equivalent(model, plain), "auto under XLA, spe=3")
