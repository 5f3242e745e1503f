"""The accumulation window, written once for the three backends.

A window is `accum_steps` micro-batches whose gradients add up to one
optimizer update. Its state is the accumulators (one per trainable weight)
and `Counters`, a typed tuple of scalars and logging rings; its rules are
pure functions of those values:

- `accumulate`: a micro-batch's gradient goes into the accumulators (a
  window's first micro-batch overwrites what the last window left, later
  ones add), and its share of the window's loss into the counters;
- `is_complete`: a window closes when full, or on the epoch's last step;
- `close`: a closing window is divided by its normalizer total and applied
  once, or skipped whole if not finite; sampled windows estimate the
  gradient noise scale, from which `accum_steps="auto"` sets the next
  windows' length (`_auto_rules.steer`); closed windows are published for
  `PseudoBatchLogger`.

Each backend supplies a `WindowOps`: how its accumulators are written (in
place on TensorFlow and PyTorch, as new values threaded through JAX's
stateless step), summed over replicas, and applied under a guard (a
`tf.cond`, a Python `if`, `jax.lax.cond`). The rules never touch an
accumulator except through it.

The variables (`WindowState`) are not tracked by the model: `get_weights()`
and weights files stay those of a plain model; the window saves itself
(`_window_saving.SavedWindow`). Under a `keras.distribution` (JAX), each
accumulator is laid out like its weight and the rest is replicated
(`layout_like`); where the batch axis spans several devices, each keeps
its own partial sum (`_jax_devices`).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import keras

from keras_accum import _auto_rules, _codecs, _compat, _rounding
from keras_accum import _scalar_ops as ops
from keras_accum._rounding import Draw
from keras_accum._window_fields import (
    ACC_DTYPE,
    BY_NAME,
    COUNT_DTYPE,
    FIELDS,
    RESETS,
    accumulator_key,
)
from keras_accum._window_log import LOG_CAPACITY
from keras_accum._window_saving import SavedWindow


class LogRings(NamedTuple):
    """The log of closed windows, read by `PseudoBatchLogger`
    (`_window_log`): rings of the last `LOG_CAPACITY` windows.

    Attributes:
        count: Windows published so far (the rings' write position).
        loss, samples, trace, grad_sq, update, micro, lr_scale: Each
            closed window's pseudo-batch loss, samples, estimates of
            tr(Σ) and |G|² (NaN where not estimated), `optimizer.iterations`
            after the update, micro-batches, and the factor on the
            learning rate (`_auto_rules.learning_rate`; 1 without one).
    """

    count: Any
    loss: Any
    samples: Any
    trace: Any
    grad_sq: Any
    update: Any
    micro: Any
    lr_scale: Any


class Controller(NamedTuple):
    """`accum_steps="auto"`'s state (`_auto_rules`); zeros without it.

    Attributes:
        trace, grad_sq: Moving averages of the windows' estimates of
            tr(Σ) and |G|².
        estimates: Windows measured since the length last changed.
        progress: `lr_scaling="adascale"`: the scale-invariant progress,
            the sum of the updates' gains.
    """

    trace: Any
    grad_sq: Any
    estimates: Any
    progress: Any


class Counters(NamedTuple):
    """The window's values besides its accumulators.

    The same tuple holds the variables (`WindowState.counters`) and, in a
    step, their values. Each field's dtype, shape, replica rule, reset and
    saving are declared in `_window_fields.FIELDS`, in the order of
    `flat()`; the log rings and the auto controller are nested groups,
    `log` and `auto`, as optax nests its optional states.

    Attributes:
        acc_normalizer: Sum of the window's loss normalizers (entries or
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
            `accum_steps`, what its schedule by epoch gives, or what
            `accum_steps="auto"` chose; a variable so that changing it
            does not retrace.
        skipped_windows: Windows dropped because their gradient was not
            finite.
        rounding_seed: The seed of the stochastic rounding's random bits
            (`accumulator_dtype="bfloat16"`; 0 without it).
        rounding_draws: Micro-batches added with stochastic rounding: the
            stream's position, each micro-batch's bits its own.
        log: The `LogRings`.
        auto: The `Controller`.
    """

    acc_normalizer: Any
    acc_loss: Any
    acc_samples: Any
    acc_grad_sq: Any
    mini_step: Any
    epoch: Any
    epoch_step: Any
    steps_per_epoch: Any
    window_length: Any
    target_length: Any
    skipped_windows: Any
    rounding_seed: Any
    rounding_draws: Any
    log: LogRings
    auto: Controller

    @classmethod
    def from_flat(cls, values) -> Counters:
        """The counters of `values` listed in `FIELDS`' order: `Counters`'
        own fields, then each group's (a test holds the two orders
        equal)."""
        values = tuple(values)
        if len(values) != len(FIELDS):
            raise ValueError(
                f"Expected {len(FIELDS)} counter values, got {len(values)}."
            )
        top = len(cls._fields) - len(_GROUPS)
        groups, start = [], top
        for group in _GROUPS.values():
            groups.append(group(*values[start : start + len(group._fields)]))
            start += len(group._fields)
        return cls(*values[:top], *groups)

    def flat(self) -> tuple:
        """Every value, in `FIELDS`' order (the inverse of `from_flat`)."""
        top = len(self._fields) - len(_GROUPS)
        flat = self[:top]
        for group in self[top:]:
            flat += tuple(group)
        return flat

    def get(self, name: str):
        """The value of the field `name` (a `Field.name`: `"mini_step"`,
        `"log_loss"`, `"auto_trace"`)."""
        field = BY_NAME[name]
        if field.group is None:
            return getattr(self, name)
        return getattr(getattr(self, field.group), field.attr)


