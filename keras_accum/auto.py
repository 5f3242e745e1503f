"""`accum_steps="auto"`: a window that follows the critical batch size.

`AutoAccumSteps` configures the controller; its rules (`learning_rate`,
`steer`) are pure functions of the window's counters, run by
`_window.close` inside the compiled step on every backend.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Any, NamedTuple

import keras
from keras import ops

LR_SCALINGS = (None, "sqrt", "linear", "adascale")
# The longest window: its length and micro-batch counts are int32 in the
# step on every backend.
MAX_STEPS = 2**31 - 1
# A new length must differ from the current one by this factor (or more)
# before the window changes: a smoothed estimate that wobbles around a
# length does not make it flip back and forth.
HYSTERESIS = 1.25
# The most a window's length changes in one decision (a factor), so that a
# single outlying estimate cannot make it jump.
MAX_CHANGE = 2.0


@keras.saving.register_keras_serializable(package="keras_accum")
@dataclasses.dataclass(frozen=True)
class AutoAccumSteps:
    """A window length that follows the gradient noise scale.

    Pass it (or `"auto"`, its defaults) as `AccumModel`'s `accum_steps`.
    Every window measures the gradient noise scale from its micro-batches
    (McCandlish et al. 2018: B_simple = tr(Σ) / |G|², the batch size past
    which a larger batch stops paying for itself in fewer updates); the
    controller smooths the estimates over windows and, at each window's
    close, sets the next windows' length to the number of micro-batches
    that reaches `batch_fraction` × B_simple, within
    `[min_steps, max_steps]`. It changes the length only when the target
    is at least 1.25 times it (or, with `shrink`, at most 1/1.25 of it),
    by at most a factor of 2, and only after `warmup` windows measured
    since the last change; while the average of |G|² is not positive it
    waits. The new length applies from the next window. All of it runs
    in the compiled step, with no host round trip: XLA,
    `steps_per_execution`, `keras.distribution` and `tf.distribute`
    (where the estimates are averaged over replicas) work as with a fixed
    length. See the guide "Choosing the window automatically".

    Each window stays exact: it equals a plain `keras.Model` trained on
    that window's samples as one batch. The lengths chosen are visible in
    `PseudoBatchLogger.updates` (`micro_batches`) and its epoch logs
    (`pseudo_batch_window_length`); the controller's state is saved with
    the window (weights files, `.keras` files, `BackupAndRestore`).

    The learning rate may follow the window (`lr_scaling`), relative to
    the first window of `min_steps` micro-batches, the batch the learning
    rate was chosen for:

    - `None`: unchanged. The growing batch itself acts as a learning-rate
      decay (Smith et al. 2017, "Don't Decay the Learning Rate, Increase
      the Batch Size");
    - `"sqrt"`: times sqrt(S), S the window's micro-batches over
      `min_steps`, the usual rule for Adam-like optimizers;
    - `"linear"`: times S, the rule for SGD (Goyal et al. 2017);
    - `"adascale"`: times AdaScale's gain r = (σ² + |G|²) / (σ²/S + |G|²)
      (Johnson et al. 2020), between 1 and S, from the same smoothed
      estimates; a `LearningRateSchedule` is evaluated at the scale-
      invariant progress (the sum of the gains) instead of the update
      count, so a schedule written for the base batch still applies.

    Args:
        min_steps: Integer >= 2. The first window's length and the
            shortest. A window of one micro-batch cannot measure the noise
            scale, so the controller needs two. Defaults to `2`.
        max_steps: Integer >= `min_steps`. The longest window. Defaults to
            `64`.
        batch_fraction: Positive float. The window's batch aims at this
            fraction of B_simple. Defaults to `0.1` (see the guide: on
            MNIST, fixed windows at a tenth of the measured B_simple train
            best for a given number of epochs).
        smoothing: Float in [0, 1). The decay of the moving averages of
            tr(Σ) and |G|², per micro-batch: a window of k micro-batches
            decays them by `smoothing ** k`, so a long window, whose
            estimates are less noisy, weighs more. Defaults to `0.999`
            (a memory of about 1,000 micro-batches: late in training |G|²
            is small against the noise, and a shorter average lets one
            low estimate pass for a large noise scale).
        warmup: Integer >= 1. Windows measured before the first change,
            and after each change before the next. Defaults to `25`.
        shrink: Bool. Whether the window may also shrink when the noise
            scale falls. Defaults to `False`: the critical batch size
            grows as the loss falls, and a window that follows every dip of
            a noisy estimate down and up again trains no better.
        lr_scaling: `None`, `"sqrt"`, `"linear"` or `"adascale"` (above).
            Defaults to `None`.

    Example:

    ```python
    model = keras_accum.AccumModel(
        inputs, outputs,
        accum_steps=keras_accum.AutoAccumSteps(max_steps=32),
    )
    ```
    """

    min_steps: int = 2
    max_steps: int = 64
    batch_fraction: float = 0.1
    smoothing: float = 0.999
    warmup: int = 25
    shrink: bool = False
    lr_scaling: str | None = None

    def __post_init__(self) -> None:
        checked = {
            "min_steps": _integer("min_steps", self.min_steps, 2),
            "max_steps": _integer("max_steps", self.max_steps, self.min_steps),
            "batch_fraction": _number(
                "batch_fraction",
                self.batch_fraction,
                "a positive, finite number",
                (0.0, None),
            ),
            "smoothing": _number(
                "smoothing", self.smoothing, "a number in [0, 1)", (None, 1.0)
            ),
            "warmup": _integer("warmup", self.warmup, 1),
        }
        if not isinstance(self.shrink, bool):
            raise ValueError(
                f"`shrink` must be a bool. Received: shrink={self.shrink!r}"
            )
        if self.lr_scaling not in LR_SCALINGS:
            raise ValueError(
                "`lr_scaling` must be one of None, 'sqrt', 'linear', "
                f"'adascale'. Received: lr_scaling={self.lr_scaling!r}"
            )
        for name, value in checked.items():
            # Frozen: the checked, plain Python values replace the given.
            object.__setattr__(self, name, value)

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> AutoAccumSteps:
        return cls(**config)


def _integer(name, value, least):
    if (
        isinstance(value, bool)
        or not isinstance(value, numbers.Integral)
        or value < least
    ):
        raise ValueError(
            f"`{name}` must be an integer >= {least}. "
            f"Received: {name}={value!r}"
        )
    if value > MAX_STEPS:
        raise ValueError(
            f"`{name}` must be at most {MAX_STEPS} (2**31 - 1: the window "
            f"counts in int32). Received: {name}={value!r}"
        )
    return int(value)


def _number(name, value, allowed, bounds):
    """`value` as a finite float where `above < value` and
    `0 <= value < below` (`bounds`, either None for no bound), else
    raises."""
    above, below = bounds
    ok = (
        not isinstance(value, bool)
        and isinstance(value, numbers.Real)
        and math.isfinite(value)
    )
    if ok:
        ok = (above is None or value > above) and (
            below is None or 0 <= value < below
        )
    if not ok:
        raise ValueError(
            f"`{name}` must be {allowed}. Received: {name}={value!r}"
        )
    return float(value)


# -- The rules, in the step ---------------------------------------------------


class Rate(NamedTuple):
    """The learning rate of a closing window.

    Attributes:
        scale: The factor on the optimizer's learning rate.
        progress: Where a `LearningRateSchedule` is evaluated instead of
            `optimizer.iterations` (AdaScale); None to keep Keras's.
    """

    scale: Any
    progress: Any = None


def learning_rate(counters, config: AutoAccumSteps, micro_steps, samples):
    """The `Rate` of the window closing with `micro_steps` micro-batches
    and `samples` samples; None where the learning rate is left alone."""
    if config.lr_scaling is None:
        return None
    scale = _float(micro_steps) / float(config.min_steps)
    if config.lr_scaling == "sqrt":
        return Rate(ops.sqrt(scale))
    if config.lr_scaling == "linear":
        return Rate(scale)
    micro_batch = _float(samples) / ops.maximum(_float(micro_steps), 1.0)
    gain = adascale_gain(
        counters.auto_trace,
        counters.auto_grad_sq,
        scale,
        micro_batch * config.min_steps,
    )
    return Rate(gain, counters.auto_progress)


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


def steer(counters, estimates, window, rate, config: AutoAccumSteps):
    """The controller's counters after a window closed.

    Args:
        counters: The window's counters after `_window.finish`.
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
        A dict of the counters that change.
    """
    trace, grad_sq, taken = estimates
    micro_steps, micro_batch = window
    # Per micro-batch: a window of k micro-batches weighs as k of them
    # (its estimates are about k times less noisy than a short one's).
    decay = ops.power(config.smoothing, micro_steps)
    smoothed_trace = ops.where(
        taken,
        decay * counters.auto_trace + (1 - decay) * trace,
        counters.auto_trace,
    )
    smoothed_grad_sq = ops.where(
        taken,
        decay * counters.auto_grad_sq + (1 - decay) * grad_sq,
        counters.auto_grad_sq,
    )
    # Windows measured since the window last changed length.
    measured = counters.auto_estimates + ops.cast(taken, "int32")
    length = next_length(
        counters.target_length,
        noise_scale(smoothed_trace, smoothed_grad_sq) / micro_batch,
        config,
    )
    # A moving average of |G|² at or below zero says the gradient is lost
    # in the noise of the windows so far, not how long a window should
    # be: no decision until it is positive.
    decide = ops.logical_and(taken, measured >= config.warmup)
    decide = ops.logical_and(decide, smoothed_grad_sq > 0)
    length = ops.where(decide, length, counters.target_length)
    changed = length != counters.target_length
    changes = {
        "auto_trace": smoothed_trace,
        "auto_grad_sq": smoothed_grad_sq,
        # A change waits for `warmup` windows of the new length.
        "auto_estimates": ops.where(changed, 0, measured),
        "target_length": length,
    }
    found, applied = rate
    if found is not None and found.progress is not None:
        changes["auto_progress"] = counters.auto_progress + ops.where(
            applied, _float(found.scale), 0.0
        )
    return changes


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
    bounded = ops.clip(
        ops.round(bounded), float(config.min_steps), float(config.max_steps)
    )
    return ops.where(outside, ops.cast(bounded, "int32"), current)


def _float(value):
    return ops.cast(value, "float32")
