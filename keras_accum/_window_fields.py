"""The window's values besides its accumulators, each declared once.

`FIELDS` says, for every field of `_window.Counters`, what the rest of the
package derives from it: the variable's dtype and shape, how replicas
combine it under `tf.distribute`, whether a close resets it, whether a
file saves it and which values a saved one may hold, and the group it
belongs to (`Counters` nests the log rings as `counters.log` and the
auto controller as `counters.auto`). `_window` builds the variables and
the close's resets from it, `_tf_window` the replicas' aggregation,
`_window_saving` the saved entries and their checks.

Adding a saved counter is one `Field` here and its slot in `Counters` (or
in its group's tuple). A change to what a file holds also raises
`FORMAT_VERSION`; a file's entries are named by `Field.name` (flat:
`log_loss`, `auto_trace`), under the model attribute `SAVED_UNDER`.
"""

from __future__ import annotations

from typing import NamedTuple

from keras_accum._window_log import LOG_CAPACITY

# The dtypes of every backend's window: JAX computes integers in int32
# unless x64 is enabled, so a file saved on one backend loads on another.
ACC_DTYPE = "float32"
COUNT_DTYPE = "int32"
INT_MAX = 2**31 - 1

# The saved window's layout. 0: files written before it was recorded,
# which hold the same entries as 1. 2 added the stochastic rounding's
# draw (`rounding_seed`, `rounding_draws`): a version-1 file loads without
# them (`Field.since`).
FORMAT_VERSION = 2
# The `AccumModel` attribute that holds the window: Keras names a saved
# object's entries by the attribute path (`_window/vars/...`), so this name
# is part of the format.
SAVED_UNDER = "_window"


# The accumulators' names, in variables and files: one per trainable
# weight, in the model's order (`acc_grad_0`, `acc_grad_1`, ...).
_ACC_PREFIX = "acc_grad_"


def accumulator_key(index: int) -> str:
    """The name of the accumulator of the `index`-th trainable weight."""
    return f"{_ACC_PREFIX}{index}"


def is_accumulator_key(key: str) -> bool:
    """Whether `key` names an accumulator (not a counter)."""
    return key.startswith(_ACC_PREFIX) and key[len(_ACC_PREFIX) :].isdigit()


class Field(NamedTuple):
    """One of the window's values.

    Attributes:
        name: Its name in saved files and in `Counters.get`; a grouped
            field's is its group's name, `_` and its `attr`.
        dtype: `ACC_DTYPE` or `COUNT_DTYPE`.
        ring: A ring of the last `LOG_CAPACITY` closed windows (for
            `PseudoBatchLogger`); else a scalar.
        summed: Under `tf.distribute`, each replica holds its part and the
            value is their sum (the window's totals); else every replica
            holds the same value.
        resets: Set to 0 when a window closes.
        saved: Written to weights and `.keras` files with the window.
        low, high: A saved value's valid range (None: unbounded; NaN and
            infinity are refused wherever either is set, or `finite`).
        finite: A saved float must be finite.
        why: What the value is, for a load error's message.
        group: The `Counters` field that nests it (`"log"`, `"auto"`);
            None for a field of `Counters` itself.
        since: The `FORMAT_VERSION` that first saved it: a file of an
            earlier version loads without it, the loading model's value
            kept.
    """

    name: str
    dtype: str
    ring: bool = False
    summed: bool = False
    resets: bool = False
    saved: bool = False
    low: float | None = None
    high: float | None = None
    finite: bool = False
    why: str = ""
    group: str | None = None
    since: int = 1

    @property
    def shape(self) -> tuple:
        return (LOG_CAPACITY,) if self.ring else ()

    @property
    def attr(self) -> str:
        """Its attribute in its group's tuple (`counters.log.loss`), or in
        `Counters` itself."""
        if self.group is None:
            return self.name
        return self.name[len(self.group) + 1 :]


def _total(name):
    """A window total: each replica's part, summed; 0 after a close."""
    return Field(name, ACC_DTYPE, summed=True, resets=True, saved=True)


def _count(name, low=0, **kwargs):
    return Field(name, COUNT_DTYPE, saved=True, low=low, high=INT_MAX, **kwargs)


def _average(name):
    return Field(
        name,
        ACC_DTYPE,
        saved=True,
        finite=True,
        why="a moving average",
        group="auto",
    )


def _ring(name, dtype=ACC_DTYPE):
    return Field(name, dtype, ring=True, group="log")


FIELDS = (
    # The open window.
    _total("acc_normalizer"),
    _total("acc_loss"),
    _total("acc_samples"),
    _total("acc_grad_sq"),
    _count("mini_step", resets=True),
    # Where in `fit` it is.
    _count("epoch"),
    _count("epoch_step"),
    Field("steps_per_epoch", COUNT_DTYPE),
    _count("window_length", low=1),
    _count("target_length", low=1),
    _count("skipped_windows"),
    # The stochastic rounding's random stream (`accumulator_dtype=
    # "bfloat16"`): its seed, drawn once per window state, and the draws
    # taken, one per micro-batch; saved, so that a resumed run draws the
    # bits an uninterrupted one would.
    _count("rounding_seed", low=-INT_MAX - 1, since=2),
    _count("rounding_draws", since=2),
    # The log of closed windows, read by `PseudoBatchLogger`.
    Field("log_count", COUNT_DTYPE, group="log"),
    _ring("log_loss"),
    _ring("log_samples"),
    _ring("log_trace"),
    _ring("log_grad_sq"),
    _ring("log_update", COUNT_DTYPE),
    _ring("log_micro", COUNT_DTYPE),
    _ring("log_lr_scale"),
    # `accum_steps="auto"`'s controller (0 without one).
    _average("auto_trace"),
    _average("auto_grad_sq"),
    _count("auto_estimates", group="auto"),
    Field(
        "auto_progress",
        ACC_DTYPE,
        saved=True,
        low=0.0,
        finite=True,
        group="auto",
    ),
)

BY_NAME = {field.name: field for field in FIELDS}
# Derived views, in `FIELDS`' order.
TOTALS = tuple(f.name for f in FIELDS if f.summed)
RESETS = tuple(f.name for f in FIELDS if f.resets)
SAVED = tuple(f for f in FIELDS if f.saved)
GROUPS = tuple(dict.fromkeys(f.group for f in FIELDS if f.group))