# The nested groups, the last fields of `Counters`, in `GROUPS`' order.
_GROUPS = {"log": LogRings, "auto": Controller}


class Share(NamedTuple):
    """A micro-batch's share of its window.

    Attributes:
        weight: The factor its gradient still needs in the accumulators
            (1 where backpropagation already applied it).
        normalizer: What it adds to the window's divisor.
        loss: Its loss, weighted like its gradient, float32.
        samples: Its number of samples.
    """

    weight: Any
    normalizer: Any
    loss: Any
    samples: Any


class ClosePolicy(NamedTuple):
    """What a close does besides applying the window.

    Attributes:
        scales_loss: The optimizer is a `LossScaleOptimizer` (see `decide`).
        noise_every: Sampled windows (every `noise_every`-th) estimate the
            gradient noise scale; 0 for none.
        loss_scale: The scale the window's gradients carry, taken out of
            the estimates.
        auto: The `AutoAccumSteps` steering the window's length
            (`noise_every` is then 1); None for a length the model sets.
        optimizer: The optimizer whose learning rate `auto` may scale.
    """

    scales_loss: bool = False
    noise_every: int = 0
    loss_scale: Any = 1.0
    auto: Any = None
    optimizer: Any = None


class WindowOps(Protocol):
    """What a backend does with the accumulators, replicas and optimizer.

    The rules below call these, and nothing else touches an accumulator.
    `add`, `all_finite`, `sum_of_squares`, `gradients` and `apply` are what
    every backend provides; `before_add`, `reduce_sum` and `each` have
    working defaults for one device, which a backend overrides where it
    needs to (TensorFlow's XLA divide and replicas, in `_tf_window.py`).

    `close` may run where the counters hold every replica's values (in
    TensorFlow's cross-replica context): the stages that read them run
    through `each`, once per replica, and `reduce_sum` adds the replicas'
    totals up.
    """

    def before_add(self, added: Counters, complete) -> None:
        """Told, before `add`, the counters with the micro-batch in and
        whether it completes the window (a boolean scalar). Nothing by
        default."""

    def add(self, grads, weight, starting, sampled, draw=None):
        """Adds `grads` (times `weight`, unless None) to the accumulators.

        A window's first micro-batch (`starting`, a boolean scalar)
        overwrites them instead: clearing them after an update would cost
        a pass over every accumulator. Returns the sum of the squares of
        what it added where `sampled` (a boolean scalar) holds, zero
        elsewhere; None where `sampled` is None (no window estimates the
        noise scale). Each accumulator's codec (`_codecs`) encodes its
        sum, made in float32: a bfloat16 one rounds it stochastically with
        bits from `draw` (a `_rounding.Draw`; None where no codec
        `draws`), one weight at a time.
        """
        raise NotImplementedError

    def all_finite(self, closing=True):
        """Whether every accumulator is finite (a boolean scalar).

        Only a closing window's answer counts (`decide`): where `closing`
        (a boolean scalar) is false a backend may skip the pass over the
        accumulators and answer anything.
        """
        raise NotImplementedError

    def sum_of_squares(self, closing=True):
        """The sum of the accumulators' squares, as the window summed them.

        Only a closing, sampled window's answer counts (`noise_estimates`):
        where `closing` (a boolean scalar) is false a backend may skip the
        pass and answer anything.
        """
        raise NotImplementedError

    def gradients(self, divisor) -> list:
        """The window's gradient: each accumulator over `divisor`."""
        raise NotImplementedError

    def reduce_sum(self, value):
        """`value` summed over replicas; the identity on one."""
        return value

    def each(self, function, *args):
        """`function(*args)` on each replica, where the counters and
        accumulators are each replica's own (`args` as it sees them);
        once where there is one."""
        return function(*args)

    def apply(self, go, divisor):
        """Runs the optimizer on the window's gradient, `gradients(divisor)`,
        where `go` holds (only then: one apply per window); returns
        `optimizer.iterations` after it."""
        raise NotImplementedError


