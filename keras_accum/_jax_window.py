"""JAX-specific window state: accumulators, counters, the window maths.

On JAX, Keras trains with a stateless, jitted step that takes every value
it needs as an argument and returns the new ones; a variable assigned inside
it (or inside a conditional in it) would leak a tracer. So the window's
values travel through the step with the rest of the training state, and
everything here is a pure function from window values to new window values.
The values rest in `keras.Variable`s between `fit` calls, which the model
does not track: `get_weights()` and weights files stay those of a plain
model.

The rules are `_tf_window.py`'s (overwrite on a window's first
micro-batch, divide by the window's normaliser total, skip a non-finite
window whole), written as pure functions, so that both backends equal
large-batch training the same way; the micro-batch weighting itself is
shared (`AccumModel._window_objective`).
"""

from __future__ import annotations

from typing import Any

import jax
import keras
from keras import ops
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from keras_accum._window_log import LOG_CAPACITY
from keras_accum._window_saving import SavedWindow

ACC_DTYPE = "float32"
# JAX computes in 32-bit integers unless x64 is enabled.
COUNT_DTYPE = "int32"

_FLOAT_SCALARS = ("acc_normalizer", "acc_loss", "acc_samples", "acc_grad_sq")
_INT_SCALARS = (
    "mini_step",
    "epoch_step",
    "steps_per_epoch",
    "window_length",
    "target_length",
    "skipped_windows",
)
# What closed windows publish for `PseudoBatchLogger`, as on TensorFlow:
# rings of `LOG_CAPACITY` entries and the count published so far. Carried
# in the state, not saved.
_FLOAT_RINGS = ("log_loss", "log_samples", "log_trace", "log_grad_sq")
_INT_RINGS = ("log_update", "log_micro")
_SCALARS = _FLOAT_SCALARS + _INT_SCALARS + ("log_count",)
_RINGS = _FLOAT_RINGS + _INT_RINGS
# Every named value, in the order the training state holds them.
_NAMES = _SCALARS + _RINGS

# Window values inside the step: {"acc_grads": [...], "mini_step": ..., ...}
WindowValues = dict[str, Any]


def _state_variable(name, shape, dtype):
    return keras.Variable(
        initializer="zeros",
        shape=shape,
        dtype=dtype,
        trainable=False,
        name=name,
    )


class JaxWindowState(SavedWindow):
    """The accumulation state of one `AccumModel` on the JAX backend.

    The attributes are those of `_tf_window.WindowState` that the JAX step
    uses, with the same meaning; between steps each holds its value, during
    an epoch the values live in the training state (see `variables`).

    Attributes:
        acc_grads: One float32 accumulator per trainable variable.
        acc_normalizer, acc_loss, acc_samples, acc_grad_sq: The window's
            normaliser total, weighted loss, samples and (unused on JAX)
            squared-norm total.
        mini_step, epoch_step, steps_per_epoch, window_length,
            target_length, skipped_windows: Counters, as on TensorFlow.
        log_loss, log_samples, log_update, log_micro, log_trace,
            log_grad_sq, log_count: The rings of closed windows that
            `PseudoBatchLogger` reads, as on TensorFlow (the noise-scale
            rings hold NaN: JAX does not estimate it).
    """

    def __init__(self, trainable_variables, accum_steps: int):
        self.acc_grads = [
            _state_variable(f"acc_grad_{i}", tuple(v.shape), ACC_DTYPE)
            for i, v in enumerate(trainable_variables)
        ]
        for name in _FLOAT_SCALARS:
            setattr(self, name, _state_variable(name, (), ACC_DTYPE))
        for name in (*_INT_SCALARS, "log_count"):
            setattr(self, name, _state_variable(name, (), COUNT_DTYPE))
        for names, dtype in (
            (_FLOAT_RINGS, ACC_DTYPE),
            (_INT_RINGS, COUNT_DTYPE),
        ):
            for name in names:
                setattr(
                    self, name, _state_variable(name, (LOG_CAPACITY,), dtype)
                )
        self.window_length.assign(accum_steps)
        self.target_length.assign(accum_steps)

    @property
    def variables(self) -> list:
        """Every window variable, in the order the training state holds."""
        return [*self.acc_grads, *(getattr(self, n) for n in _NAMES)]

    def unpack(self, values) -> WindowValues:
        """The flat values of `variables`, by name."""
        count = len(self.acc_grads)
        window = dict(zip(_NAMES, values[count:], strict=True))
        window["acc_grads"] = list(values[:count])
        return window

    def pack(self, window: WindowValues) -> list:
        """The inverse of `unpack`."""
        return [*window["acc_grads"], *(window[n] for n in _NAMES)]


# -- Pure window maths, traced into the step ----------------------------------


