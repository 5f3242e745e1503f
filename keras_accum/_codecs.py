"""The accumulator dtypes (`accumulator_dtype`): one codec each.

A codec is how an accumulator holds the window's sum: the add (a window's
first micro-batch overwrites, later ones add; the sum made in float32 and
encoded into the accumulator), the close (the quotient, made in float32
and encoded the same way), the saved form and the bytes per element.
`Float32Accumulators` is exact; `BFloat16Accumulators` rounds each sum
stochastically (`_rounding`) and each quotient to nearest.

Each codec is written once in `keras.ops`, which each backend runs as its
own. What stays a backend's is where a result goes (JAX's step returns it,
TensorFlow assigns it, inside one XLA kernel per weight, PyTorch copies it
in place) and the fast paths each keeps for exact accumulators (`exact`):
a backend asks a codec for an accumulator's (`codec_of(acc.dtype)`), never
for its dtype's name.

A new codec is a subclass with a `name` and `dtype` and its two roundings
(`encode_sum`, `encode_quotient`; `saved` and `loaded` where a file cannot
hold its dtype), registered in `CODECS`: the setting's check and its
error, the window's accumulators, the saved form and its load checks
follow from the registry.
"""

from __future__ import annotations

import math
import numbers

import keras
import ml_dtypes
import numpy as np
from keras import ops

from keras_accum import _rounding
from keras_accum._window_fields import ACC_DTYPE

# Weights with fewer elements keep float32 accumulators whatever the
# setting: biases and normalization scales, whose sums are the most
# sensitive (a bias's gradient sums the whole micro-batch) and whose
# accumulators cost at most 64 KiB each.
SMALL_WEIGHT = 2**14


class AccumulatorCodec:
    """How an accumulator stores the window's sum.

    Attributes:
        name: The `accumulator_dtype` setting that selects it.
        dtype: The accumulator's dtype (a Keras dtype name).
        exact: The sum is kept in float32 as it is: a backend may add and
            divide in place (`assign_add`, `_foreach_add_`) without the
            codec.
        draws: Each micro-batch's add takes random bits (a
            `_rounding.Draw` from the window's `rounding_seed` and
            `rounding_draws`, which the window saves).
    """

    name: str = ACC_DTYPE
    dtype: str = ACC_DTYPE
    exact: bool = True
    draws: bool = False

    @property
    def bytes_per_element(self) -> int:
        """An accumulator's bytes per element of its weight."""
        return int(np.dtype(self.numpy_dtype).itemsize)

    @property
    def numpy_dtype(self):
        """The NumPy dtype a saved accumulator loads as."""
        return np.dtype(self.dtype)

    # -- Encoding (what a new codec writes) --------------------------------

    def widen(self, stored):
        """An accumulator's value as float32."""
        return ops.cast(stored, ACC_DTYPE)

    def encode_sum(self, total, draw, index):
        """The float32 sum `total` as accumulator `index` stores it;
        `draw` gives the micro-batch's random bits where `draws`."""
        del draw, index
        return ops.cast(total, self.dtype)

    def encode_quotient(self, value):
        """The float32 window gradient `value` as the accumulator stores
        it (what the optimizer gets)."""
        return ops.cast(value, self.dtype)

    # -- What the backends call ---------------------------------------------

    def add(self, stored, value, starting, draw=None, index=0):
        """The accumulator `stored` with the float32 micro-batch gradient
        `value` added, or `value` alone where `starting` (a boolean scalar,
        or a Python bool where known), encoded (`encode_sum`)."""
        if starting is True:
            total = value
        elif starting is False:
            total = self.widen(stored) + value
        else:
            total = ops.where(starting, value, self.widen(stored) + value)
        return self.encode_sum(total, draw, index)

    def quotient(self, stored, divisor):
        """The window's gradient from its sum `stored`: divided in float32
        and encoded (`encode_quotient`), whatever the weight's dtype (the
        optimizer widens it inside its own update). A float32 quotient of
        every large weight would be alive until the apply: with Adam, 4
        bytes a parameter of temporaries, more than bfloat16 accumulators
        save (`tests/test_memory.py`)."""
        return self.encode_quotient(self.widen(stored) / divisor)

    def squares(self, stored):
        """The sum of the squares of `stored`'s elements, in float32."""
        return ops.sum(ops.square(self.widen(stored)))

    def saved(self, stored):
        """What a file holds of an accumulator (its variable, or the
        float32 sum of its devices' partial sums): one of `DTYPES`, in
        the weight's shape. The accumulator as it is by default."""
        return stored

    def loaded(self, array):
        """A saved accumulator (a NumPy array, float32 or any codec's
        dtype) as this codec stores it: either loads into either, rounded
        to nearest once."""
        return np.asarray(array).astype(self.numpy_dtype)