# -- Adding a micro-batch -----------------------------------------------------


class Plan(NamedTuple):
    """How a step adds its micro-batch (`accumulate`).

    Attributes:
        scheduled: The length a window starting now should have (a
            schedule of the update count); `target_length` if None.
        noise_every: Sampled windows (every `noise_every`-th) also sum the
            micro-batches' squared gradient norms; 0 for none.
        close_at_epoch_end: A window closes on the epoch's last step too
            (`partial_window="apply"`).
        rounds: Some accumulator's codec `draws`: the micro-batch takes a
            `Draw` of random bits for its stochastic rounding.
    """

    scheduled: Any = None
    noise_every: int = 0
    close_at_epoch_end: bool = True
    rounds: bool = False


def accumulate(
    counters: Counters, backend: WindowOps, grads, share: Share, plan: Plan
):
    """The window with one more micro-batch.

    Args:
        counters: The window's values.
        backend: The backend's operations; its accumulators receive `grads`,
            the micro-batch's gradients (one per trainable variable).
        grads: See `backend`.
        share: The micro-batch's share of the window.
        plan: How the step adds it.

    Returns:
        `(counters, complete)`: the counters with the micro-batch in (the
        accumulators are the backend's), and whether the window is now
        complete (`is_complete`).
    """
    starting = counters.mini_step == 0
    added = counters._replace(
        window_length=next_window_length(counters, plan.scheduled),
        acc_normalizer=counters.acc_normalizer + _float(share.normalizer),
        acc_loss=counters.acc_loss + _float(share.loss),
        acc_samples=counters.acc_samples + _float(share.samples),
        mini_step=counters.mini_step + 1,
        epoch_step=counters.epoch_step + 1,
    )
    draw = None
    if plan.rounds:
        added = added._replace(rounding_draws=counters.rounding_draws + 1)
        draw = Draw(counters.rounding_seed, added.rounding_draws)
    complete = is_complete(added, plan.close_at_epoch_end)
    sampled = is_sampled(counters, plan.noise_every)
    backend.before_add(added, complete)
    squares = backend.add(grads, share.weight, starting, sampled, draw)
    if squares is not None:
        # Divided by the micro-batch's count (its loss normalizer, or its
        # samples where the loss sums), a weighted gradient is the
        # micro-batch's mean gradient g_j times its count n_j: this adds
        # n_j |g_j|².
        count = micro_batch_count(share.normalizer, share.samples)
        added = added._replace(
            acc_grad_sq=counters.acc_grad_sq + squares / count
        )
    return added, complete