def accumulate(
    window: WindowValues, grads, weight, normalizer, loss, samples
) -> WindowValues:
    """Adds one micro-batch to the window; returns the new values."""
    window = dict(window)
    starting = window["mini_step"] == 0
    window["window_length"] = ops.where(
        starting, window["target_length"], window["window_length"]
    )
    weight = ops.cast(weight, ACC_DTYPE)
    # A window's first micro-batch overwrites what the last window left.
    window["acc_grads"] = [
        ops.where(starting, scaled, acc + scaled)
        for acc, scaled in (
            (acc, ops.cast(grad, ACC_DTYPE) * weight)
            for acc, grad in zip(window["acc_grads"], grads, strict=True)
        )
    ]
    for name, value in (
        ("acc_normalizer", normalizer),
        ("acc_loss", loss),
        ("acc_samples", samples),
    ):
        window[name] = window[name] + ops.cast(value, ACC_DTYPE)
    window["mini_step"] = window["mini_step"] + 1
    window["epoch_step"] = window["epoch_step"] + 1
    return window


def is_complete(window: WindowValues, close_at_epoch_end: bool):
    """Whether the window is full, or the epoch's last step was added."""
    complete = window["mini_step"] >= window["window_length"]
    if close_at_epoch_end:
        epoch_done = ops.logical_and(
            window["steps_per_epoch"] > 0,
            window["epoch_step"] >= window["steps_per_epoch"],
        )
        complete = ops.logical_or(complete, epoch_done)
    return complete


def close(
    window: WindowValues,
    should_close,
    optimizer,
    trainable_values: list,
    optimizer_values: list,
):
    """Applies and resets the window if `should_close`.

    Returns:
        `(window, trainable_values, optimizer_values)`, new values.
    """
    accs = window["acc_grads"]
    normalizer = window["acc_normalizer"]
    # Sum reductions add no normaliser: their window is the plain sum.
    divisor = ops.where(normalizer > 0, normalizer, ops.ones_like(normalizer))
    finite = _all_finite(accs)
    has_samples = window["acc_samples"] > 0
    go = has_samples
    if not isinstance(optimizer, LossScaleOptimizer):
        go = ops.logical_and(go, finite)
    go = ops.logical_and(should_close, go)

    def apply(trainable_values, optimizer_values):
        grads = [
            ops.cast(acc / divisor, value.dtype)
            for acc, value in zip(accs, trainable_values, strict=True)
        ]
        return optimizer.stateless_apply(
            optimizer_values, grads, trainable_values
        )

    def keep(trainable_values, optimizer_values):
        return list(trainable_values), list(optimizer_values)

    # Only the chosen branch runs: one optimizer apply per window.
    trainable_values, optimizer_values = jax.lax.cond(
        go, apply, keep, list(trainable_values), list(optimizer_values)
    )

    window = _publish(
        window,
        ops.logical_and(should_close, has_samples),
        window["acc_loss"] / divisor,
        optimizer_values[_iterations_index(optimizer)],
    )
    skipped = ops.logical_and(
        should_close, ops.logical_and(has_samples, ops.logical_not(finite))
    )
    window["skipped_windows"] = window["skipped_windows"] + ops.cast(
        skipped, COUNT_DTYPE
    )
    # The accumulators keep the closed window's sum: the next micro-batch
    # overwrites them (see `accumulate`).
    for name in _FLOAT_SCALARS:
        window[name] = ops.where(
            should_close, ops.zeros_like(window[name]), window[name]
        )
    window["mini_step"] = ops.where(
        should_close, ops.zeros_like(window["mini_step"]), window["mini_step"]
    )
    return window, trainable_values, optimizer_values


def _publish(window, publish, loss, iterations):
    """Writes the closing window into the logging rings if `publish`.

    As on TensorFlow, every closed window with samples is published, a
    skipped (non-finite) one included; `iterations` is the optimizer's
    count after the update, if any.
    """
    window = dict(window)
    slot = ops.logical_and(
        ops.arange(LOG_CAPACITY, dtype=COUNT_DTYPE)
        == window["log_count"] % LOG_CAPACITY,
        publish,
    )
    nan = float("nan")
    for name, value in (
        ("log_loss", loss),
        ("log_samples", window["acc_samples"]),
        ("log_update", iterations),
        ("log_micro", window["mini_step"]),
        ("log_trace", nan),
        ("log_grad_sq", nan),
    ):
        ring = window[name]
        window[name] = ops.where(slot, ops.cast(value, ring.dtype), ring)
    window["log_count"] = window["log_count"] + ops.cast(publish, COUNT_DTYPE)
    return window


def _iterations_index(optimizer):
    # Where `optimizer.iterations` sits in the optimizer's values.
    return next(
        i
        for i, variable in enumerate(optimizer.variables)
        if variable is optimizer.iterations
    )


def _all_finite(values):
    # Elementwise, as on TensorFlow: a sum of large finite values could
    # overflow and drop a valid window.
    if not values:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack([ops.all(ops.isfinite(v)) for v in values]))
