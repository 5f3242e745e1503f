"""A batch split inside the step through convolutions: equal to the large
batch; on XLA:CPU, every convolution of the split step in the layout its
fast kernels take (`_jax_batch.cpu_convolutions`)."""

import keras
import numpy as np
import pytest
from _helpers import LargeBatch, assert_same_weights

import keras_accum


def _cnn(model_cls=keras.Model, **kwargs):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((8, 8, 2))
    x = keras.layers.Conv2D(4, 3, activation="relu")(inputs)
    x = keras.layers.Conv2D(3, 2, strides=2, dilation_rate=1)(x)
    x = keras.layers.Flatten()(x)
    outputs = keras.layers.Dense(3)(x)
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
    return model


def _data(n=20):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 8, 8, 2)).astype("float32")
    return x, rng.normal(size=(n, 3)).astype("float32")


def test_a_split_batch_through_convolutions_equals_the_large_batch():
    x, y = _data()
    _assert_split_equals_large(
        _cnn(), _cnn(keras_accum.AccumModel, micro_batch_size=3), x, y
    )


def _assert_split_equals_large(plain, accum, x, y):
    """`accum` (pieces of 3) and `LargeBatch(plain)` fitted on batches of
    10 (pieces of 3, 3, 3 and 1 rows): two updates, the same weights."""
    reference = LargeBatch(plain)
    common = {"batch_size": 10, "shuffle": False, "verbose": 0}
    reference.fit(x, y, **common)
    accum.fit(x, y, **common)
    assert int(accum.optimizer.iterations) == 2
    assert_same_weights(accum, reference)


@pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="Keras takes no sparse inputs on PyTorch",
)
def test_a_sparse_batch_through_convolutions_equals_the_large_batch():
    """Before, on JAX: the loop's body, traced again for its convolutions,
    handed a sparse array's parameters to JAX as a plain tuple, and the
    step failed (`'tuple' object has no attribute 'shape'`)."""
    import scipy.sparse

    rng = np.random.default_rng(3)
    # Two stored values a row: every batch holds as many (one shape for
    # JAX to compile).
    dense = rng.normal(size=(20, 12)).astype("float32")
    dense[rng.random((20, 12)).argsort(axis=1) >= 2] = 0.0
    x = scipy.sparse.csr_matrix(dense)
    y = rng.normal(size=(20, 1)).astype("float32")

    def build(model_cls, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((12,), sparse=True)
        hidden = keras.layers.Reshape((4, 4))(keras.layers.Dense(16)(inputs))
        hidden = keras.layers.Conv1D(2, 2, activation="tanh")(hidden)
        outputs = keras.layers.Dense(1)(keras.layers.Flatten()(hidden))
        model = model_cls(inputs, outputs, **kwargs)
        model.compile(optimizer=keras.optimizers.Adam(0.01), loss="mse")
        return model

    _assert_split_equals_large(
        build(keras.Model),
        build(keras_accum.AccumModel, micro_batch_size=3),
        x,
        y,
    )


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="XLA:CPU's compiled step"
)
def test_jax_split_step_convolves_in_the_fast_layout_on_cpu():
    """Before: the gradient's convolutions in the loop's body were
    `f01b_i01o->01bf` and `b01f_01oi->b01f`, which XLA:CPU runs as plain
    loops."""
    import jax

    if jax.devices()[0].platform != "cpu":
        pytest.skip("XLA:CPU only")
    x, y = _data()
    model = _cnn(keras_accum.AccumModel, micro_batch_size=3)
    model.fit(x[:12], y[:12], batch_size=12, verbose=0)
    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    step = jax.jit(model.train_step, donate_argnums=0)
    text = step.lower(state, (x[:12], y[:12])).compile().as_text()
    layouts = [
        line.split("dim_labels=")[1].split(",")[0]
        for line in text.splitlines()
        if " convolution(" in line
    ]
    # Forward, and the input's and kernel's gradients: in the loop and
    # for the last piece after it.
    assert len(layouts) >= 5
    assert set(layouts) == {"b01f_01io->b01f"}


CASES = {
    "1d_strided": ((2, 9, 4), (3, 4, 6), ("NWC", "WIO", "NWC"), 1, (2,), (1,)),
    "2d_nchw_grouped_dilated": (
        (2, 4, 7, 6),
        (6, 2, 3, 2),
        ("NCHW", "OIHW", "NCHW"),
        2,
        (1, 2),
        (2, 1),
    ),
    "3d": (
        (1, 5, 5, 5, 2),
        (2, 2, 2, 2, 3),
        ("NDHWC", "DHWIO", "NDHWC"),
        1,
        (1, 1, 1),
        (1, 1, 1),
    ),
}


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's convolution primitive"
)
@pytest.mark.parametrize("case", list(CASES))
def test_fast_layout_convolutions_give_the_same_gradients(case):
    import jax

    from keras_accum._jax_batch import cpu_convolutions

    x_shape, w_shape, numbers, groups, strides, dilation = CASES[case]
    rng = np.random.default_rng(1)
    x = rng.normal(size=x_shape).astype("float32")
    w = rng.normal(size=w_shape).astype("float32")

    def loss(x, w):
        out = jax.lax.conv_general_dilated(
            x,
            w,
            strides,
            "SAME",
            rhs_dilation=dilation,
            dimension_numbers=numbers,
            feature_group_count=groups,
        )
        return jax.numpy.sum(jax.numpy.sin(out))

    grad = jax.grad(loss, argnums=(0, 1))

    def body(i, carry):
        gx, gw = grad(x * (i + 1.0), w)
        return carry[0] + gx, carry[1] + gw

    def looped(body):
        zeros = (np.zeros_like(x), np.zeros_like(w))
        return jax.jit(lambda: jax.lax.fori_loop(0, 2, body, zeros))()

    expected = looped(body)
    for found, value in zip(
        looped(cpu_convolutions(body)), expected, strict=True
    ):
        np.testing.assert_allclose(found, value, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(
    keras.backend.backend() != "jax", reason="JAX's convolution primitive"
)
def test_convolutions_inside_calls_and_conditionals_are_rewritten():
    import jax

    from keras_accum._jax_batch import cpu_convolutions

    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 6, 3)).astype("float32")
    w = rng.normal(size=(3, 3, 3, 4)).astype("float32")

    @jax.jit
    def conv(x, w):
        return jax.lax.conv_general_dilated(
            x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
        )

    def loss(x, w):
        y = jax.lax.cond(
            jax.numpy.sum(x) > 0, lambda: conv(x, w), lambda: 2 * conv(x, w)
        )
        return jax.numpy.sum(jax.numpy.sin(y))

    grad = jax.grad(loss, argnums=(0, 1))

    def body(i, carry):
        gx, gw = grad(x * (i + 1.0), w)
        return carry[0] + gx, carry[1] + gw

    def looped(body):
        zeros = (np.zeros_like(x), np.zeros_like(w))
        return jax.jit(lambda: jax.lax.fori_loop(0, 2, body, zeros))

    rewritten = looped(cpu_convolutions(body))
    text = rewritten.lower().compile().as_text()
    layouts = {
        line.split("dim_labels=")[1].split(",")[0]
        for line in text.splitlines()
        if " convolution(" in line
    }
    if jax.devices()[0].platform == "cpu":
        assert layouts == {"b01f_01io->b01f"}
    for found, value in zip(rewritten(), looped(body)(), strict=True):
        np.testing.assert_allclose(found, value, rtol=1e-5, atol=1e-5)
