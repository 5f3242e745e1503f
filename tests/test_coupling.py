"""`_coupling`: layers that mix samples when training are found and refused;
per-sample layers pass, and the tests check which is which numerically."""

import keras
import numpy as np
import pytest

import keras_accum
from keras_accum import _coupling


def model_with(*layers, shape=(4, 4, 3)):
    keras.utils.set_random_seed(2)
    inputs = keras.Input(shape)
    x = keras.layers.Conv2D(4, 3, padding="same")(inputs)
    for layer in layers:
        x = layer(x)
    outputs = keras.layers.Dense(2)(keras.layers.Flatten()(x))
    return keras.Model(inputs, outputs)


def images(n=8, shape=(4, 4, 3)):
    rng = np.random.default_rng(0)
    return (2.0 + 3.0 * rng.normal(size=(n, *shape))).astype("float32")


def piecewise_gap(model, x, pieces=2):
    """How far the pieces' training outputs, joined, are from the batch's."""
    whole = keras.ops.convert_to_numpy(model(x, training=True))
    joined = np.concatenate(
        [
            keras.ops.convert_to_numpy(model(part, training=True))
            for part in np.split(x, pieces)
        ]
    )
    return float(np.abs(whole - joined).max())


@pytest.mark.parametrize(
    "norm",
    [
        lambda: keras.layers.LayerNormalization(),
        lambda: keras.layers.GroupNormalization(groups=2),
        lambda: keras.layers.UnitNormalization(),
        lambda: keras.layers.RMSNormalization(),
    ],
    ids=["layer", "group", "unit", "rms"],
)
def test_per_sample_normalizations_pass_and_are_per_sample(norm):
    model = model_with(norm())
    assert _coupling.coupling_layers(model) == []
    assert _coupling.coupling_error(model) is None
    assert piecewise_gap(model, images()) < 1e-5


@pytest.mark.parametrize(
    "norm_cls",
    [keras.layers.BatchNormalization, keras_accum.AccumBatchNormalization],
    ids=["bn", "accum_bn"],
)
def test_training_batch_normalization_is_refused_naming_it(norm_cls):
    norm = norm_cls(name="the_norm")
    model = model_with(norm)
    # Its training outputs do depend on the other samples.
    assert piecewise_gap(model, images()) > 1e-2
    assert [layer for layer, _ in _coupling.coupling_layers(model)] == [norm]
    with pytest.raises(ValueError) as raised:
        _coupling.check_no_coupling(model)
    message = str(raised.value)
    assert "`the_norm`" in message
    assert norm_cls.__name__ in message
    assert "LayerNormalization" in message
    assert "GroupNormalization" in message
    assert "trainable = False" in message
    assert "whole_batch_loss=True" in message


def test_frozen_batch_normalization_runs_per_sample_and_passes():
    norm = keras.layers.BatchNormalization()
    model = model_with(norm)
    x = images()
    model(x, training=True)  # moving statistics away from 0 and 1
    norm.trainable = False
    assert _coupling.coupling_layers(model) == []
    # Keras 3: a frozen BatchNormalization normalizes with its moving
    # statistics even in a training forward pass.
    assert piecewise_gap(model, x) < 1e-5
    before = keras.ops.convert_to_numpy(norm.moving_mean)
    model(x, training=True)
    np.testing.assert_array_equal(
        keras.ops.convert_to_numpy(norm.moving_mean), before
    )


def test_a_model_frozen_whole_freezes_its_batch_normalization():
    inner = model_with(keras.layers.BatchNormalization())
    inputs = keras.Input((4, 4, 3))
    outer = keras.Model(inputs, keras.layers.Dense(1)(inner(inputs)))
    assert len(_coupling.coupling_layers(outer)) == 1  # found when nested
    inner.trainable = False
    assert _coupling.coupling_layers(outer) == []


def test_mixup_is_refused_with_the_pipeline_advice():
    model = model_with(keras.layers.MixUp(name="mix"))
    found = _coupling.coupling_layers(model)
    assert [layer.name for layer, _ in found] == ["mix"]
    message = str(_coupling.coupling_error(model))
    assert "`mix`" in message and "input pipeline" in message
    # Only the advice that applies: no normalization here.
    assert "LayerNormalization" not in message


def test_every_offending_layer_is_named():
    model = model_with(
        keras.layers.BatchNormalization(name="first"),
        keras.layers.CutMix(name="second"),
    )
    message = str(_coupling.coupling_error(model))
    assert "`first`" in message and "`second`" in message
    assert "2 such layer(s)" in message


def test_spectral_normalization_is_refused_it_rewrites_its_kernel():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((5,))
    wrapped = keras.layers.SpectralNormalization(
        keras.layers.Dense(3), name="spectral"
    )
    model = keras.Model(inputs, wrapped(inputs))
    x = images(4, (5,))
    kernel = keras.ops.convert_to_numpy(wrapped.kernel)
    first = keras.ops.convert_to_numpy(model(x, training=True))
    second = keras.ops.convert_to_numpy(model(x, training=True))
    # A second training pass does not repeat the first: the kernel moved.
    assert (
        np.abs(keras.ops.convert_to_numpy(wrapped.kernel) - kernel).max() > 1e-3
    )
    assert np.abs(first - second).max() > 1e-4
    message = str(_coupling.coupling_error(model))
    assert "`spectral`" in message and "without `whole_batch_loss`" in message
