"""The accumulator codecs (`keras_accum._codecs`), on hand-computed values.

No model: each codec's add, close, saved form and size, on `keras.ops`
values of the running backend. Runs under every backend.
"""

import keras
import ml_dtypes
import numpy as np
import pytest
from keras import ops

from keras_accum import _codecs, _rounding

CODECS = list(_codecs.CODECS.values())


def _draw(count):
    return _rounding.Draw(
        ops.convert_to_tensor(7, "int32"), ops.convert_to_tensor(count, "int32")
    )


def _numpy(value):
    return np.asarray(ops.convert_to_numpy(ops.cast(value, "float32")))


@pytest.mark.parametrize("known", [True, False], ids=["python", "tensor"])
@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name)
def test_gradients_1_2_3_4_average_to_2_5_through_each_codec(codec, known):
    """1 + 2 + 3 + 4 = 10 and 10 / 4 = 2.5: each exact in bfloat16 too
    (8 significant bits), so the stochastic rounding, which only rounds
    away dropped bits, leaves every sum as it is."""
    stored = ops.zeros((2, 3), codec.dtype)
    for count, gradient in enumerate([1.0, 2.0, 3.0, 4.0], start=1):
        starting = count == 1
        if not known:
            starting = ops.convert_to_tensor(starting)
        value = ops.full((2, 3), gradient, "float32")
        stored = codec.add(stored, value, starting, _draw(count), index=0)
        assert keras.backend.standardize_dtype(stored.dtype) == codec.dtype
    np.testing.assert_array_equal(_numpy(stored), np.full((2, 3), 10.0))
    window = codec.quotient(stored, ops.convert_to_tensor(4.0))
    assert keras.backend.standardize_dtype(window.dtype) == codec.dtype
    np.testing.assert_array_equal(_numpy(window), np.full((2, 3), 2.5))
    assert float(codec.squares(window)) == 6 * 2.5**2


def test_a_window_first_add_overwrites_what_the_last_one_left():
    for codec in CODECS:
        stored = ops.full((4,), 100.0, codec.dtype)
        stored = codec.add(stored, ops.ones((4,)), True, _draw(1), index=0)
        np.testing.assert_array_equal(_numpy(stored), np.ones(4))


def test_a_bfloat16_quotient_rounds_to_nearest():
    """1 / 3 is 0x3EAAAAAB in float32: bfloat16 keeps 0x3EAA and the
    dropped 0xAAAB is above half (0x8000), so to nearest is 0x3EAB =
    171 / 512 = 0.333984375 (truncation would give 0x3EAA = 0.33203125).
    Float32 accumulators keep the float32 quotient."""
    bf16 = _codecs.CODECS["bfloat16"]
    stored = ops.ones((3,), "bfloat16")
    window = bf16.quotient(stored, ops.convert_to_tensor(3.0))
    np.testing.assert_array_equal(_numpy(window), np.full(3, 171 / 512))
    exact = _codecs.FLOAT32.quotient(ops.ones((3,)), 3.0)
    np.testing.assert_array_equal(_numpy(exact), np.full(3, np.float32(1 / 3)))


def test_a_bfloat16_sum_rounds_stochastically_and_unbiased():
    """256 + 1 is halfway between bfloat16's 256 and 258 (a unit in the
    last place is 2 there): to nearest (even) it stays 256 for ever;
    stochastically half the elements round up, so the mean is 257 within
    the sampling noise (each element's standard deviation is 1). Float32
    keeps 257."""
    n = 2**14
    bf16 = _codecs.CODECS["bfloat16"]
    stored = ops.full((n,), 256.0, "bfloat16")
    summed = _numpy(bf16.add(stored, ops.ones((n,)), False, _draw(2), 5))
    assert set(np.unique(summed)) == {256.0, 258.0}
    assert abs(summed.mean() - 257.0) <= 6 / np.sqrt(n)
    exact = _codecs.FLOAT32.add(ops.full((n,), 256.0), ops.ones((n,)), False)
    np.testing.assert_array_equal(_numpy(exact), np.full(n, 257.0))


def test_the_bytes_per_element_and_the_saved_form():
    assert _codecs.FLOAT32.bytes_per_element == 4
    assert _codecs.CODECS["bfloat16"].bytes_per_element == 2
    assert _codecs.DTYPES == ("float32", "bfloat16")
    # A float32 file loads into bfloat16 accumulators rounded to nearest
    # once (1 / 3 as above), and a bfloat16 one into float32 as it is.
    third = np.full((2,), 1 / 3, "float32")
    loaded = _codecs.CODECS["bfloat16"].loaded(third)
    assert loaded.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(loaded.astype("float32"), [171 / 512] * 2)
    widened = _codecs.FLOAT32.loaded(loaded)
    assert widened.dtype == np.float32
    np.testing.assert_array_equal(widened, [171 / 512] * 2)


def test_the_registry_resolves_settings_and_dtypes():
    small, large = (127, 128), (128, 128)  # 2**14 elements: low precision.
    bf16 = _codecs.CODECS["bfloat16"]
    assert _codecs.codec_for(large, None) is _codecs.FLOAT32
    assert _codecs.codec_for(small, "bfloat16") is _codecs.FLOAT32
    assert _codecs.codec_for(large, "bfloat16") is bf16
    assert _codecs.codec_of("bfloat16") is bf16
    assert _codecs.codec_of(ops.zeros((1,), "bfloat16").dtype) is bf16
    assert _codecs.codec_of(ops.zeros((1,)).dtype) is _codecs.FLOAT32
    assert (bf16.exact, bf16.draws) == (False, True)
    assert (_codecs.FLOAT32.exact, _codecs.FLOAT32.draws) == (True, False)
    assert _codecs.check_accumulator_dtype("float32") is None
    assert _codecs.check_accumulator_dtype(ml_dtypes.bfloat16) == "bfloat16"
    with pytest.raises(ValueError, match='None, "float32" or "bfloat16"'):
        _codecs.check_accumulator_dtype("int8")
