"""`accumulator_dtype="bfloat16"`: half-size accumulators, stochastic rounding.

The promise changes here, on purpose: a bfloat16 accumulator is not exact.
What is asserted instead: which weights get one; that the setting travels
with the model; that the rounding is unbiased where round-to-nearest (what
Keras's own accumulation does in bfloat16) loses small gradients, with
hand-computed sums over thousands of elements; that training stays close
to the large batch; and that the random bits are the window's state, so
a resumed run is bit-identical to an uninterrupted one.
"""

import math

import keras
import numpy as np
import pytest
from _helpers import KillAt, Killed, build_optimizer, regression_data

import keras_accum
from keras_accum import _codecs, _rounding

WIDE = 128  # a 128 x 128 kernel: 16384 elements, the threshold exactly


def _wide(model_cls=keras.Model, seed=1, use_bias=True, **kwargs):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((WIDE,))
    hidden = keras.layers.Dense(WIDE, activation="tanh", use_bias=use_bias)(
        inputs
    )
    outputs = keras.layers.Dense(3)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, WIDE)).astype("float32")
    y = rng.standard_normal((n, 3)).astype("float32")
    return x, y


def _dtypes(model):
    return [
        keras.backend.standardize_dtype(a.dtype)
        for a in model._window.acc_grads
    ]


# -- The setting ------------------------------------------------------------


@pytest.mark.parametrize(
    "value, error, match",
    [
        (16, TypeError, r"accumulator_dtype=16 \(of type int\)"),
        (True, TypeError, r"accumulator_dtype=True \(of type bool\)"),
        ("float16", ValueError, r"float16 accumulators are not offered"),
        ("bf16", ValueError, r"Received: accumulator_dtype='bf16'"),
        ("BFloat16", ValueError, r"Received: accumulator_dtype='BFloat16'"),
    ],
)
def test_a_bad_accumulator_dtype_is_refused_naming_it(value, error, match):
    with pytest.raises(error, match=match):
        _wide(keras_accum.AccumModel, accumulator_dtype=value)
    with pytest.raises(error, match=match):
        keras_accum.AccumModel.from_model(_wide(), accumulator_dtype=value)
    model = _wide(keras_accum.AccumModel)
    with pytest.raises(error, match=match):
        model.accumulator_dtype = value
    assert model.accumulator_dtype is None


def test_large_weights_get_bfloat16_accumulators_small_ones_float32():
    x, y = _data()
    model = _wide(
        keras_accum.AccumModel, accum_steps=2, accumulator_dtype="bfloat16"
    )
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    # Kernel 128 x 128 (the threshold), bias 128, kernel 128 x 3, bias 3.
    assert _codecs.SMALL_WEIGHT == 2**14 == WIDE * WIDE
    assert _dtypes(model) == ["bfloat16", "float32", "float32", "float32"]
    # Each micro-batch took one draw of random bits.
    assert (
        int(keras.ops.convert_to_numpy(model._window.counters.rounding_draws))
        == 4
    )
    # "float32" is the default, spelled out.
    same = _wide(keras_accum.AccumModel, accumulator_dtype="float32")
    assert same.accumulator_dtype is None
    same.compile(optimizer="sgd", loss="mse")
    same.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert set(_dtypes(same)) == {"float32"}
    assert (
        int(keras.ops.convert_to_numpy(same._window.counters.rounding_draws))
        == 0
    )


def test_under_a_bfloat16_policy_the_default_keeps_float32_accumulators():
    x, y = _data()
    keras.config.set_dtype_policy("bfloat16")
    try:
        for setting, large in ((None, "float32"), ("bfloat16", "bfloat16")):
            model = _wide(
                keras_accum.AccumModel, accum_steps=2, accumulator_dtype=setting
            )
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            before = model.get_weights()[0].copy()
            model.fit(x, y, batch_size=16, epochs=1, verbose=0)
            assert model.trainable_weights[0].dtype == "bfloat16"
            assert _dtypes(model) == [large, "float32", "float32", "float32"]
            assert not np.array_equal(before, model.get_weights()[0])
    finally:
        keras.config.set_dtype_policy("float32")


