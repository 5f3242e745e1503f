"""The gradient noise scale estimated by `PseudoBatchLogger`."""

import math

import keras
import numpy as np
import pytest

import keras_accum

BACKEND = keras.backend.backend()
# Both ways on TensorFlow (XLA sums the squares another way); elsewhere
# the backend's default: `jax.jit` on JAX, eager on PyTorch (where
# `torch.compile` at one sample per micro-batch fails: tests/test_model.py's
# test_jit_compile_with_one_sample_per_micro_batch).
JIT_COMPILE = {"tensorflow": [False, True], "jax": [True], "torch": [False]}[
    BACKEND
]


def _gradient_is_the_input(accum_steps, jit_compile=False):
    """A model whose per-sample gradient (w.r.t. its one weight) is x."""
    inputs = keras.Input((1,))
    outputs = keras.layers.Dense(1, use_bias=False, kernel_initializer="ones")(
        inputs
    )
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=accum_steps)

    def prediction_as_loss(y_true, y_pred):
        return keras.ops.squeeze(y_pred, -1)

    model.compile(
        optimizer=keras.optimizers.SGD(0.0),
        loss=prediction_as_loss,
        jit_compile=jit_compile,
    )
    return model


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_hand_computed_gradients_1_2_3_4(jit_compile):
    # Micro-batch gradients 1, 2, 3, 4, one sample each: N = k = 4.
    # sum n_j g_j^2 = 30, |G_W|^2 = 2.5^2 = 6.25:
    # tr = (30 - 4 * 6.25) / 3 = 5/3, |G|^2 = 6.25 - (5/3) / 4 = 35/6.
    # XLA sums the squares another way (see `_sum_of_squares`).
    model = _gradient_is_the_input(4, jit_compile)
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    x = np.array([[1.0], [2.0], [3.0], [4.0]], "float32")
    history = model.fit(
        x, x, batch_size=1, shuffle=False, verbose=0, callbacks=[logger]
    )
    (update,) = logger.updates
    assert update.micro_batches == 4
    np.testing.assert_allclose(update.trace, 5 / 3, rtol=1e-6)
    np.testing.assert_allclose(update.grad_sq, 35 / 6, rtol=1e-6)
    np.testing.assert_allclose(logger.noise_scale_estimate, 2 / 7, rtol=1e-6)
    logs = history.history
    np.testing.assert_allclose(logs["pseudo_batch_noise_scale"], [2 / 7])
    assert logs["pseudo_batch_critical_batch_size"] == [1.0]
    assert logs["pseudo_batch_suggested_accum_steps"] == [1.0]


def test_uneven_micro_batches_use_their_sizes():
    # Micro-batches [1, 2], [3, 4], [5]: means 1.5, 3.5, 5; n = 2, 2, 1.
    # sum n_j g_j^2 = 54, N = 5, |G_W|^2 = 9, k = 3:
    # tr = (54 - 45) / 2 = 4.5, |G|^2 = 9 - 4.5 / 5 = 8.1.
    model = _gradient_is_the_input(3)
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    x = np.arange(1, 6, dtype="float32")[:, None]
    model.fit(x, x, batch_size=2, shuffle=False, verbose=0, callbacks=[logger])
    (update,) = logger.updates
    assert (update.samples, update.micro_batches) == (5, 3)
    np.testing.assert_allclose(update.trace, 4.5, rtol=1e-6)
    np.testing.assert_allclose(update.grad_sq, 8.1, rtol=1e-6)