class Float32Accumulators(AccumulatorCodec):
    """Float32 accumulators: the window's sum, exact to float32 rounding
    (the default, `accumulator_dtype=None` or `"float32"`)."""

    def widen(self, stored):
        return stored

    def encode_sum(self, total, draw, index):
        del draw, index
        return total

    def encode_quotient(self, value):
        return value


class BFloat16Accumulators(AccumulatorCodec):
    """bfloat16 accumulators (`accumulator_dtype="bfloat16"`): each sum
    made in float32 and rounded stochastically (unbiased: `_rounding`),
    each quotient rounded to nearest; 2 bytes per element."""

    name = "bfloat16"
    dtype = "bfloat16"
    exact = False
    draws = True

    @property
    def numpy_dtype(self):
        return np.dtype(ml_dtypes.bfloat16)

    def encode_sum(self, total, draw, index):
        # The bits are a hash of each element's position: XLA fuses them,
        # the sum and the rounding into one pass over the weight.
        return _rounding.rounded(
            total, _rounding.random_bits(draw, index, total.shape)
        )


FLOAT32 = Float32Accumulators()
# The codecs by setting, in the order messages list them.
CODECS = {codec.name: codec for codec in (FLOAT32, BFloat16Accumulators())}
_BY_DTYPE = {codec.dtype: codec for codec in CODECS.values()}
# An accumulator's dtypes, as the saved form checks them.
DTYPES = tuple(_BY_DTYPE)


def codec_of(dtype) -> AccumulatorCodec:
    """The codec of an accumulator of `dtype` (a dtype or its name)."""
    return _BY_DTYPE[keras.backend.standardize_dtype(dtype)]


def codec_for(shape, setting) -> AccumulatorCodec:
    """The codec of the accumulator of a weight of `shape` under the
    model's `accumulator_dtype` (None: float32): float32 for weights of
    fewer than `SMALL_WEIGHT` elements."""
    if setting is None or math.prod(shape) < SMALL_WEIGHT:
        return FLOAT32
    return CODECS[setting]


def check_accumulator_dtype(accumulator_dtype: object) -> str | None:
    """Returns `accumulator_dtype` as the model keeps it: None (float32
    accumulators, which `"float32"` also means) or another codec's name
    (`"bfloat16"`); or raises naming the value. A dtype object is read as
    Keras reads one (`keras.backend.standardize_dtype`: `np.float32`,
    `tf.bfloat16`, `torch.bfloat16`, ...)."""
    if accumulator_dtype is None:
        return None
    names = ["None", *(f'"{name}"' for name in CODECS)]
    expected = (
        f"`accumulator_dtype` must be {', '.join(names[:-1])} or "
        f"{names[-1]} (or a dtype object of one of them, e.g. `np.float32`)"
    )
    # Numbers: Keras would refuse them too, but `True` or `16` is a
    # wrong type, not a wrong dtype name.
    name = None
    if not isinstance(accumulator_dtype, (bool, numbers.Number)):
        try:
            name = keras.backend.standardize_dtype(accumulator_dtype)
        except (ValueError, TypeError):
            name = None
    if name is None and not isinstance(accumulator_dtype, str):
        raise TypeError(
            f"{expected}. Received: accumulator_dtype={accumulator_dtype!r} "
            f"(of type {type(accumulator_dtype).__name__})"
        )
    if name is None or name not in CODECS:
        why = ""
        if name == "float16" or accumulator_dtype == "half":
            why = (
                " (float16 accumulators are not offered: their range "
                "loses small gradients to underflow and large sums to "
                "overflow)"
            )
        raise ValueError(
            f"{expected}{why}. "
            f"Received: accumulator_dtype={accumulator_dtype!r}"
        )
    return None if CODECS[name] is FLOAT32 else name
