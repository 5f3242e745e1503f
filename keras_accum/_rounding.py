"""The stochastic rounding of bfloat16 accumulators (`_codecs`).

The rounding that adds into one, and its random bits (`Draw` says which),
written once for the three backends.

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

LOW_DTYPE = "bfloat16"
# The bits a float32 drops to become a bfloat16.
_DROPPED = 2**16
# `0xFFFF0000` as an int32: keeps a float32's bfloat16 part.
_KEEP_HIGH = -_DROPPED
# The hash's constants, as int32: 0x9E3779B9 (the golden ratio's bits),
# then lowbias32's multipliers 0x7FEB352D and 0x846CA68B.
_GOLDEN = 0x9E3779B9 - 2**32
_M1 = 0x7FEB352D
_M2 = 0x846CA68B - 2**32


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


def random_bits(draw: Draw, index: int, shape):
    """Uniform int32 in [0, 2**16) of `shape`, for accumulator `index` in
    the micro-batch `draw` takes.

    A counter-based hash of each element's position, keyed by the draw
    and the index, in int32 arithmetic (which wraps the same way on every
    backend): nothing but elementwise operations on a range, which XLA
    fuses into the rounding, so no buffer of bits is ever made; a
    generator's bits, independent of the gradient, were made for every
    weight at the start of JAX's step (13.7 bytes per parameter of
    temporaries, against 4.0 for a plain step). The same draw gives the
    same bits on every backend and every rerun.
    """
    key = _mix(ops.cast(draw.count, "int32") * _GOLDEN + index)
    key = _mix(ops.bitwise_xor(ops.cast(draw.seed, "int32"), key))
    position = ops.reshape(ops.arange(math.prod(shape), dtype="int32"), shape)
    hashed = _mix(ops.bitwise_xor(_mix(position + key), key * _GOLDEN))
    return _shifted(hashed, 16)


def _shifted(x, bits):
    """`x >> bits` as a uint32 would shift (zeros in from the left)."""
    return ops.bitwise_and(ops.right_shift(x, bits), 2 ** (32 - bits) - 1)


def _mix(x):
    # lowbias32, Chris Wellons' 32-bit integer hash, in int32.
    x = ops.bitwise_xor(x, _shifted(x, 16)) * _M1
    x = ops.bitwise_xor(x, _shifted(x, 15)) * _M2
    return ops.bitwise_xor(x, _shifted(x, 16))