def test_the_setting_survives_config_clone_conversion_and_saving(tmp_path):
    model = _wide(keras_accum.AccumModel, accumulator_dtype="bfloat16")
    assert model.get_config()["accumulator_dtype"] == "bfloat16"
    copies = {
        "from_config": keras_accum.AccumModel.from_config(model.get_config()),
        "clone_model": keras.models.clone_model(model),
        "from_model": keras_accum.AccumModel.from_model(
            _wide(), accumulator_dtype="bfloat16"
        ),
    }

    class Subclassed(keras.Model):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.dense = keras.layers.Dense(WIDE)

        def call(self, inputs):
            return self.dense(inputs)

    inner = Subclassed()
    inner(np.zeros((1, WIDE), "float32"))
    wrapped = keras_accum.AccumModel.from_model(
        inner, accumulator_dtype="bfloat16", micro_batch_size=8
    )
    config = wrapped.get_config()
    assert config["accumulator_dtype"] == "bfloat16"
    # Before: the wrapped model's config dropped `micro_batch_size`.
    assert config["micro_batch_size"] == 8
    revived = type(wrapped).from_config(
        config, custom_objects={"Subclassed": Subclassed}
    )
    assert revived.micro_batch_size == 8
    assert revived.accumulator_dtype == "bfloat16"
    x, y = _data()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=16, verbose=0)
    path = tmp_path / "model.keras"
    model.save(path)
    copies["load_model"] = keras.saving.load_model(path)
    for name, copy in copies.items():
        assert copy.accumulator_dtype == "bfloat16", name
    loaded = copies["load_model"]
    assert _dtypes(loaded)[0] == "bfloat16"
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(loaded._window.acc_grads[0]).astype(
            "float32"
        ),
        keras.ops.convert_to_numpy(model._window.acc_grads[0]).astype(
            "float32"
        ),
    )


# -- The rounding -------------------------------------------------------------


class _SumOfOutputs(keras.losses.Loss):
    """Each sample's loss is the sum of its outputs: with one sample per
    micro-batch, a bias-free kernel's gradient is the input, row by row."""

    def call(self, y_true, y_pred):
        return keras.ops.sum(y_pred, axis=-1)


