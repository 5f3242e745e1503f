"""The window rules, written once, as pure functions of window values.

The rules: a window's first micro-batch overwrites what the last window
left in the accumulators, later ones add to them; a window closes when full
or at the epoch's last step; a closing window is divided by its normaliser
total and applied once, or skipped whole if not finite; sampled windows
estimate the gradient noise scale; closed windows are published for
`PseudoBatchLogger`. Here they are written with `keras.ops`, as functions
from window values to new window values, run whole by the two backends
whose steps are Python functions of values:

- JAX traces a stateless, jitted step that takes every value it needs as an
  argument and returns the new ones (a variable assigned inside it would
  leak a tracer), so the window's values travel with the training state
  (`_jax_trainer.py`);
- PyTorch runs its step eagerly: it reads the window's variables, applies
  these functions and writes the results back (`_torch_trainer.py`).

Each backend passes how to run the optimizer update (`close`'s `update`):
`jax.lax.cond` around a stateless apply, or a Python `if` around an
in-place one. The values rest in `keras.Variable`s between steps, which the
model does not track: `get_weights()` and weights files stay those of a
plain model. TensorFlow's stateful graph step (`_tf_window.py`) takes its
formulas from here (`next_window_length`, `is_complete`,
`micro_batch_count`, `window_divisor`, `noise_statistics`) but keeps its
own sequencing: it writes the accumulators in place inside conditionals
(less memory), and adds the direct apply for `accum_steps=1` and
`tf.distribute`'s per-replica sums. The micro-batch weighting is shared by
all three (`AccumModel._window_objective`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import keras
from keras import ops

from keras_accum._window_log import LOG_CAPACITY
from keras_accum._window_saving import SavedWindow

ACC_DTYPE = "float32"
# JAX computes in 32-bit integers unless x64 is enabled; PyTorch follows.
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


class WindowVariables(SavedWindow):
    """The accumulation state of one `AccumModel` on JAX or PyTorch.

    The attributes are those of `_tf_window.WindowState` that these steps
    use, with the same meaning. On PyTorch each holds its value; on JAX it
    does between steps, and during an epoch the values live in the
    training state (see `variables`).

    Attributes:
        acc_grads: One float32 accumulator per trainable variable.
        acc_normalizer, acc_loss, acc_samples, acc_grad_sq: The window's
            normaliser total, weighted loss, samples and sum of the
            micro-batches' squared gradient norms (noise scale only).
        mini_step, epoch_step, steps_per_epoch, window_length,
            target_length, skipped_windows: Counters, as on TensorFlow.
        log_loss, log_samples, log_update, log_micro, log_trace,
            log_grad_sq, log_count: The rings of closed windows that
            `PseudoBatchLogger` reads, as on TensorFlow (the noise-scale
            rings hold NaN where not estimated).
        close_hooks: Callables `hook(applied)` that the backend's step runs
            when a window closes (e.g. `AccumBatchNormalization`'s), as on
            TensorFlow; they update the model's own variables.
    """

    def __init__(self, trainable_variables, accum_steps: int, close_hooks=()):
        self.close_hooks = list(close_hooks)
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

    def read(self) -> WindowValues:
        """The variables' current values, by name."""
        return self.unpack([v.value for v in self.variables])

    def write(self, window: WindowValues) -> None:
        """Assigns new values (from `accumulate`, `close`) to the variables.

        A value that is still the variable's own (unchanged, or changed in
        place) is not copied.
        """
        for variable, value in zip(
            self.variables, self.pack(window), strict=True
        ):
            if value is not variable.value:
                variable.assign(value)


# -- Pure window maths ---------------------------------------------------------


def accumulate(
    window: WindowValues,
    grads,
    weight,
    normalizer,
    loss,
    samples,
    scheduled=None,
    noise_every: int = 0,
    add_to_accumulators=None,
) -> WindowValues:
    """Adds one micro-batch to the window; returns the new values.

    `scheduled`, if given, is the length a window starting now should have
    (an accumulation schedule of the update count); otherwise
    `target_length` is. With `noise_every` (the gradient noise scale, in
    every `noise_every`-th window; 0 for none), sampled windows also sum
    the micro-batches' squared gradient norms. `add_to_accumulators`
    (`add_to_accumulators(accs, grads, weight, starting)`, returning the new
    accumulators) replaces `add_weighted`, e.g. by its in-place form.
    """
    window = dict(window)
    starting = window["mini_step"] == 0
    window["window_length"] = next_window_length(window, scheduled)
    weight = ops.cast(weight, ACC_DTYPE)
    add = add_to_accumulators or add_weighted
    window["acc_grads"] = add(window["acc_grads"], grads, weight, starting)
    if noise_every:
        # Divided by the micro-batch's count (its loss normaliser, or its
        # samples where the loss sums), a weighted gradient is the
        # micro-batch's mean gradient g_j times its count n_j: this adds
        # n_j |g_j|².
        grads = [ops.cast(grad, ACC_DTYPE) for grad in grads]
        squares = (
            sum_of_squares(grads)
            * ops.square(weight)
            / micro_batch_count(normalizer, samples)
        )
        window["acc_grad_sq"] = window["acc_grad_sq"] + ops.where(
            _sampled(window, noise_every), squares, ops.zeros_like(squares)
        )
    for name, value in (
        ("acc_normalizer", normalizer),
        ("acc_loss", loss),
        ("acc_samples", samples),
    ):  # (`acc_grad_sq` above.)
        window[name] = window[name] + ops.cast(value, ACC_DTYPE)
    window["mini_step"] = window["mini_step"] + 1
    window["epoch_step"] = window["epoch_step"] + 1
    return window


def add_weighted(accs, grads, weight, starting):
    """The accumulators after adding `grads` times `weight`.

    A window's first micro-batch (`starting`) overwrites what the last
    window left, instead of adding to zeros: clearing them after an update
    would cost a pass over every accumulator.
    """
    new = []
    for acc, grad in zip(accs, grads, strict=True):
        value = ops.cast(grad, ACC_DTYPE) * weight
        new.append(ops.where(starting, value, acc + value))
    return new


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
    update: Callable[[Any, Callable[[], list]], Any],
    scales_loss: bool = False,
    noise_every: int = 0,
    loss_scale=1.0,
) -> WindowValues:
    """Applies and resets the window if `should_close`.

    Args:
        window: The window's values.
        should_close: Boolean scalar: close the window now.
        update: `update(go, gradients)` runs the optimizer on
            `gradients()` (the window's float32 mean gradient, one per
            trainable variable) where the boolean scalar `go` holds, and
            returns `optimizer.iterations` after it. The backend decides
            how: only the chosen branch may run, one apply per window.
        scales_loss: The optimizer is a `LossScaleOptimizer`: it gets a
            non-finite window too, skips it itself and lowers its scale,
            as for a large batch that overflowed. (The accumulators hold
            loss-scaled gradients; the scale changes only at an update, so
            one window's micro-batches share it.)
        noise_every: As for `accumulate`: sampled windows publish their
            noise-scale estimates, the others NaN.
        loss_scale: The loss scale the window's gradients carry (before
            this update changes it), taken out of the estimates.

    Returns:
        The new window values.
    """
    accs = window["acc_grads"]
    divisor = window_divisor(window["acc_normalizer"])
    finite = _all_finite(accs)
    has_samples = window["acc_samples"] > 0
    # A non-finite window is skipped whole, the optimizer's state included.
    go = ops.logical_and(should_close, has_samples)
    if not scales_loss:
        go = ops.logical_and(go, finite)

    nan = ops.convert_to_tensor(float("nan"), ACC_DTYPE)
    trace = grad_sq = nan
    if noise_every:
        # From the window as it closes, before the update.
        sampled = _sampled(window, noise_every)
        estimates = noise_statistics(window, loss_scale)
        trace, grad_sq = (ops.where(sampled, e, nan) for e in estimates)

    iterations = update(go, lambda: [acc / divisor for acc in accs])

    window = _publish(
        window,
        ops.logical_and(should_close, has_samples),
        window["acc_loss"] / divisor,
        iterations,
        trace,
        grad_sq,
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
    return window


def _sampled(window, noise_every):
    """Whether the open window estimates the noise scale.

    `log_count` stays put while a window is open (it moves when the window
    publishes), so every micro-batch of a window and its close agree, as
    on TensorFlow.
    """
    return window["log_count"] % noise_every == 0


# -- The formulas, shared with TensorFlow's stateful step (`_tf_window.py`) ----


def next_window_length(window, scheduled=None):
    """The open window's length after this micro-batch is added.

    Fixed when a window starts (`mini_step == 0`): `scheduled` (a schedule
    of the update count) if given, else `target_length`.
    """
    length = window["target_length"]
    if scheduled is not None:
        length = ops.cast(scheduled, window["window_length"].dtype)
    return ops.where(window["mini_step"] == 0, length, window["window_length"])


def micro_batch_count(normalizer, samples):
    """What a micro-batch's mean gradient averaged over: its loss
    normaliser, or its samples where the loss sums."""
    normalizer = ops.cast(normalizer, ACC_DTYPE)
    return ops.where(normalizer > 0, normalizer, ops.cast(samples, ACC_DTYPE))


def window_divisor(normalizer_total):
    """What the window's sum is divided by at the update.

    The window's normaliser total, whatever its sign: Keras divides a
    `"mean_with_sample_weight"` batch by its weight total, negative ones
    included. Sum reductions add no normaliser: their window is the plain
    sum. So is a window whose sample weights are all zero (its sum is zero,
    as Keras's `divide_no_nan` makes the large batch's loss).
    """
    return ops.where(
        normalizer_total != 0,
        normalizer_total,
        ops.ones_like(normalizer_total),
    )


def noise_statistics(window, loss_scale, squares_of=None):
    """The closing window's unbiased estimates of tr(Σ) and |G|².

    McCandlish et al. (2018), "An Empirical Model of Large-Batch Training",
    appendix A: with micro-batch mean gradients g_j of n_j samples (N in
    all, k micro-batches) and the window's mean gradient G_W,
    E[sum_j n_j |g_j|²] = N |G|² + k tr(Σ) and E[|G_W|²] = |G|² + tr(Σ)/N;
    solving the two gives the estimates. Equal micro-batches reduce it to
    their B_small = N / k, B_big = N form. NaN for a one-micro-batch window.
    `squares_of` sums the accumulators' squares (TensorFlow passes its
    XLA-friendly one).
    """
    squares_of = squares_of or sum_of_squares
    count = micro_batch_count(window["acc_normalizer"], window["acc_samples"])
    k = ops.cast(window["mini_step"], ACC_DTYPE)
    scale_sq = ops.square(ops.cast(loss_scale, ACC_DTYPE))
    window_sq = squares_of(window["acc_grads"]) / ops.square(count) / scale_sq
    micro_sq = window["acc_grad_sq"] / scale_sq
    trace = (micro_sq - count * window_sq) / (k - 1.0)
    grad_sq = window_sq - trace / count
    # The counts are the loss's units (timesteps, pixels, weight totals);
    # per sample, so that tr(Σ) / |G|² is a batch size.
    trace = trace * window["acc_samples"] / count
    enough = k >= 2.0
    nan = ops.full_like(trace, float("nan"))
    return ops.where(enough, trace, nan), ops.where(enough, grad_sq, nan)


def sum_of_squares(values):
    total = ops.zeros((), ACC_DTYPE)
    for value in values:
        total = total + ops.sum(ops.square(value))
    return total


def _publish(window, publish, loss, iterations, trace, grad_sq):
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
    for name, value in (
        ("log_loss", loss),
        ("log_samples", window["acc_samples"]),
        ("log_update", iterations),
        ("log_micro", window["mini_step"]),
        ("log_trace", trace),
        ("log_grad_sq", grad_sq),
    ):
        ring = window[name]
        window[name] = ops.where(slot, ops.cast(value, ring.dtype), ring)
    window["log_count"] = window["log_count"] + ops.cast(publish, COUNT_DTYPE)
    return window


def _all_finite(values):
    # Elementwise, as on TensorFlow: a sum of large finite values could
    # overflow and drop a valid window.
    if not values:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack([ops.all(ops.isfinite(v)) for v in values]))
