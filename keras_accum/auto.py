"""The `"auto"` settings: `accum_steps="auto"`, a window that follows the
critical batch size, and `micro_batch_size="auto"`, a micro-batch sized to
the device's memory.

`AutoAccumSteps` configures the controller; its rules
(`_auto_rules.learning_rate`, `_auto_rules.steer`) are pure functions of
the window's counters, run by `_window.close` inside the compiled step on
every backend. `AutoMicroBatch` configures the search in `_sizing.py`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

import keras
import numpy as np

from keras_accum._window_fields import INT_MAX

LR_SCALINGS = (None, "sqrt", "linear", "adascale")
# The longest window: its length and micro-batch counts are int32 in the
# step on every backend.
MAX_STEPS = INT_MAX


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
        max_steps: Integer from `min_steps` to 2**31 - 1 (the window
            counts in int32). The longest window. Defaults to `64`.
        batch_fraction: Positive float, one that float32 holds (from
            about 1.2e-38 to 3.4e38). The window's batch aims at this
            fraction of B_simple. Defaults to `0.1` (see the guide: on
            MNIST, fixed windows at a tenth of the measured B_simple train
            best for a given number of epochs).
        smoothing: Float in [0, 1), below 1 in float32 (at most
            1 - 2**-24, about 0.99999994). The decay of the moving averages of
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
        _float32_holds(checked)
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


@keras.saving.register_keras_serializable(package="keras_accum")
@dataclasses.dataclass(frozen=True)
class AutoMicroBatch:
    """A micro-batch sized to the memory the train step may use.

    Pass it (or `"auto"`, its defaults) as `AccumModel`'s
    `micro_batch_size`. Before the first train step of `fit` (and the
    first test or predict step of `evaluate`, validation or `predict`,
    each sized for its own step), the model finds the largest
    micro-batch whose step's peak memory stays within the budget,
    `memory_limit × (1 - margin)`, for the batch it was given, without
    running a step that would not fit. A size that was the whole of a
    smaller batch is searched again for a larger one. The peak is the
    model's own (its state, its batch, what its step allocates), not
    what other models in the process hold:

    - JAX: from the compiled step's memory analysis (XLA's buffer
      assignment: the state, the batch and the step's temporaries), for
      every new shape of batch before it runs;
    - TensorFlow (graph and XLA) and PyTorch on CUDA: from the allocator's
      peak over probe steps on the first batch at small sizes (above the
      bytes in use before each), extrapolated, then checked at the size
      chosen; the probes' updates are undone. TensorFlow's CPU allocator
      keeps figures only with `TF_CPU_ALLOCATOR_USE_BFC=true` set before
      TensorFlow is imported; without them "auto" is refused, naming it;
    - PyTorch on a CPU has no allocator figures: refused (give an int).

    Every size from 1 to the batch is a candidate, not only powers of 2.
    The chosen size and the peak it predicts are printed, once per choice,
    and kept in `model.micro_batch_choices`. If a step still runs out
    of memory (the backend's own error), the micro-batch shrinks and the
    batch is redone from its start (see `AccumModel`'s
    `micro_batch_size`). The sizes change nothing but memory and speed:
    every update equals `keras.Model`'s at the batch.

    Args:
        memory_limit: None, or an integer > 0: the bytes the step may use
            on one device, including the weights, the optimizer's state,
            the accumulators and the batch. None reads the device's
            memory: the accelerator's total on a GPU or TPU, the host's
            available memory (`MemAvailable`) on a CPU. Defaults to
            `None`.
        margin: Float in [0, 1). The share of `memory_limit` kept free for
            what the step's figures do not see (fragmentation, other
            processes, the framework's own buffers). Defaults to `0.1`.

    Example:

    ```python
    model = keras_accum.AccumModel(
        inputs, outputs,
        micro_batch_size=keras_accum.AutoMicroBatch(memory_limit=8 * 2**30),
    )
    model.fit(x, y, batch_size=1024)  # One update per 1024 samples.
    ```
    """

    memory_limit: int | None = None
    margin: float = 0.1

    def __post_init__(self) -> None:
        limit = self.memory_limit
        if limit is not None and (
            isinstance(limit, bool)
            or not isinstance(limit, numbers.Integral)
            or limit < 1
        ):
            raise ValueError(
                "`memory_limit` must be None or an integer number of bytes "
                f">= 1. Received: memory_limit={limit!r}"
            )
        margin = _number(
            "margin", self.margin, "a number in [0, 1)", (None, 1.0)
        )
        object.__setattr__(
            self, "memory_limit", None if limit is None else int(limit)
        )
        object.__setattr__(self, "margin", margin)

    def budget(self, memory_limit: int) -> int:
        """The bytes a step may use of `memory_limit`."""
        return int(memory_limit * (1.0 - self.margin))

    def get_config(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_config(cls, config: dict) -> AutoMicroBatch:
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


# The step computes the controller in float32 on every backend.
_FLOAT32 = np.finfo(np.float32)


def _float32_holds(checked: dict) -> None:
    """Refuses a float setting that float32 turns into another setting:
    `smoothing` rounded up to 1 (the averages would never move, and the
    controller never decide), `batch_fraction` rounded to 0 or inf."""
    smoothing = checked["smoothing"]
    if np.float32(smoothing) >= 1.0:
        largest = float(np.nextafter(np.float32(1), np.float32(0)))
        raise ValueError(
            "`smoothing` must be a number in [0, 1) that stays below 1 in "
            f"float32, at most {largest!r} (the controller runs in float32, "
            "where this value is 1.0: its averages would never move and "
            f"it would never decide). Received: smoothing={smoothing!r}"
        )
    fraction = checked["batch_fraction"]
    low, high = float(_FLOAT32.smallest_normal), float(_FLOAT32.max)
    if not low <= fraction <= high:
        raise ValueError(
            "`batch_fraction` must be a positive number that float32 "
            f"holds, from {low!r} to {high!r} (the controller runs in "
            "float32, where this value is 0 or inf). Received: "
            f"batch_fraction={fraction!r}"
        )


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