def next_window_length(counters: Counters, scheduled=None):
    """The open window's length once a micro-batch is added.

    Fixed when a window starts (`mini_step == 0`): `scheduled` (a schedule
    of the update count) if given, else `target_length`.
    """
    length = counters.target_length
    if scheduled is not None:
        length = ops.cast(scheduled, COUNT_DTYPE)
    return ops.where(counters.mini_step == 0, length, counters.window_length)


def is_complete(counters: Counters, close_at_epoch_end: bool):
    """Whether the window is full, or the epoch's last step was added."""
    complete = counters.mini_step >= counters.window_length
    if close_at_epoch_end:
        epoch_done = ops.logical_and(
            counters.steps_per_epoch > 0,
            counters.epoch_step >= counters.steps_per_epoch,
        )
        complete = ops.logical_or(complete, epoch_done)
    return complete


# -- Closing a window ---------------------------------------------------------


def close(
    counters: Counters,
    backend: WindowOps,
    should_close,
    policy: ClosePolicy,
):
    """Applies and resets the window if `should_close` (a boolean scalar).

    Returns:
        `(counters, applied)`: the new counters, and whether the optimizer
        applied the window (a boolean scalar).
    """
    totals = Totals.unpack(
        backend.reduce_sum(
            backend.each(local_totals, counters, backend, should_close)
        )
    )
    finite, go = decide(totals, should_close, policy.scales_loss)
    # From the window as it closes, before the update; each replica's own.
    # (`should_close` is known on the backends whose close is conditional.)
    closing = () if should_close is True else (should_close,)
    trace, grad_sq = backend.each(
        noise_estimates, counters, backend, policy, *closing
    )
    rate = None
    if policy.auto is not None:
        rate = _auto_rules.learning_rate(
            counters.auto, policy.auto, counters.mini_step, totals.samples
        )
    with _compat.learning_rate_scaled(policy.optimizer, rate):
        iterations = backend.apply(go, window_divisor(totals.normalizer))
    closed = Closed(totals, finite, iterations, trace, grad_sq)
    if policy.auto is not None:
        # The controller steers every replica alike, from their mean (under
        # `tf.distribute`, a second exchange of three scalars per update).
        trace_sum, grad_sq_sum, replicas = ops.unstack(
            backend.reduce_sum(backend.each(_packed, trace, grad_sq))
        )
        estimates = (trace_sum / replicas, grad_sq_sum / replicas)
        closed = closed._replace(
            steering=Steering(estimates, (rate, go), policy.auto)
        )
    return backend.each(finish, counters, closed, should_close), go


def _packed(trace, grad_sq):
    return ops.stack([trace, grad_sq, ops.ones_like(trace)])


class Steering(NamedTuple):
    """What `accum_steps="auto"` learns from a closing window.

    Attributes:
        estimates: `(trace, grad_sq)` averaged over replicas.
        rate: `(_auto_rules.Rate or None, applied)`.
        config: The `AutoAccumSteps`.
    """

    estimates: Any
    rate: Any
    config: Any


class Totals(NamedTuple):
    """A closing window's totals, summed over replicas.

    Attributes:
        normalizer: Its loss normalizers' sum, the update's divisor.
        loss: Its loss, weighted like the gradients.
        samples: Its samples.
        nonfinite: The replicas whose accumulators were not finite.
    """

    normalizer: Any
    loss: Any
    samples: Any
    nonfinite: Any

    @classmethod
    def unpack(cls, packed) -> Totals:
        """From `local_totals`' vector (packed for one exchange)."""
        return cls(*ops.unstack(packed))


