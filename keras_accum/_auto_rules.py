"""`accum_steps="auto"`'s rules, in the step: pure functions of the
window's counters.

`_window.close` runs them inside the compiled step on every backend:
`learning_rate` gives a closing window's learning-rate factor, `steer`
the controller's next state (`_window.Controller`, the counters' `auto`
group) and the next windows' length. The settings
are the public `keras_accum.AutoAccumSteps`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
from keras import ops

from keras_accum.auto import AutoAccumSteps

# A new length must differ from the current one by this factor (or more)
# before the window changes: a smoothed estimate that wobbles around a
# length does not make it flip back and forth.
HYSTERESIS = 1.25
# The most a window's length changes in one decision (a factor), so that a
# single outlying estimate cannot make it jump.
MAX_CHANGE = 2.0


class Rate(NamedTuple):
    """The learning rate of a closing window.

    Attributes:
        scale: The factor on the optimizer's learning rate.
        progress: Where a `LearningRateSchedule` is evaluated instead of
            `optimizer.iterations` (AdaScale); None to keep Keras's.
    """

    scale: Any
    progress: Any = None


def learning_rate(controller, config: AutoAccumSteps, micro_steps, samples):
    """The `Rate` of the window closing with `micro_steps` micro-batches
    and `samples` samples, from the `controller`'s state; None where the
    learning rate is left alone."""
    if config.lr_scaling is None:
        return None
    scale = _float(micro_steps) / float(config.min_steps)
    if config.lr_scaling == "sqrt":
        return Rate(ops.sqrt(scale))
    if config.lr_scaling == "linear":
        return Rate(scale)
    micro_batch = _float(samples) / ops.maximum(_float(micro_steps), 1.0)
    gain = adascale_gain(
        controller.trace,
        controller.grad_sq,
        scale,
        micro_batch * config.min_steps,
    )
    return Rate(gain, controller.progress)


def adascale_gain(trace, grad_sq, scale, base_samples):
    """AdaScale's gain r = (σ² + |G|²) / (σ²/S + |G|²) at scale `scale`.

    σ² = tr(Σ) / `base_samples` is the gradient variance of the base batch
    (`trace` per sample); estimates below zero count as zero (their
    unbiased estimators can go negative). 1 where nothing is measured;
    always between 1 and `scale`.
    """
    sigma_sq = ops.maximum(_float(trace), 0.0) / base_samples
    signal = ops.maximum(_float(grad_sq), 0.0)
    numerator = sigma_sq + signal
    denominator = sigma_sq / scale + signal
    gain = ops.where(
        denominator > 0,
        numerator / ops.where(denominator > 0, denominator, 1.0),
        1.0,
    )
    low = ops.minimum(scale, 1.0)
    high = ops.maximum(scale, 1.0)
    return ops.clip(gain, low, high)


def steer(controller, target_length, estimates, window, rate, config):
    """The controller after a window closed, and the next windows' length.

    Args:
        controller: The `_window.Controller` (its values) before it.
        target_length: The length of the windows that would start now.
        estimates: `(trace, grad_sq, taken)`: the closed window's noise
            estimates (over every replica) and whether they count (the
            window closed with samples, and both are finite).
        window: `(micro_steps, micro_batch)` of the closed window: its
            micro-batches, and its samples per micro-batch (every
            replica's), as float32.
        rate: The window's `Rate` (None: no scaling) and whether the
            optimizer applied it, as `(rate, applied)`.
        config: The `AutoAccumSteps`.

    Returns:
        `(controller, target_length)`.
    """
    trace, grad_sq, taken = estimates
    micro_steps, micro_batch = window
    # Per micro-batch: a window of k micro-batches weighs as k of them
    # (its estimates are about k times less noisy than a short one's).
    decay = ops.power(config.smoothing, micro_steps)
    smoothed_trace = ops.where(
        taken,
        decay * controller.trace + (1 - decay) * trace,
        controller.trace,
    )
    smoothed_grad_sq = ops.where(
        taken,
        decay * controller.grad_sq + (1 - decay) * grad_sq,
        controller.grad_sq,
    )
    # Windows measured since the window last changed length.
    measured = controller.estimates + ops.cast(taken, "int32")
    length = next_length(
        target_length,
        noise_scale(smoothed_trace, smoothed_grad_sq) / micro_batch,
        config,
    )
    # A moving average of |G|² at or below zero says the gradient is lost
    # in the noise of the windows so far, not how long a window should
    # be: no decision until it is positive.
    decide = ops.logical_and(taken, measured >= config.warmup)
    decide = ops.logical_and(decide, smoothed_grad_sq > 0)
    length = ops.where(decide, length, target_length)
    changed = length != target_length
    progress = controller.progress
    found, applied = rate
    if found is not None and found.progress is not None:
        progress = progress + ops.where(applied, _float(found.scale), 0.0)
    return (
        controller._replace(
            trace=smoothed_trace,
            grad_sq=smoothed_grad_sq,
            # A change waits for `warmup` windows of the new length.
            estimates=ops.where(changed, 0, measured),
            progress=progress,
        ),
        length,
    )


def noise_scale(trace, grad_sq):
    """B_simple = tr(Σ) / |G|² from smoothed estimates (their moving
    averages' bias corrections cancel in the ratio); inf where |G|² is not
    positive (`steer` then waits for a positive average)."""
    trace = ops.maximum(_float(trace), 0.0)
    grad_sq = _float(grad_sq)
    positive = grad_sq > 0
    return ops.where(
        positive,
        trace / ops.where(positive, grad_sq, 1.0),
        float("inf"),
    )


def next_length(current, ideal, config: AutoAccumSteps):
    """The window length for an `ideal` number of micro-batches (a float,
    maybe inf), from `current`: unchanged inside the hysteresis band, else
    moved towards it by at most `MAX_CHANGE`, within the bounds."""
    now = _float(current)
    ideal = _float(ideal) * config.batch_fraction
    outside = ideal >= now * HYSTERESIS
    if config.shrink:
        outside = ops.logical_or(outside, ideal <= now / HYSTERESIS)
    bounded = ops.clip(ideal, now / MAX_CHANGE, now * MAX_CHANGE)
    # The upper bound as float32 rounded down, not to nearest: 2**31 - 1
    # rounds up to 2**31, which does not fit int32 (TensorFlow and PyTorch
    # cast it to -2**31, XLA saturates). The bound itself is given as an
    # int, so a length at the float32 bound is `max_steps` exactly.
    top = float32_at_most(config.max_steps)
    bounded = ops.clip(ops.round(bounded), float(config.min_steps), top)
    length = ops.where(
        bounded >= top,
        ops.convert_to_tensor(config.max_steps, "int32"),
        ops.cast(bounded, "int32"),
    )
    return ops.where(outside, length, current)


def float32_at_most(value: int) -> float:
    """The largest float32 not above the integer `value`."""
    rounded = np.float32(value)
    if int(rounded) > value:
        rounded = np.nextafter(rounded, np.float32(0))
    return float(rounded)


def _float(value):
    return ops.cast(value, "float32")