def _summed_window(accumulator_dtype, k, big=256.0, small=0.5):
    """The kernel's accumulator after k micro-batches of one sample: the
    first's gradient is `big` in every element, the others' `small`."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((WIDE,))
    outputs = keras.layers.Dense(WIDE, use_bias=False)(inputs)
    model = keras_accum.AccumModel(
        inputs,
        outputs,
        # The window stays open (no close at the epoch's end either): its
        # sum is readable.
        accum_steps=k + 1,
        partial_window="carry",
        accumulator_dtype=accumulator_dtype,
    )
    model.compile(optimizer="sgd", loss=_SumOfOutputs())
    x = np.full((k, WIDE), small, "float32")
    x[0] = big
    model.fit(
        x,
        np.zeros((k, WIDE), "float32"),
        batch_size=1,
        verbose=0,
        shuffle=False,
    )
    assert model.mini_step == k
    acc = model._window.acc_grads[0]
    return keras.ops.convert_to_numpy(keras.ops.cast(acc, "float32")).astype(
        "float64"
    )


def _keras_bfloat16_window(k, big=256.0, small=0.5):
    """The same sums in Keras's own accumulation under a bfloat16 policy:
    its accumulators are bfloat16 and round to nearest."""
    keras.config.set_dtype_policy("bfloat16")
    try:
        keras.utils.set_random_seed(2)
        inputs = keras.Input((WIDE,))
        outputs = keras.layers.Dense(WIDE, use_bias=False)(inputs)
        model = keras.Model(inputs, outputs)
        model.compile(
            optimizer=keras.optimizers.SGD(gradient_accumulation_steps=k + 1),
            loss=_SumOfOutputs(),
        )
        x = np.full((k, WIDE), small, "float32")
        x[0] = big
        model.fit(
            x,
            np.zeros((k, WIDE), "float32"),
            batch_size=1,
            verbose=0,
            shuffle=False,
        )
        # Keras's accumulators (private; read for the comparison only).
        acc = model.optimizer._accumulated_gradients[0]
        return keras.ops.convert_to_numpy(keras.ops.cast(acc, "float32"))
    finally:
        keras.config.set_dtype_policy("float32")


@pytest.mark.parametrize("k", [8, 64, 256])
def test_stochastic_rounding_is_unbiased_where_round_to_nearest_stagnates(k):
    true_sum = 256.0 + (k - 1) * 0.5  # every partial sum exact in float32
    exact = _summed_window(None, k)
    np.testing.assert_array_equal(exact, true_sum)
    # Keras's bfloat16 accumulation: 256 + 0.5 rounds back to 256, every
    # time (half a unit in the last place is 1 there).
    np.testing.assert_array_equal(_keras_bfloat16_window(k), 256.0)
    rounded = _summed_window("bfloat16", k)
    # Each addition's error has mean 0 and variance at most ulp² / 4 (a
    # unit in the last place of the running sum): each element's error
    # has a standard deviation at most ulp * sqrt(k - 1) / 2, and none of
    # the N elements is 6 of them off.
    ulp = 2.0 ** (math.floor(math.log2(true_sum)) - 7)
    spread = ulp * math.sqrt(k - 1) / 2
    assert np.abs(rounded - true_sum).max() <= 6 * spread
    # The rounding is random: the elements differ.
    assert np.unique(rounded).size >= 4
    # Unbiased: the mean of the N elements' errors has a standard
    # deviation at most spread / sqrt(N).
    bound = spread / math.sqrt(rounded.size)
    error = rounded.mean() - true_sum
    assert abs(error) <= 5 * bound, (error, bound)
    # What round-to-nearest loses is (k - 1) / 2: hundreds of bounds.
    assert (k - 1) * 0.5 > 100 * bound


def test_rounding_edge_values():
    # Infinities and NaNs stay what they are (a NaN's bits would wrap to a
    # zero), values already bfloat16 stay exactly, and the bits round up
    # only as far as the next bfloat16.
    total = np.array(
        [np.inf, -np.inf, np.nan, -np.nan, 1.0, -3.0, 0.0, 1.0 + 2.0**-9],
        "float32",
    )
    nan_bits = np.array([0x7FFFFFFF, 0xFFFFFFFF], "uint32").view("float32")
    total = np.concatenate([total, nan_bits])
    for bits in (0, 2**16 - 1):
        out = keras.ops.convert_to_numpy(
            keras.ops.cast(
                _rounding.rounded(
                    keras.ops.convert_to_tensor(total),
                    keras.ops.full(total.shape, bits, "int32"),
                ),
                "float32",
            )
        )
        np.testing.assert_array_equal(out[:2], [np.inf, -np.inf])
        assert np.isnan(out[2:4]).all() and np.isnan(out[8:]).all()
        np.testing.assert_array_equal(out[4:7], [1.0, -3.0, 0.0])
        # 1 + 2**-9 lies between 1 and 1 + 2**-7: truncated, or up.
        assert out[7] == (1.0 if bits == 0 else 1.0 + 2.0**-7)


# -- Training ---------------------------------------------------------------


@pytest.mark.parametrize("mode", ["accum_steps", "micro_batch_size"])
def test_training_stays_close_to_the_large_batch(mode):
    x, y = _data(n=96)
    plain = _wide()
    plain.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse"
    )
    build_optimizer(plain)
    start = [w.copy() for w in plain.get_weights()]
    settings = (
        dict(accum_steps=4)
        if mode == "accum_steps"
        else dict(micro_batch_size=8)
    )
    runs = {}
    for dtype in (None, "bfloat16"):
        model = _wide(
            keras_accum.AccumModel, accumulator_dtype=dtype, **settings
        )
        model.compile(
            optimizer=keras.optimizers.SGD(0.05, momentum=0.9), loss="mse"
        )
        batch = 8 if mode == "accum_steps" else 32
        model.fit(x, y, batch_size=batch, epochs=3, verbose=0, shuffle=False)
        runs[dtype] = model.get_weights()
    plain.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False)
    expected = plain.get_weights()
    moved = np.linalg.norm(expected[0] - start[0])
    exact = np.linalg.norm(runs[None][0] - expected[0])
    rounded = np.linalg.norm(runs["bfloat16"][0] - expected[0])
    # float32 accumulators: float32 rounding; bfloat16: the kernel's window
    # sums carry about 2**-9 relative error per addition, so the weights
    # stay within a small fraction of how far training moved them, and
    # differ from the exact run (the rounding happened).
    assert exact <= 1e-4 * moved
    assert 10 * exact < rounded <= 2e-2 * moved, (exact, rounded, moved)
    # The small weights' accumulators are float32: as exact as before.
    for a, b in zip(runs[None][1:], expected[1:], strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-2 * np.abs(b).max())


class OpenWindows(keras.callbacks.Callback):
    """The micro-batches of the open window at each epoch's end (where
    `BackupAndRestore` saves)."""

    def __init__(self):
        super().__init__()
        self.mini_steps = []

    def on_epoch_end(self, epoch, logs=None):
        self.mini_steps.append(self.model.mini_step)


def _killed_after_epoch_one(tmp_path, backup):
    """A `_carry_run` backed up to `backup` and killed in epoch 2; its
    `OpenWindows`. 9 micro-batches an epoch, windows of 4 carried across
    epochs: the backup at the end of epoch 1 holds an open window."""
    open_windows = OpenWindows()
    with pytest.raises(Killed):
        _carry_run(
            tmp_path,
            [
                keras.callbacks.BackupAndRestore(backup),
                open_windows,
                KillAt(2),
            ],
        )
    return open_windows


def _carry_run(tmp_path, callbacks, seed=1, accumulator_dtype="bfloat16"):
    x, y = regression_data(n=70, features=WIDE)
    model = _wide(
        keras_accum.AccumModel,
        seed=seed,
        accum_steps=4,
        partial_window="carry",
        accumulator_dtype=accumulator_dtype,
    )
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        verbose=0,
        shuffle=False,
        callbacks=callbacks,
    )
    return model


def test_a_resumed_run_draws_the_same_bits_and_ends_bit_identical(tmp_path):
    whole = _carry_run(tmp_path, [])
    again = _carry_run(tmp_path, [])
    for a, b in zip(whole.get_weights(), again.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    backup = str(tmp_path / "backup")
    open_windows = _killed_after_epoch_one(tmp_path, backup)
    assert open_windows.mini_steps == [1, 2]
    # Another initial seed: the restored window brings back its own.
    resumed = _carry_run(
        tmp_path, [keras.callbacks.BackupAndRestore(backup)], seed=7
    )
    counters = resumed._window.counters
    assert int(keras.ops.convert_to_numpy(counters.rounding_seed)) == int(
        keras.ops.convert_to_numpy(whole._window.counters.rounding_seed)
    )
    assert int(keras.ops.convert_to_numpy(counters.rounding_draws)) == 4 * 9
    for a, b in zip(whole.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)
    # Another seed draws other bits: the run differs.
    other = _carry_run(tmp_path, [], seed=5)
    other.set_weights(whole.get_weights())
    assert int(
        keras.ops.convert_to_numpy(other._window.counters.rounding_seed)
    ) != int(keras.ops.convert_to_numpy(whole._window.counters.rounding_seed))


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="keras.distribution.DataParallel is JAX's",
)
def test_each_device_rounds_its_partial_sum_under_data_parallel():
    import jax

    x, y = _data(n=96)
    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    try:
        plain = _wide()
        start = plain.get_weights()[0].copy()
        plain.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        plain.fit(x, y, batch_size=32, epochs=2, verbose=0, shuffle=False)
        model = _wide(
            keras_accum.AccumModel, accum_steps=4, accumulator_dtype="bfloat16"
        )
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False)
    finally:
        keras.distribution.set_distribution(None)
    # Each of the 2 devices keeps its own bfloat16 partial sum.
    acc = model._window.acc_grads[0]
    assert tuple(acc.shape) == (2, WIDE, WIDE)
    assert _dtypes(model) == ["bfloat16", "float32", "float32", "float32"]
    moved = np.linalg.norm(plain.get_weights()[0] - start)
    diff = np.linalg.norm(model.get_weights()[0] - plain.get_weights()[0])
    assert 0 < diff <= 2e-2 * moved, (diff, moved)


@pytest.mark.skipif(
    keras.backend.backend() != "jax",
    reason="keras.distribution.DataParallel is JAX's",
)
def test_a_resumed_run_under_data_parallel_ends_within_the_rounding(tmp_path):
    """Each device keeps its own partial sum; a saved window holds their
    sum (in the weight's shape: it loads on any number of devices), and a
    load puts it on the first device. The devices' later roundings then
    start from other partial sums than the uninterrupted run's: a resumed
    run ends near it, not bit-identical (docs/guides/low-precision.md).
    Measured: the first kernel 0.0031 away in norm (1.9e-4 at most per
    element), where the rounding puts it 0.062 from the float32 run; the
    other weights 0.5% to 0.9% of theirs. (With float32 accumulators the
    same resume ends 3e-8 away: float32 rounding.)"""
    import jax

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    backup = str(tmp_path / "backup")
    try:
        whole = _carry_run(tmp_path, [])
        exact = _carry_run(tmp_path, [], accumulator_dtype=None)
        open_windows = _killed_after_epoch_one(tmp_path, backup)
        resumed = _carry_run(
            tmp_path, [keras.callbacks.BackupAndRestore(backup)], seed=7
        )
    finally:
        keras.distribution.set_distribution(None)
    # The backup holds an open window (2 of 4 micro-batches).
    assert open_windows.mini_steps == [1, 2]
    pairs = zip(
        whole.get_weights(),
        resumed.get_weights(),
        exact.get_weights(),
        strict=True,
    )
    resumed_by, rounded_by = [], []
    for w, r, e in pairs:
        resumed_by.append(float(np.linalg.norm(r - w)))
        rounded_by.append(float(np.linalg.norm(w - e)))
    # Within the rounding's own error: a small fraction of how far the
    # bfloat16 run is from the float32 one, for every weight.
    for resumed_norm, rounded_norm in zip(resumed_by, rounded_by, strict=True):
        assert resumed_norm <= 0.25 * rounded_norm, (resumed_by, rounded_by)
    # Not bit-identical, as documented (on one device it is: above).
    assert resumed_by[0] > 0, resumed_by


@pytest.mark.parametrize("jit_compile", [False, True])
def test_hand_computed_noise_scale_from_bfloat16_accumulators(jit_compile):
    # `test_noise_scale.py`'s micro-batch gradients 1, 2, 3, 4, spread over
    # a 1 x 16384 kernel as x / 16384 per element: every sum is exact in
    # bfloat16, so the rounding keeps it, and the estimate is the float32
    # one: tr = 5/3 and |G|² = 35/6 times the same scale, B = 2/7.
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(
        2**14, use_bias=False, kernel_initializer="ones"
    )(inputs)
    model = keras_accum.AccumModel(
        inputs, outputs, accum_steps=4, accumulator_dtype="bfloat16"
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=lambda y_true, y_pred: keras.ops.mean(y_pred, axis=-1),
        jit_compile=jit_compile and keras.backend.backend() != "torch",
    )
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    x = np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    model.fit(x, x, batch_size=1, shuffle=False, verbose=0, callbacks=[logger])
    assert _dtypes(model) == ["bfloat16"]
    (update,) = logger.updates
    scale = 2**14 * 2.0**-28  # elements times each one's squared factor
    np.testing.assert_allclose(update.trace, 5 / 3 * scale, rtol=1e-6)
    np.testing.assert_allclose(update.grad_sq, 35 / 6 * scale, rtol=1e-6)
    np.testing.assert_allclose(logger.noise_scale_estimate, 2 / 7, rtol=1e-6)


def _numpy_bits(seed, count, index, size):
    """`_rounding.random_bits` written again in NumPy's uint32."""

    def mix(x):
        x = np.asarray(x, np.uint32)
        x = (x ^ (x >> 16)) * np.uint32(0x7FEB352D)
        x = (x ^ (x >> 15)) * np.uint32(0x846CA68B)
        return x ^ (x >> 16)

    with np.errstate(over="ignore"):
        golden = np.uint32(0x9E3779B9)
        key = mix(np.uint32(count) * golden + np.uint32(index))
        key = mix(np.uint32(seed) ^ key)
        position = np.arange(size, dtype=np.uint32)
        return (mix(mix(position + key) ^ (key * golden)) >> 16).astype(int)


def test_random_bits_are_uniform_and_the_same_on_every_backend():
    draw = _rounding.Draw(
        keras.ops.convert_to_tensor(np.int32(123456789)),
        keras.ops.convert_to_tensor(np.int32(42)),
    )
    bits = keras.ops.convert_to_numpy(
        _rounding.random_bits(draw, 3, (256, 512))
    )
    # Int32 arithmetic that wraps as uint32's: NumPy's uint32 agrees.
    np.testing.assert_array_equal(
        bits.ravel(), _numpy_bits(123456789, 42, 3, 256 * 512)
    )
    assert bits.min() >= 0 and bits.max() < 2**16
    # Uniform: 64 bins of N / 64 expected each; chi-square with 63 degrees
    # of freedom, far below its 99.99% point (about 113).
    counts = np.bincount(bits.ravel() >> 10, minlength=64)
    expected = bits.size / 64
    assert ((counts - expected) ** 2 / expected).sum() < 113
    # Neighbours and other draws uncorrelated.
    flat = bits.ravel().astype(float)
    assert abs(np.corrcoef(flat[:-1], flat[1:])[0, 1]) < 0.02
    for other in ((123456789, 43, 3), (123456789, 42, 4), (7, 42, 3)):
        different = _numpy_bits(*other, flat.size).astype(float)
        assert abs(np.corrcoef(flat, different)[0, 1]) < 0.02