def local_totals(counters: Counters, backend: WindowOps, closing=True):
    """`[normalizer, loss, samples, non-finite flag]` of the window here,
    packed as one vector (`Totals.unpack` names them).

    The flag counts only where `closing` holds (`WindowOps.all_finite`).

    On one device, the window's totals; under `tf.distribute`, this
    replica's, summed over replicas before `decide` (one packed exchange
    per update).
    """
    return ops.stack(
        [
            _float(counters.acc_normalizer),
            _float(counters.acc_loss),
            _float(counters.acc_samples),
            _float(ops.logical_not(backend.all_finite(closing))),
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
    finite = totals.nonfinite == 0.0
    go = ops.logical_and(should_close, totals.samples > 0)
    if not scales_loss:
        go = ops.logical_and(go, finite)
    return finite, go


class Closed(NamedTuple):
    """What a closing window publishes (`finish`).

    Attributes:
        totals: Its `Totals`.
        finite: Whether its gradient was finite.
        iterations: `optimizer.iterations` after the update, if any.
        trace, grad_sq: Its noise-scale estimates (NaN if none).
        micro_steps: Its micro-batches; None for `mini_step`.
        steering: A `Steering` under `accum_steps="auto"`, else None.
    """

    totals: Any
    finite: Any
    iterations: Any
    trace: Any
    grad_sq: Any
    micro_steps: Any = None
    steering: Any = None


def finish(counters: Counters, closed: Closed, should_close) -> Counters:
    """Counts, publishes and resets a window if `should_close`.

    Every closed window with samples is published, a skipped (non-finite)
    one included. The accumulators keep the closed window's sum: the next
    micro-batch overwrites them (see `WindowOps.add`).
    """
    totals = closed.totals
    publish = ops.logical_and(should_close, totals.samples > 0)
    micro_steps = closed.micro_steps
    if micro_steps is None:
        micro_steps = counters.mini_step
    steering = closed.steering
    rate = None if steering is None else steering.rate[0]
    changes = {
        "log": _published(
            counters.log,
            publish,
            loss=totals.loss / window_divisor(totals.normalizer),
            samples=totals.samples,
            update=closed.iterations,
            micro=micro_steps,
            trace=closed.trace,
            grad_sq=closed.grad_sq,
            lr_scale=1.0 if rate is None else rate.scale,
        )
    }
    skipped = ops.logical_and(publish, ops.logical_not(closed.finite))
    for name in RESETS:
        value = getattr(counters, name)
        if should_close is True:
            # Known when traced (an eager close, TensorFlow's conditional).
            changes[name] = ops.zeros_like(value)
        else:
            changes[name] = ops.where(
                should_close, ops.zeros_like(value), value
            )
    if steering is not None:
        changes["auto"], changes["target_length"] = _steered(
            counters, closed, publish, micro_steps
        )
    return counters._replace(
        skipped_windows=counters.skipped_windows
        + ops.cast(skipped, COUNT_DTYPE),
        **changes,
    )


def _published(log: LogRings, publish, **closed) -> LogRings:
    """The log with the `closed` window's values written at its position
    if `publish` (a boolean scalar), and the position moved on."""
    slot = ops.logical_and(
        ops.arange(LOG_CAPACITY, dtype=COUNT_DTYPE) == log.count % LOG_CAPACITY,
        publish,
    )
    rings = {}
    for name, value in closed.items():
        ring = getattr(log, name)
        rings[name] = ops.where(slot, ops.cast(value, ring.dtype), ring)
    return log._replace(
        count=log.count + ops.cast(publish, COUNT_DTYPE), **rings
    )


def _steered(counters: Counters, closed: Closed, publish, micro_steps):
    """`_auto_rules.steer`'s controller and target length after a window
    that published if `publish`."""
    steering = closed.steering
    trace, grad_sq = steering.estimates
    taken = ops.logical_and(
        publish,
        ops.logical_and(ops.isfinite(trace), ops.isfinite(grad_sq)),
    )
    # Every replica's samples (the totals'), per micro-batch.
    micro_batch = closed.totals.samples / ops.maximum(_float(micro_steps), 1.0)
    return _auto_rules.steer(
        counters.auto,
        counters.target_length,
        (trace, grad_sq, taken),
        (_float(micro_steps), ops.maximum(micro_batch, 1.0)),
        steering.rate,
        steering.config,
    )


# -- The formulas -------------------------------------------------------------


def micro_batch_count(normalizer, samples):
    """What a micro-batch's mean gradient averaged over: its loss
    normalizer, or its samples where the loss sums."""
    normalizer = _float(normalizer)
    return ops.where(normalizer > 0, normalizer, _float(samples))


def window_divisor(normalizer_total):
    """What the window's sum is divided by at the update.

    The window's normalizer total, whatever its sign: Keras divides a
    `"mean_with_sample_weight"` batch by its weight total, negative ones
    included. Sum reductions add no normalizer: their window is the plain
    sum. So is a window whose sample weights are all zero (its sum is zero,
    as Keras's `divide_no_nan` makes the large batch's loss).
    """
    return ops.where(
        normalizer_total != 0,
        normalizer_total,
        ops.ones_like(normalizer_total),
    )


def noise_estimates(
    counters: Counters, backend: WindowOps, policy: ClosePolicy, closing=True
):
    """`noise_statistics` in sampled windows, NaN in the others; only a
    `closing` window's count."""
    nan = ops.convert_to_tensor(float("nan"), ACC_DTYPE)
    sampled = is_sampled(counters, policy.noise_every)
    if sampled is None:
        return nan, nan
    if sampled is not True:
        closing = ops.logical_and(closing, sampled)
    estimates = noise_statistics(
        counters, backend.sum_of_squares(closing), policy.loss_scale
    )
    return tuple(ops.where(sampled, e, nan) for e in estimates)


def noise_statistics(
    counters: Counters, window_squares, loss_scale=1.0, replicas=1
):
    """The closing window's unbiased estimates of tr(Σ) and |G|².

    McCandlish et al. (2018), "An Empirical Model of Large-Batch Training",
    appendix A: with micro-batch mean gradients g_j of n_j samples (N in
    all, k micro-batches) and the window's mean gradient G_W,
    E[sum_j n_j |g_j|²] = N |G|² + k tr(Σ) and E[|G_W|²] = |G|² + tr(Σ)/N;
    solving the two gives the estimates. Equal micro-batches reduce it to
    their B_small = N / k, B_big = N form. NaN for a one-micro-batch window.
    `window_squares` is the sum of the accumulators' squares.
    """
    count = micro_batch_count(counters.acc_normalizer, counters.acc_samples)
    k = _float(counters.mini_step)
    scale_sq = ops.square(_float(loss_scale))
    window_sq = window_squares / ops.square(count) / scale_sq
    micro_sq = counters.acc_grad_sq / scale_sq
    trace = (micro_sq - count * window_sq) / (k - 1.0)
    grad_sq = window_sq - trace / count
    # The counts are the loss's units (timesteps, pixels, weight totals);
    # per sample, so that tr(Σ) / |G|² is a batch size.
    trace = trace * counters.acc_samples / count
    enough = k >= 2.0
    nan = ops.full_like(trace, float("nan"))
    return ops.where(enough, trace, nan), ops.where(enough, grad_sq, nan)


def sum_of_squares(values):
    total = ops.zeros((), ACC_DTYPE)
    for value in values:
        total = total + _codecs.codec_of(value.dtype).squares(value)
    return total


def sums_finite(values):
    """Whether the sum of all of `values` is finite (a boolean scalar).

    Then every value is: an inf or NaN stays in a sum. A sum of finite
    values may still overflow, so False asks for `all_finite`. One pass of
    sums costs far less than the elementwise test (PyTorch: a tenth, on
    the MLP of `benchmarks/bench_backends.py`).
    """
    if not values:
        return ops.convert_to_tensor(True)
    return ops.isfinite(sum_of(values))


def sum_of(values):
    total = ops.zeros((), ACC_DTYPE)
    for value in values:
        # A bfloat16 value summed as it is (float32's range): a finiteness
        # test, where a cast would cost a float32 copy.
        total = total + ops.cast(ops.sum(value), ACC_DTYPE)
    return total


def all_finite(values):
    # Elementwise: a sum of large finite values could overflow and drop a
    # valid window.
    if not values:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack([ops.all(ops.isfinite(v)) for v in values]))


def is_sampled(counters: Counters, noise_every: int):
    """Whether the open window estimates the noise scale; None where no
    window does (`noise_every` 0).

    `log.count` stays put while a window is open (it moves when the window
    publishes), so every micro-batch of a window and its close agree on
    it, with no state of its own.
    """
    if not noise_every:
        return None
    if noise_every == 1:
        return True  # Known when traced: no conditional to build.
    return counters.log.count % noise_every == 0


def _float(value):
    if isinstance(value, (int, float)):
        # A static count (a batch size from JAX's or PyTorch's shapes):
        # added to a float32 tensor it is rounded as a cast would be, and
        # costs no tensor on PyTorch's eager step.
        return float(value)
    return ops.cast(value, ACC_DTYPE)


# -- The state ----------------------------------------------------------------


def _plain_variable(name, shape, dtype, like=None):
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
        return _compat.variable_layout(like)
    return keras.distribution.TensorLayout(
        [None] * len(shape), distribution.device_mesh
    )


class WindowState(SavedWindow):
    """The accumulation state of one `AccumModel`: its variables.

    Attributes:
        acc_grads: One accumulator per trainable variable, holding the
            sum over the window of each micro-batch's gradient times its
            weight (its loss normalizer), as its codec stores it.
        codecs: Each accumulator's `_codecs.AccumulatorCodec`.
        rounds: Whether some codec `draws` random bits (rounds
            stochastically, as bfloat16 ones do): the window then has a
            `rounding_seed`.
        exact: Whether every codec is `exact` (float32).
        counters: A `Counters` of variables.
        close_hooks: Callables `hook(applied, closing)` of layers that
            follow the window (`AccumBatchNormalization`), with boolean
            scalars: whether the optimizer applied the window, and whether
            the window closed in this step. A backend calls them after the
            update decision of any step that may close a window; a hook
            has no effect unless `closing`.

    Args:
        trainable_variables: The model's trainable variables, in order.
        length: The first window's length.
        make_variable: `make_variable(name, shape, dtype, like)` creates
            one variable; `like` is the trainable variable an accumulator
            sums the gradients of (None for a counter).
        close_hooks: See the attribute.
        accumulator_dtype: The model's setting: None (float32
            accumulators) or a codec's name (`"bfloat16"`), for weights of
            at least `_codecs.SMALL_WEIGHT` elements.
    """

    def __init__(
        self,
        trainable_variables,
        length: int,
        make_variable=_plain_variable,
        close_hooks=(),
        accumulator_dtype=None,
    ) -> None:
        self.close_hooks = list(close_hooks)
        self.acc_grads, self.codecs = [], []
        for i, v in enumerate(trainable_variables):
            shape = tuple(v.shape)
            codec = _codecs.codec_for(shape, accumulator_dtype)
            self.codecs.append(codec)
            self.acc_grads.append(
                make_variable(accumulator_key(i), shape, codec.dtype, v)
            )
        self.counters = Counters.from_flat(
            make_variable(field.name, field.shape, field.dtype, None)
            for field in FIELDS
        )
        self.rounds = any(codec.draws for codec in self.codecs)
        self.exact = all(codec.exact for codec in self.codecs)
        self.counters.window_length.assign(length)
        self.counters.target_length.assign(length)
        if self.rounds:
            self.counters.rounding_seed.assign(_rounding.new_seed())

    @property
    def variables(self) -> list:
        """Every window variable: the accumulators, then the counters."""
        return [*self.acc_grads, *self.counters.flat()]

    def read(self) -> Counters:
        """The counters' values."""
        return Counters.from_flat(v.value for v in self.counters.flat())

    def unpack(self, values) -> tuple[list, Counters]:
        """`(accumulators, counters)` of values listed as `variables`."""
        count = len(self.acc_grads)
        return list(values[:count]), Counters.from_flat(values[count:])

    def pack(self, accumulators, counters: Counters) -> list:
        """The inverse of `unpack`."""
        return [*accumulators, *counters.flat()]

    def write_all(self, counters: Counters) -> None:
        """Assigns every counter given a new value."""
        for variable, value in zip(
            self.counters.flat(), counters.flat(), strict=True
        ):
            if value is not variable:
                variable.assign(value)

    def write(self, counters: Counters, read: Counters, assign=None) -> None:
        """Assigns the counters whose values are not those `read` gave,
        with `assign(variable, value)` if given (else `variable.assign`)."""
        for variable, value, before in zip(
            self.counters.flat(), counters.flat(), read.flat(), strict=True
        ):
            if value is before:
                continue
            if assign is None:
                variable.assign(value)
            else:
                assign(variable, value)
