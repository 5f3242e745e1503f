"""`AccumBatchNormalization`: moving statistics from the window's samples."""

import keras
import numpy as np
import pytest
from _helpers import (
    LargeBatch,
    assert_equivalent,
    batch_norm_data,
    batch_norm_model,
    moving_statistics,
)

import keras_accum

B, K = 8, 4


def _statistics_in(model, weights):
    """The moving means and variances among `weights`, listed as `model`'s
    `get_weights()` lists its own (a float64 replay's, say)."""
    position = {id(w): i for i, w in enumerate(model.weights)}
    return [
        weights[position[id(variable)]]
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
        for variable in (layer.moving_mean, layer.moving_variance)
    ]


@pytest.mark.parametrize("shape", [(4,), (5, 5, 3)], ids=["dense", "image"])
def test_moving_statistics_equal_the_large_batch(shape, report_diff):
    x, y = batch_norm_data(shape)
    plain = batch_norm_model(
        keras.Model, keras.layers.BatchNormalization, shape
    )
    accum = batch_norm_model(
        keras_accum.AccumModel,
        keras_accum.AccumBatchNormalization,
        shape,
        accum_steps=K,
    )
    # The layer has window variables besides BatchNormalization's, so the
    # backend's seed stream may initialise the weights differently.
    for mine, theirs in zip(
        accum.trainable_weights, plain.trainable_weights, strict=True
    ):
        mine.assign(theirs.numpy())
    plain = LargeBatch(plain)
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    diff = assert_equivalent(
        [s for pair in moving_statistics(accum) for s in pair],
        [s for pair in moving_statistics(plain.model) for s in pair],
        rtol=2e-6,
        exact=lambda: _statistics_in(plain.model, plain.float64()[0]),
    )
    report_diff(diff, f"AccumBatchNormalization moving statistics {shape}")
    # The open window was closed, and nothing is left in it.
    for layer in accum.layers:
        if isinstance(layer, keras_accum.AccumBatchNormalization):
            assert float(layer.window_count.numpy()) == 0.0