def test_synthetic_linear_regression_with_known_noise_scale(report_diff):
    # y = x.w* + e, x ~ N(0, I_d), e ~ N(0, s^2), squared error, weights
    # held at w = w* + delta (learning rate 0). Per-sample gradient
    # 2 (x.delta - e) x: G = 2 delta and, for Gaussian x,
    # tr(Sigma) = 4 ((d + 1) |delta|^2 + d s^2), so
    # B_simple = (d + 1) + d s^2 / |delta|^2 = 17 for d = 8, |delta| = s = 1.
    d, micro, k, windows = 8, 4, 8, 300
    true_scale = (d + 1) + d * 1.0 / 1.0
    rng = np.random.default_rng(0)
    w_star = rng.normal(size=(d, 1))
    delta = rng.normal(size=(d, 1))
    delta /= np.linalg.norm(delta)
    n = micro * k * windows
    x = rng.normal(size=(n, d)).astype("float32")
    y = (x @ w_star + rng.normal(size=(n, 1))).astype("float32")

    inputs = keras.Input((d,))
    outputs = keras.layers.Dense(1, use_bias=False)(inputs)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=k)
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    w = (w_star + delta).astype("float32")
    model.set_weights([w])
    logger = keras_accum.PseudoBatchLogger(
        noise_scale=True, smoothing=0.99, noise_scale_every=1
    )
    history = model.fit(
        x, y, batch_size=micro, shuffle=False, verbose=0, callbacks=[logger]
    )
    assert len(logger.updates) == windows

    # Each window's estimates are the formulas applied to its gradients.
    per_sample = 2 * (x @ w - y) * x
    for i in (0, windows // 2, windows - 1):
        g = per_sample[i * micro * k : (i + 1) * micro * k].astype("float64")
        means = g.reshape(k, micro, d).mean(axis=1)
        window_sq = np.sum(g.mean(axis=0) ** 2)
        trace = (micro * np.sum(means**2) - micro * k * window_sq) / (k - 1)
        np.testing.assert_allclose(logger.updates[i].trace, trace, rtol=1e-4)
        np.testing.assert_allclose(
            logger.updates[i].grad_sq,
            window_sq - trace / (micro * k),
            rtol=1e-3,
            atol=1e-4,
        )

    # Over all windows the ratio of the averages finds the true value.
    traces = np.array([u.trace for u in logger.updates])
    grad_sqs = np.array([u.grad_sq for u in logger.updates])
    estimate = traces.mean() / grad_sqs.mean()
    report_diff(
        abs(estimate - true_scale) / true_scale,
        f"noise scale {estimate:.2f} vs true {true_scale:.0f} (rel. error)",
    )
    np.testing.assert_allclose(estimate, true_scale, rtol=0.1)
    np.testing.assert_allclose(np.mean(grad_sqs), 4.0, rtol=0.15)
    # The smoothed estimate in the logs: same order, noisier.
    logged = history.history["pseudo_batch_noise_scale"][-1]
    assert 0.6 * true_scale < logged < 1.4 * true_scale
    critical = history.history["pseudo_batch_critical_batch_size"][-1]
    assert critical == round(logged)
    assert history.history["pseudo_batch_suggested_accum_steps"][-1] == (
        math.ceil(critical / micro)
    )


def test_off_by_default_and_nan_for_one_micro_batch_windows():
    model = _gradient_is_the_input(1)
    x = np.arange(1, 5, dtype="float32")[:, None]
    plain_logger = keras_accum.PseudoBatchLogger()
    history = model.fit(x, x, batch_size=1, verbose=0, callbacks=[plain_logger])
    assert "pseudo_batch_noise_scale" not in history.history
    assert all(math.isnan(u.trace) for u in plain_logger.updates)
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    history = model.fit(x, x, batch_size=1, verbose=0, callbacks=[logger])
    # One micro-batch per window: nothing to compare it with.
    assert math.isnan(history.history["pseudo_batch_noise_scale"][0])
    assert math.isnan(logger.suggested_accum_steps)


@pytest.mark.parametrize("jit_compile", JIT_COMPILE)
def test_every_nth_window_estimates_the_same_values(jit_compile):
    # Sampling changes what is measured, not the training: the sampled
    # windows' estimates equal those of a logger estimating every window,
    # across two `fit` calls (the count of published windows goes on).
    rng = np.random.default_rng(1)
    x = rng.normal(size=(96, 3)).astype("float32")
    y = rng.normal(size=(96, 2)).astype("float32")
    runs = {}
    for every in (1, 3):
        keras.utils.set_random_seed(0)
        inputs = keras.Input((3,))
        outputs = keras.layers.Dense(2)(inputs)
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=4)
        model.compile(
            optimizer=keras.optimizers.Adam(0.01),
            loss="mse",
            jit_compile=jit_compile,
        )
        logger = keras_accum.PseudoBatchLogger(
            noise_scale=True, noise_scale_every=every, smoothing=0.5
        )
        for _ in range(2):
            model.fit(
                x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[logger]
            )
        runs[every] = (model, logger)
    (every_model, every_logger), (third_model, third_logger) = runs.values()
    for a, b in zip(
        every_model.get_weights(), third_model.get_weights(), strict=True
    ):
        np.testing.assert_array_equal(a, b)
    assert len(third_logger.updates) == 12
    for i, (all_, some) in enumerate(
        zip(every_logger.updates, third_logger.updates, strict=True)
    ):
        assert all_.loss == some.loss
        if i % 3 == 0:
            np.testing.assert_allclose(some.trace, all_.trace, rtol=1e-6)
            np.testing.assert_allclose(some.grad_sq, all_.grad_sq, rtol=1e-6)
        else:
            assert math.isnan(some.trace) and math.isnan(some.grad_sq)
    # The smoothed estimate averages the sampled windows only.
    trace = grad_sq = 0.0
    for update in every_logger.updates[::3]:
        trace = 0.5 * trace + 0.5 * update.trace
        grad_sq = 0.5 * grad_sq + 0.5 * update.grad_sq
    np.testing.assert_allclose(
        third_logger.noise_scale_estimate, trace / grad_sq, rtol=1e-5
    )


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"noise_scale": 1}, TypeError, "Received: noise_scale=1"),
        (
            {"noise_scale_every": 0},
            ValueError,
            "`noise_scale_every` must be an integer >= 1. "
            "Received: noise_scale_every=0",
        ),
        ({"noise_scale_every": True}, ValueError, "noise_scale_every=True"),
        ({"noise_scale_every": 2.0}, ValueError, r"noise_scale_every=2\.0"),
        ({"smoothing": 1.0}, ValueError, r"Received: smoothing=1\.0"),
        ({"smoothing": -0.1}, ValueError, r"Received: smoothing=-0\.1"),
    ],
)
def test_bad_arguments_are_refused(kwargs, error, match):
    with pytest.raises(error, match=match):
        keras_accum.PseudoBatchLogger(**kwargs)


@pytest.mark.tensorflow_only(reason="TensorFlow's window sums squares")
@pytest.mark.parametrize("xla", [False, True])
def test_sum_of_squares_both_ways(xla):
    import tensorflow as tf

    from keras_accum._tf_window import _sum_of_squares

    rng = np.random.default_rng(2)
    shapes = [(3, 3, 64, 1), (784, 512), (512,), (), (5, 7), (2, 130)]
    arrays = [rng.normal(size=s).astype("float32") for s in shapes]
    compute = tf.function(
        lambda *ts: _sum_of_squares(list(ts), xla), jit_compile=xla
    )
    expected = sum(np.sum(a.astype("float64") ** 2) for a in arrays)
    np.testing.assert_allclose(
        float(compute(*[tf.constant(a) for a in arrays])), expected, rtol=1e-5
    )
