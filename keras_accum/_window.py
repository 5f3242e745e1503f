"""The accumulation window, written once for the three backends.

A window is `accum_steps` micro-batches whose gradients add up to one
optimizer update. Its state is one structure (`WindowState`: the
accumulators, counters, totals and the logging rings, held in
`keras.Variable`s) and its rules are pure functions from the window's
values (`WindowValues`) to the values that change:

- `accumulate`: a window's first micro-batch overwrites what the last
  window left in the accumulators, later ones add to them, each weighted by
  its share of the window's loss;
- `is_complete`: a window closes when full, or on the epoch's last step;
- `close` (`local_totals`, `decide`, `window_gradients`, `finish`): a
  closing window is divided by its normaliser total and applied once, or
  skipped whole if not finite; sampled windows estimate the gradient noise
  scale; closed windows are published for `PseudoBatchLogger`.

Each backend's trainer runs these in its own idiom and holds only what
must differ: how the accumulators are written (in place on TensorFlow and
PyTorch, as new values threaded through JAX's stateless step), how the
optimizer update is guarded (`tf.cond`, a Python `if`, `jax.lax.cond`),
and, on TensorFlow, `tf.distribute`'s per-replica sums
(`_tf_window.py`).

The variables are not tracked by the model: `get_weights()` and weights
files stay those of a plain model; the window saves itself
(`_window_saving.SavedWindow`). Under a `keras.distribution` (JAX), each
accumulator is laid out like its weight and the rest is replicated
(`layout_like`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import keras
from keras import ops

from keras_accum._window_log import LOG_CAPACITY
from keras_accum._window_saving import SavedWindow

ACC_DTYPE = "float32"
# JAX computes in 32-bit integers unless x64 is enabled; PyTorch follows.
# TensorFlow's counters were int64 from the first release (and saved so).
COUNT_DTYPE = "int64" if keras.backend.backend() == "tensorflow" else "int32"

# The window's totals, reset when it closes.
FLOAT_SCALARS = ("acc_normalizer", "acc_loss", "acc_samples", "acc_grad_sq")
INT_SCALARS = (
    "mini_step",
    "epoch",
    "epoch_step",
    "steps_per_epoch",
    "window_length",
    "target_length",
    "skipped_windows",
    "log_count",
)
# What closed windows publish for `PseudoBatchLogger`: rings of
# `LOG_CAPACITY` entries, written at `log_count % LOG_CAPACITY`.
FLOAT_RINGS = ("log_loss", "log_samples", "log_trace", "log_grad_sq")
INT_RINGS = ("log_update", "log_micro")
# Every value besides the accumulators, in the order a flat state holds.
NAMES = FLOAT_SCALARS + INT_SCALARS + FLOAT_RINGS + INT_RINGS
# How `tf.distribute` reads a per-replica variable in cross-replica
# context: totals add up; counters and rings agree on every replica.
SUMMED = frozenset(("acc_grads", *FLOAT_SCALARS))


class WindowValues(Mapping):
    """The window's values, by name, as the rules see them.

    Fields: `acc_grads` (a list, one per trainable weight) and each name in
    `NAMES`. Values are read from a source on first access (TensorFlow
    reads variables only where a rule uses them: an unused read of an
    accumulator would still be ordered against its writes in the step);
    `replace` layers changes on top, and `changes` is what a backend writes
    back.
    """

    def __init__(
        self,
        read: Callable[[str], Any],
        changes: dict[str, Any] | None = None,
    ) -> None:
        self._read = read
        self.changes = dict(changes or {})

    @classmethod
    def of(cls, values: Mapping[str, Any]) -> WindowValues:
        """Values held in a mapping (JAX's traced values)."""
        return cls(values.__getitem__)

    def replace(self, **changes: Any) -> WindowValues:
        return WindowValues(self._read, {**self.changes, **changes})

    def __getitem__(self, name: str) -> Any:
        if name in self.changes:
            return self.changes[name]
        if name != "acc_grads" and name not in NAMES:
            raise KeyError(name)
        return self._read(name)

    def __iter__(self) -> Iterator[str]:
        return iter(("acc_grads", *NAMES))

    def __len__(self) -> int:
        return 1 + len(NAMES)


def _plain_variable(name, shape, dtype, summed, like=None):
    del summed  # No replicas to aggregate: one device, or one JAX array.
    kwargs = {}
    layout = layout_like(like, shape)
    if layout is not None:
        kwargs["layout"] = layout
    return keras.Variable(
        initializer="zeros",
        shape=shape,
        dtype=dtype,
        trainable=False,
        name=name,
        **kwargs,
    )


def layout_like(like, shape):
    """The layout of a window variable under a `keras.distribution`.

    An accumulator (`like`: its weight) takes its weight's layout, as
    Keras's optimizer gives its slots (`add_variable_from_reference`):
    under `ModelParallel` each device holds the accumulator's shard of
    the weight's shard, not the whole weight. The other variables
    (`like=None`) are replicated, whatever the `LayoutMap` says of their
    names. None without a distribution.
    """
    distribution = keras.distribution.distribution()
    if distribution is None:
        return None
    if like is not None:
        # None for a weight created before the distribution was set: the
        # accumulator then gets the distribution's layout for its own
        # path, as the optimizer's slot does.
        return getattr(like, "_layout", None)
    return keras.distribution.TensorLayout(
        [None] * len(shape), distribution.device_mesh
    )


class WindowState(SavedWindow):
    """The accumulation state of one `AccumModel`.

    Attributes:
        acc_grads: One float32 accumulator per trainable variable, holding
            the sum over the window of each micro-batch's gradient times
            its weight (its loss normaliser).
        acc_normalizer: Sum of the window's loss normalisers (entries or
            sample-weight total), the divisor at the update.
        acc_loss: The window's loss so far, weighted like the gradients.
        acc_samples: Samples in the window so far.
        acc_grad_sq: Sum over the window of each micro-batch's squared
            mean-gradient norm times its count (noise scale only).
        mini_step: Micro-batches added to the open window; 0 between
            windows.
        epoch: The `fit` epoch the state belongs to: the epoch in
            progress, or once an epoch has ended the next one. Saved with
            the window, it tells a restart which epoch the saved weights
            belong to (`_window_epochs.WindowResume`).
        epoch_step: Micro-batches seen in the current epoch, to close a
            partial window on the epoch's last step; 0 between epochs.
        steps_per_epoch: Steps in the current `fit` epoch, 0 if unknown.
        window_length: The open window's length, fixed when it starts.
        target_length: The length of windows starting from now:
            `accum_steps`, or what its schedule by epoch gives; a variable
            so that changing it does not retrace.
        skipped_windows: Windows dropped because their gradient was not
            finite.
        log_count: Windows published so far (the rings' write position).
        log_loss, log_samples, log_update, log_micro, log_trace,
            log_grad_sq: Rings of the last `LOG_CAPACITY` closed windows'
            pseudo-batch loss, samples, `optimizer.iterations` after the
            update, micro-batches, and estimates of tr(Σ) and |G|² (NaN
            where not estimated).
        close_hooks: Callables `hook(applied, closing)` of layers that
            follow the window (`AccumBatchNormalization`), with boolean
            scalars: whether the optimizer applied the window, and whether
            the window closed in this step. A backend calls them after the
            update decision of any step that may close a window; a hook
            has no effect unless `closing`.

    Args:
        trainable_variables: The model's trainable variables, in order.
        length: The first window's length.
        make_variable: `make_variable(name, shape, dtype, summed, like)`
            creates one variable; `summed` says whether replicas' copies
            add up (TensorFlow creates per-replica variables with it);
            `like` is the trainable variable an accumulator sums the
            gradients of, whose layout it takes under a
            `keras.distribution` (JAX), and None for the other variables.
        close_hooks: See the attribute.
    """

    def __init__(
        self,
        trainable_variables,
        length: int,
        make_variable=_plain_variable,
        close_hooks=(),
    ) -> None:
        self.close_hooks = list(close_hooks)
        self.acc_grads = [
            make_variable(f"acc_grad_{i}", tuple(v.shape), ACC_DTYPE, True, v)
            for i, v in enumerate(trainable_variables)
        ]
        for names, shape, dtype in (
            (FLOAT_SCALARS, (), ACC_DTYPE),
            (INT_SCALARS, (), COUNT_DTYPE),
            (FLOAT_RINGS, (LOG_CAPACITY,), ACC_DTYPE),
            (INT_RINGS, (LOG_CAPACITY,), COUNT_DTYPE),
        ):
            for name in names:
                variable = make_variable(
                    name, shape, dtype, name in SUMMED, None
                )
                setattr(self, name, variable)
        self.window_length.assign(length)
        self.target_length.assign(length)

    @property
    def variables(self) -> list:
        """Every window variable, in the order a flat state holds them."""
        return [*self.acc_grads, *(getattr(self, n) for n in NAMES)]

    def values(self) -> WindowValues:
        """The variables' values, each read when a rule first uses it."""

        def read(name):
            if name == "acc_grads":
                return [acc.value for acc in self.acc_grads]
            return getattr(self, name).value

        return WindowValues(read)

    def unpack(self, flat) -> WindowValues:
        """Values given flat, in the order of `variables` (JAX's state)."""
        count = len(self.acc_grads)
        values = dict(zip(NAMES, flat[count:], strict=True))
        values["acc_grads"] = list(flat[:count])
        return WindowValues.of(values)

    def pack(self, window: WindowValues) -> list:
        """The inverse of `unpack`."""
        return [*window["acc_grads"], *(window[n] for n in NAMES)]

    def write(self, window: WindowValues) -> None:
        """Assigns the values that changed (`window.changes`).

        Accumulators written in place (the same tensor as the variable's,
        or `None`) are not copied.
        """
        for name, value in window.changes.items():
            if name == "acc_grads":
                if value is None:
                    continue
                for acc, new in zip(self.acc_grads, value, strict=True):
                    if new is not acc.value:
                        acc.assign(new)
                continue
            variable = getattr(self, name)
            if value is not variable.value:
                variable.assign(value)


# -- Adding a micro-batch -----------------------------------------------------


def accumulate(
    window: WindowValues,
    grads,
    weight,
    normalizer,
    loss,
    samples,
    scheduled=None,
    noise_every: int = 0,
    add=None,
) -> WindowValues:
    """Adds one micro-batch to the window.

    Args:
        window: The window's values.
        grads: The micro-batch's gradients, one per trainable variable (the
            backend may pass `None` for a variable the loss never reached,
            if its `add` handles it).
        weight: The micro-batch's weight in the window.
        normalizer: What it adds to the window's divisor.
        loss: Its weighted loss (float32), for the pseudo-batch loss.
        samples: Its number of samples.
        scheduled: The length a window starting now should have (a
            schedule of the update count); `target_length` if None.
        noise_every: Sampled windows (every `noise_every`-th) also sum the
            micro-batches' squared gradient norms; 0 for none.
        add: `add(window, grads, weight, starting, measure)` adds the
            weighted gradients to the accumulators and returns `(new
            accumulators or None if written in place, sum of the squares
            of what it added where `measure` holds)`; `measure` is a
            boolean scalar, or None when nothing is measured. Defaults to
            `add_weighted`.

    Returns:
        The window's values with this micro-batch in.
    """
    starting = window["mini_step"] == 0
    length = next_window_length(window, scheduled)
    weight = ops.cast(weight, ACC_DTYPE)
    measure = is_sampled(window, noise_every) if noise_every else None
    accs, squares = (add or add_weighted)(
        window, grads, weight, starting, measure
    )
    changes = {"window_length": length}
    if accs is not None:  # None: written in place.
        changes["acc_grads"] = accs
    if noise_every:
        # Divided by the micro-batch's count (its loss normaliser, or its
        # samples where the loss sums), a weighted gradient is the
        # micro-batch's mean gradient g_j times its count n_j: this adds
        # n_j |g_j|².
        changes["acc_grad_sq"] = window["acc_grad_sq"] + squares / (
            micro_batch_count(normalizer, samples)
        )
    for name, value in (
        ("acc_normalizer", normalizer),
        ("acc_loss", loss),
        ("acc_samples", samples),
    ):
        changes[name] = window[name] + ops.cast(value, ACC_DTYPE)
    changes["mini_step"] = window["mini_step"] + 1
    changes["epoch_step"] = window["epoch_step"] + 1
    return window.replace(**changes)


def add_weighted(window, grads, weight, starting, measure):
    """New accumulators: `grads` times `weight` added (`accumulate`'s `add`).

    A window's first micro-batch (`starting`) overwrites what the last
    window left, instead of adding to zeros: clearing them after an update
    would cost a pass over every accumulator.
    """
    new, products = [], []
    for acc, grad in zip(window["acc_grads"], grads, strict=True):
        value = ops.cast(grad, ACC_DTYPE) * weight
        products.append(value)
        new.append(ops.where(starting, value, acc + value))
    if measure is None:
        return new, None
    squares = sum_of_squares(products)
    return new, ops.where(measure, squares, ops.zeros_like(squares))


def next_window_length(window, scheduled=None):
    """The open window's length after this micro-batch is added.

    Fixed when a window starts (`mini_step == 0`): `scheduled` (a schedule
    of the update count) if given, else `target_length`.
    """
    length = window["target_length"]
    if scheduled is not None:
        length = ops.cast(scheduled, COUNT_DTYPE)
    return ops.where(window["mini_step"] == 0, length, window["window_length"])


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


# -- Closing a window ---------------------------------------------------------


def close(
    window: WindowValues,
    should_close,
    update: Callable[[Any, Callable[[], list]], Any],
    scales_loss: bool = False,
    noise_every: int = 0,
    loss_scale=1.0,
    reduce_totals=None,
    estimate_noise=None,
    divide=None,
):
    """Applies and resets the window if `should_close`.

    Args:
        window: The window's values.
        should_close: Boolean scalar: close the window now.
        update: `update(go, gradients)` runs the optimizer on
            `gradients()` (the window's float32 mean gradient, one per
            trainable variable) where the boolean scalar `go` holds, and
            returns `optimizer.iterations` after it. The backend decides
            how: only the chosen branch may run, one apply per window.
        scales_loss: The optimizer is a `LossScaleOptimizer` (see
            `decide`).
        noise_every: As for `accumulate`: sampled windows publish their
            noise-scale estimates, the others NaN.
        loss_scale: The loss scale the window's gradients carry (before
            this update changes it), taken out of the estimates.
        reduce_totals: Sums `local_totals` over replicas (TensorFlow under
            `tf.distribute`); identity by default.
        estimate_noise: `estimate_noise(window, totals)` returns the
            estimates `(trace, grad_sq)` (NaN where not sampled); defaults
            to `noise_estimates`.
        divide: As for `window_gradients`.

    Returns:
        `(new window values, applied)`: `applied` is the boolean scalar
        `go` that `update` got.
    """
    totals = local_totals(window)
    if reduce_totals is not None:
        totals = reduce_totals(totals)
    finite, go = decide(totals, should_close, scales_loss)
    # From the window as it closes, before the update.
    if estimate_noise is not None:
        trace, grad_sq = estimate_noise(window, totals)
    else:
        trace, grad_sq = noise_estimates(window, noise_every, loss_scale)
    iterations = update(go, lambda: window_gradients(window, totals, divide))
    window = finish(
        window, totals, finite, should_close, iterations, trace, grad_sq
    )
    return window, go


def local_totals(window: WindowValues):
    """`[normaliser, loss, samples, non-finite flag]` of the window here.

    On one device, the window's totals; under `tf.distribute`, this
    replica's, summed over replicas before `decide` (one packed exchange
    per update).
    """
    return ops.stack(
        [
            window["acc_normalizer"],
            window["acc_loss"],
            window["acc_samples"],
            ops.cast(
                ops.logical_not(all_finite(window["acc_grads"])), ACC_DTYPE
            ),
        ]
    )


def decide(totals, should_close=True, scales_loss: bool = False):
    """`(finite, go)`: whether the window's gradient is finite, and whether
    the optimizer applies it.

    A window without samples (Keras 3.15 runs a step on no data when a
    dataset is empty) applies nothing. A non-finite window is skipped whole,
    the optimizer's state included, except under a `LossScaleOptimizer`
    (`scales_loss`): it gets the non-finite window, skips it itself and
    lowers its scale, as for a large batch that overflowed. (The
    accumulators hold loss-scaled gradients; the scale changes only at an
    update, so one window's micro-batches share it.)
    """
    finite = totals[3] == 0.0
    go = ops.logical_and(should_close, totals[2] > 0)
    if not scales_loss:
        go = ops.logical_and(go, finite)
    return finite, go


def window_gradients(window: WindowValues, totals, divide=None) -> list:
    """The window's gradient: the accumulators over the normaliser total.

    Under `tf.distribute`, this replica's share; the optimizer's
    all-reduce sums the shares into the window's mean over all replicas.
    `divide(accumulators, divisor)` replaces the division, e.g. by one in
    place that hands the accumulators themselves to the optimizer (no
    gradient-sized buffer besides them).
    """
    divisor = window_divisor(totals[0])
    if divide is not None:
        return divide(window["acc_grads"], divisor)
    return [acc / divisor for acc in window["acc_grads"]]


def finish(
    window: WindowValues,
    totals,
    finite,
    should_close,
    iterations,
    trace,
    grad_sq,
    micro_steps=None,
) -> WindowValues:
    """Counts, publishes and resets a window if `should_close`.

    `iterations` is `optimizer.iterations` after the update, if any;
    `micro_steps` the window's micro-batches (`mini_step` by default).
    Every closed window with samples is published, a skipped (non-finite)
    one included. The accumulators keep the closed window's sum: the next
    micro-batch overwrites them (see `accumulate`).
    """
    has_samples = totals[2] > 0
    publish = ops.logical_and(should_close, has_samples)
    if micro_steps is None:
        micro_steps = window["mini_step"]
    changes = {}
    slot = ops.logical_and(
        ops.arange(LOG_CAPACITY, dtype=COUNT_DTYPE)
        == window["log_count"] % LOG_CAPACITY,
        publish,
    )
    for name, value in (
        ("log_loss", totals[1] / window_divisor(totals[0])),
        ("log_samples", totals[2]),
        ("log_update", iterations),
        ("log_micro", micro_steps),
        ("log_trace", trace),
        ("log_grad_sq", grad_sq),
    ):
        ring = window[name]
        changes[name] = ops.where(slot, ops.cast(value, ring.dtype), ring)
    changes["log_count"] = window["log_count"] + ops.cast(publish, COUNT_DTYPE)
    skipped = ops.logical_and(publish, ops.logical_not(finite))
    changes["skipped_windows"] = window["skipped_windows"] + ops.cast(
        skipped, COUNT_DTYPE
    )
    for name in (*FLOAT_SCALARS, "mini_step"):
        value = window[name]
        changes[name] = ops.where(should_close, ops.zeros_like(value), value)
    return window.replace(**changes)


# -- The formulas -------------------------------------------------------------


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


def noise_estimates(window, noise_every, loss_scale, squares_of=None):
    """`noise_statistics` in sampled windows, NaN in the others."""
    nan = ops.convert_to_tensor(float("nan"), ACC_DTYPE)
    if not noise_every:
        return nan, nan
    sampled = is_sampled(window, noise_every)
    estimates = noise_statistics(window, loss_scale, squares_of)
    return tuple(ops.where(sampled, e, nan) for e in estimates)


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


def all_finite(values):
    # Elementwise: a sum of large finite values could overflow and drop a
    # valid window.
    if not values:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack([ops.all(ops.isfinite(v)) for v in values]))


def is_sampled(window, noise_every):
    """Whether the open window estimates the noise scale.

    `log_count` stays put while a window is open (it moves when the window
    publishes), so every micro-batch of a window and its close agree on
    it, with no state of its own.
    """
    return window["log_count"] % noise_every == 0