@pytest.mark.full_run_only(
    reason="Keras's own layer, the same on every backend"
)
def test_plain_batch_normalization_updates_per_micro_batch():
    # What the opt-in fixes: Keras's layer moves once per micro-batch.
    shape = (4,)
    x, y = batch_norm_data(shape)
    plain = batch_norm_model(
        keras.Model, keras.layers.BatchNormalization, shape
    )
    accum = batch_norm_model(
        keras_accum.AccumModel,
        keras.layers.BatchNormalization,
        shape,
        accum_steps=K,
    )
    plain.fit(x, y, batch_size=B * K, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    (pm, _), *_ = moving_statistics(plain)
    (am, _), *_ = moving_statistics(accum)
    assert float(np.max(np.abs(am - pm))) > 0.1


def test_outside_an_accum_model_it_is_batch_normalization():
    shape = (4,)
    x, y = batch_norm_data(shape)
    plain = batch_norm_model(
        keras.Model, keras.layers.BatchNormalization, shape
    )
    other = batch_norm_model(
        keras.Model, keras_accum.AccumBatchNormalization, shape
    )
    plain.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    other.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    for (pm, pv), (om, ov) in zip(
        moving_statistics(plain), moving_statistics(other), strict=True
    ):
        np.testing.assert_array_equal(om, pm)
        np.testing.assert_array_equal(ov, pv)
    np.testing.assert_array_equal(
        other.predict(x, verbose=0), plain.predict(x, verbose=0)
    )


def test_open_window_statistics_survive_save_and_load(tmp_path):
    shape = (4,)
    x, y = batch_norm_data(shape, n=40)
    # 5 micro-batches, windows of 4, carried: one micro-batch stays open.
    reference = batch_norm_model(
        keras_accum.AccumModel,
        keras_accum.AccumBatchNormalization,
        shape,
        accum_steps=K,
        partial_window="carry",
    )
    reference.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    path = str(tmp_path / "bn.keras")
    reference.save(path)
    loaded = keras.saving.load_model(path)
    norms = [
        layer
        for layer in loaded.layers
        if isinstance(layer, keras_accum.AccumBatchNormalization)
    ]
    assert len(norms) == 2
    assert all(float(layer.window_count.numpy()) > 0 for layer in norms)
    more_x, more_y = batch_norm_data(shape, n=24, seed=1)
    for model in (reference, loaded):
        model.fit(more_x, more_y, batch_size=B, shuffle=False, verbose=0)
    for (rm, rv), (lm, lv) in zip(
        moving_statistics(reference), moving_statistics(loaded), strict=True
    ):
        np.testing.assert_allclose(lm, rm, rtol=1e-6)
        np.testing.assert_allclose(lv, rv, rtol=1e-6)


def test_renorm_is_refused():
    # Keras 3.10 has no renorm and refuses the argument itself.
    with pytest.raises(ValueError, match="renorm"):
        keras_accum.AccumBatchNormalization(renorm=True)


# -- `AccumBatchNormalization.convert` ----------------------------------------


def _cnn_with_batch_norm(model_cls=keras.Model, **kwargs):
    """A small CNN: a batch normalization, a frozen one, a nested
    `Sequential` block with a third, around a residual `x + block(x)`, and
    a nested functional model with a fourth, used twice; weights (moving
    statistics included) from numpy's generator."""
    inputs = keras.Input((6, 6, 3), name="image")
    x = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    x = keras.layers.BatchNormalization(momentum=0.5, name="bn")(x)
    frozen = keras.layers.BatchNormalization(name="frozen_bn")
    frozen.trainable = False
    x = frozen(keras.layers.ReLU(name="relu")(x))
    block = keras.Sequential(
        [
            keras.layers.Conv2D(4, 1, name="block_conv"),
            keras.layers.BatchNormalization(name="block_bn"),
            keras.layers.ReLU(name="block_relu"),
        ],
        name="block",
    )
    x = x + block(x)
    x = keras.layers.GlobalAveragePooling2D(name="pool")(x)
    features_in = keras.Input((4,))
    features_out = keras.layers.BatchNormalization(name="features_bn")(
        keras.layers.Dense(4, name="features_dense")(features_in)
    )
    features = keras.Model(features_in, features_out, name="features")
    x = features(features(x))
    outputs = keras.layers.Dense(2, name="head")(x)
    model = model_cls(inputs, outputs, name="cnn", **kwargs)
    rng = np.random.default_rng(0)
    for layer in model._flatten_layers():
        for variable in layer.weights:
            if variable.path.endswith("moving_variance"):
                value = rng.uniform(0.5, 2.0, size=variable.shape)
            else:
                value = rng.normal(scale=0.5, size=variable.shape)
            variable.assign(value.astype("float32"))
    return model


def _image_data(n=32, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(loc=1.0, size=(n, 6, 6, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def _layers_by_name(model):
    return {layer.name: layer for layer in model._flatten_layers()}


def _values(model):
    return [keras.ops.convert_to_numpy(v.value).copy() for v in model.weights]


def _predict(model, x):
    return keras.ops.convert_to_numpy(model(x, training=False))


def test_convert_replaces_batch_normalization_and_copies_weights():
    original = _cnn_with_batch_norm()
    before = _values(original)
    converted = keras_accum.AccumBatchNormalization.convert(original)

    assert type(converted) is type(original)
    assert converted.name == "cnn"
    old_layers, new_layers = (
        _layers_by_name(original),
        _layers_by_name(converted),
    )
    assert old_layers.keys() == new_layers.keys()
    norms = {"bn", "frozen_bn", "block_bn", "features_bn"}
    for name, old in old_layers.items():
        new = new_layers[name]
        assert new is not old
        assert new.trainable == old.trainable, name
        if name in norms:
            assert type(old) is keras.layers.BatchNormalization
            assert type(new) is keras_accum.AccumBatchNormalization
            assert new.get_config() == old.get_config()
            for weight in ("gamma", "beta", "moving_mean", "moving_variance"):
                np.testing.assert_array_equal(
                    getattr(new, weight).numpy(), getattr(old, weight).numpy()
                )
            for weight in ("window_count", "window_mean", "window_m2"):
                assert not np.any(getattr(new, weight).numpy())
        else:
            assert type(new) is type(old), name
            if isinstance(old, keras.Model):
                continue  # Its layers are compared one by one.
            for u, v in zip(new.get_weights(), old.get_weights(), strict=True):
                np.testing.assert_array_equal(u, v)
    assert type(new_layers["block"]) is keras.Sequential
    assert type(new_layers["features"]) is type(old_layers["features"])
    # Used twice, copied once.
    assert converted.layers.count(new_layers["features"]) == 1
    assert not new_layers["frozen_bn"].trainable
    assert not new_layers["frozen_bn"].trainable_weights
    # Nothing shared, nothing changed in the original.
    assert not {id(v) for v in converted.weights} & {
        id(v) for v in original.weights
    }
    for u, v in zip(_values(original), before, strict=True):
        np.testing.assert_array_equal(u, v)
    assert not any(
        isinstance(layer, keras_accum.AccumBatchNormalization)
        for layer in original._flatten_layers()
    )
    x, _ = _image_data()
    np.testing.assert_allclose(
        _predict(converted, x), _predict(original, x), rtol=1e-6, atol=1e-6
    )


def test_converted_model_shares_no_buffers_with_the_original():
    # On JAX, `fit` donates a model's arrays to its step, which frees them:
    # a converted model holding any of the original's arrays then fails
    # with "Array has been deleted".
    x, y = _image_data()
    original = _cnn_with_batch_norm()
    converted = keras_accum.AccumBatchNormalization.convert(original)
    converted_before = _values(converted)
    original.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    original.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    original_after = _values(original)
    for u, v in zip(_values(converted), converted_before, strict=True):
        np.testing.assert_array_equal(u, v)

    model = keras_accum.AccumModel.from_model(converted, accum_steps=K)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 32 // (B * K)
    after = {v.path: v.numpy() for v in converted.weights}
    before = dict(
        zip((v.path for v in converted.weights), converted_before, strict=True)
    )
    assert all(np.all(np.isfinite(value)) for value in after.values())
    for path in ("conv/kernel", "bn/gamma", "bn/moving_mean", "head/kernel"):
        assert np.any(after[path] != before[path]), path
    # Frozen: its statistics and weights stay as converted.
    for weight in ("gamma", "moving_mean", "moving_variance"):
        path = f"frozen_bn/{weight}"
        np.testing.assert_array_equal(after[path], before[path])
    # And the original did not move with the converted model.
    for u, v in zip(_values(original), original_after, strict=True):
        np.testing.assert_array_equal(u, v)


def test_convert_sequential_gives_sequential():
    original = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, name="dense"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(1, name="out"),
        ],
        name="seq",
    )
    original.compile(optimizer="sgd", loss="mse")
    x, _ = batch_norm_data((4,))
    converted = keras_accum.AccumBatchNormalization.convert(original)
    assert type(converted) is keras.Sequential
    assert converted.name == "seq"
    # Compiled as `clone_model` compiles a copy: a new optimizer.
    assert converted.compiled
    assert converted.optimizer is not original.optimizer
    assert [type(layer) for layer in converted.layers] == [
        keras.layers.Dense,
        keras_accum.AccumBatchNormalization,
        keras.layers.Dense,
    ]
    np.testing.assert_allclose(
        _predict(converted, x), _predict(original, x), rtol=1e-6, atol=1e-6
    )


def test_convert_keeps_an_accum_model_and_its_settings():
    original = _cnn_with_batch_norm(
        keras_accum.AccumModel, accum_steps={0: 2, 1: 4}, partial_window="carry"
    )
    converted = keras_accum.AccumBatchNormalization.convert(original)
    assert isinstance(converted, keras_accum.AccumModel)
    assert converted.accum_steps == {0: 2, 1: 4}
    assert converted.partial_window == "carry"
    assert converted.name == "cnn"
    x, y = _image_data()
    np.testing.assert_allclose(
        _predict(converted, x), _predict(original, x), rtol=1e-6, atol=1e-6
    )
    converted.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    converted.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    assert int(converted.optimizer.iterations.numpy()) == 2


class _Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(2)
        self.norm = keras.layers.BatchNormalization()

    def call(self, inputs):
        return self.norm(self.dense(inputs))


class _BuildsItsGraph(keras.Model):
    """Functional, its graph built by its constructor (the KerasHub
    style)."""

    def __init__(self, units=2, **kwargs):
        inputs = keras.Input((4,))
        x = keras.layers.Dense(units)(inputs)
        outputs = keras.layers.BatchNormalization()(x)
        super().__init__(inputs, outputs, **kwargs)


def test_convert_refuses_what_it_cannot_rebuild():
    convert = keras_accum.AccumBatchNormalization.convert
    subclassed = _Subclassed(name="custom")
    subclassed(np.zeros((1, 4), "float32"))
    with pytest.raises(TypeError, match=r"subclassed model \(`_Subclassed`"):
        convert(subclassed)
    wrapped = keras_accum.AccumModel.from_model(subclassed, accum_steps=2)
    with pytest.raises(TypeError, match="before `AccumModel.from_model`"):
        convert(wrapped)
    unbuilt = keras.Sequential([keras.layers.Dense(2)], name="unbuilt")
    with pytest.raises(ValueError, match="must be a built .*name=unbuilt"):
        convert(unbuilt)
    for value in ("model.keras", keras.layers.BatchNormalization()):
        with pytest.raises(TypeError, match="Received: model="):
            convert(value)
    builds = _BuildsItsGraph(name="hub_style")
    with pytest.raises(TypeError, match="builds its graph in its own"):
        convert(builds)
    # The fix the message gives: the same graph as a plain model.
    plain = convert(keras.Model(builds.input, builds.output))
    assert any(
        isinstance(layer, keras_accum.AccumBatchNormalization)
        for layer in plain.layers
    )
    try:
        renorm = keras.layers.BatchNormalization(renorm=True, name="renorm")
    except (TypeError, ValueError):
        return  # Keras 3.10 has no batch renormalization.
    inputs = keras.Input((4,))
    with pytest.raises(ValueError, match="'renorm' .*renormalization"):
        convert(keras.Model(inputs, renorm(inputs)))


def test_convert_warns_about_batch_normalization_it_leaves():
    class OwnNorm(keras.layers.BatchNormalization):
        pass

    inputs = keras.Input((4,))
    x = OwnNorm(name="own")(inputs)
    # In a subclassed model inside the graph: not reachable either.
    x = _Subclassed(name="custom")(x)
    outputs = keras.layers.BatchNormalization(name="plain")(x)
    original = keras.Model(inputs, outputs)
    with pytest.warns(UserWarning, match="left 2 .*'own' \\(OwnNorm\\)"):
        converted = keras_accum.AccumBatchNormalization.convert(original)
    layers = _layers_by_name(converted)
    assert type(layers["own"]) is OwnNorm
    assert type(layers["plain"]) is keras_accum.AccumBatchNormalization
    x, _ = batch_norm_data((4,))
    np.testing.assert_allclose(
        _predict(converted, x), _predict(original, x), rtol=1e-6, atol=1e-6
    )


@pytest.mark.full_run_only(
    reason="the conversion is the same on every backend; "
    "test_convert_replaces_batch_normalization_and_copies_weights covers it "
    "(an eager MobileNet forward pass takes 30 s on JAX's CPU)"
)
def test_convert_a_keras_application():
    # A model's graph as Keras builds it: operations (`x * ...`) between
    # layers, 34 batch normalizations. No weights downloaded.
    original = keras.applications.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=10
    )
    rng = np.random.default_rng(0)
    for layer in original.layers:
        if type(layer) is keras.layers.BatchNormalization:
            shape = layer.moving_mean.shape
            layer.moving_mean.assign(rng.normal(size=shape).astype("float32"))
            layer.moving_variance.assign(
                rng.uniform(0.5, 2.0, size=shape).astype("float32")
            )
    converted = keras_accum.AccumBatchNormalization.convert(original)
    assert converted.name == original.name
    kinds = [type(layer) for layer in converted.layers]
    assert kinds.count(keras_accum.AccumBatchNormalization) == 34
    assert keras.layers.BatchNormalization not in kinds
    x = rng.uniform(0, 255, size=(2, 32, 32, 3)).astype("float32")
    np.testing.assert_allclose(
        _predict(converted, x), _predict(original, x), rtol=1e-5, atol=1e-6
    )
