"""`AccumBatchNormalization`: moving statistics from the window's samples."""

import keras
import numpy as np
import pytest
from _helpers import batch_norm_data, batch_norm_model

import keras_accum

B, K = 8, 4


def _moving_statistics(model):
    return [
        (layer.moving_mean.numpy(), layer.moving_variance.numpy())
        for layer in model.layers
        if isinstance(layer, keras.layers.BatchNormalization)
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
    plain.fit(x, y, batch_size=B * K, epochs=2, shuffle=False, verbose=0)
    accum.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0)
    diff = 0.0
    for (pm, pv), (am, av) in zip(
        _moving_statistics(plain), _moving_statistics(accum), strict=True
    ):
        np.testing.assert_allclose(am, pm, rtol=2e-6, atol=1e-6)
        np.testing.assert_allclose(av, pv, rtol=2e-6, atol=1e-6)
        diff = max(diff, float(np.max(np.abs(am - pm))))
        diff = max(diff, float(np.max(np.abs(av - pv))))
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
    (pm, _), *_ = _moving_statistics(plain)
    (am, _), *_ = _moving_statistics(accum)
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
        _moving_statistics(plain), _moving_statistics(other), strict=True
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
        _moving_statistics(reference), _moving_statistics(loaded), strict=True
    ):
        np.testing.assert_allclose(lm, rm, rtol=1e-6)
        np.testing.assert_allclose(lv, rv, rtol=1e-6)


def test_renorm_is_refused():
    # Keras 3.10 has no renorm and refuses the argument itself.
    with pytest.raises(ValueError, match="renorm"):
        keras_accum.AccumBatchNormalization(renorm=True)
