"""Low-precision accumulators (`accumulator_dtype="bfloat16"`).

Which weights get one, and the stochastic rounding that adds into it; the
random bits come from each backend (`Draw` says which).

A bfloat16 value keeps the top 16 bits of a float32. Adding a micro-batch
computes the new sum in float32, adds a uniform random integer in
[0, 2**16) to its bit pattern and keeps the top 16 bits: the sum rounds
away from zero with probability (dropped bits) / 2**16, so its expected
value is the float32 sum (unbiased), where round-to-nearest would lose
every addend below half a unit in the last place of the running sum
(in bfloat16, 256 + 1 = 256).
"""

from __future__ import annotations

import math
import random
from typing import NamedTuple

from keras import ops

from keras_accum._window_fields import ACC_DTYPE

LOW_DTYPE = "bfloat16"
# Weights with fewer elements keep float32 accumulators whatever the
# setting: biases and normalization scales, whose sums are the most
# sensitive (a bias's gradient sums the whole micro-batch) and whose
# accumulators cost at most 64 KiB each.
SMALL_WEIGHT = 2**14
# The bits a float32 drops to become a bfloat16.
_DROPPED = 2**16
# `0xFFFF0000` as an int32: keeps a float32's bfloat16 part.
_KEEP_HIGH = -_DROPPED


class Draw(NamedTuple):
    """Where a micro-batch's random bits come from.

    Attributes:
        seed: The window's `rounding_seed` (an int32 scalar).
        count: The window's `rounding_draws` with this micro-batch in:
            each micro-batch's bits differ; the accumulator's index makes
            each weight's differ within a micro-batch.
    """

    seed: object
    count: object


def accumulator_dtype(shape, setting) -> str:
    """The dtype of the accumulator of a weight of `shape` under the
    model's `accumulator_dtype` (None: float32)."""
    if setting is None or math.prod(shape) < SMALL_WEIGHT:
        return ACC_DTYPE
    return setting


def is_low(dtype) -> bool:
    """Whether an accumulator of `dtype` rounds stochastically."""
    return str(getattr(dtype, "name", dtype)).endswith(LOW_DTYPE)


def new_seed() -> int:
    """A window's seed: from Python's generator, as Keras seeds a layer's
    `SeedGenerator`, so that `keras.utils.set_random_seed` fixes it."""
    return random.randint(1, 2**31 - 1)


def rounded(total, bits):
    """`total` (float32) stochastically rounded to bfloat16, with `bits`
    uniform int32 in [0, 2**16) of its shape."""
    raised = ops.view(total, "int32") + bits
    kept = ops.view(ops.bitwise_and(raised, _KEEP_HIGH), "float32")
    # A NaN whose bit pattern is within 2**16 of the int32 range's ends
    # would wrap round to a zero: kept as the NaN it is. An infinity has
    # zeros in its dropped bits and stays one.
    return ops.cast(ops.where(ops.isnan(total), total, kept), LOW_DTYPE)


def as_float32(value):
    """An accumulator's value as float32 (the identity on a float32 one)."""
    if is_low(value.dtype):
        return ops.cast(value, ACC_DTYPE)
    return value


def bit_range() -> int:
    """The random integers' exclusive bound: the bits a float32 drops."""
    return _DROPPED
