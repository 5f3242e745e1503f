"""TensorFlow-specific window state: accumulators, counters, the apply.

Everything here runs inside the compiled train step. The state lives in
`keras.Variable`s created once, before the step is traced, so a window's
progress survives across `fit` calls and never causes a retrace.

Under `tf.distribute` every variable here is per replica (`ON_READ`):
micro-steps touch only local memory and nothing crosses devices until
the optimizer's own all-reduce, once per window.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer

from keras_accum import _window_rules
from keras_accum._window_log import LOG_CAPACITY
from keras_accum._window_saving import SavedWindow

ACC_DTYPE = "float32"


def _state_variable(name, shape, dtype, aggregation):
    return keras.Variable(
        initializer="zeros",
        shape=shape,
        dtype=dtype,
        trainable=False,
        # Per-replica copies: reading one in cross-replica context
        # aggregates, writing one in replica context stays local.
        synchronization="on_read",
        aggregation=aggregation,
        name=name,
    )


class WindowState(SavedWindow):
    """The accumulation state of one `AccumModel`.

    Attributes:
        acc_grads: One float32 accumulator per trainable variable, holding
            the sum over the window of each micro-batch's gradient times
            its loss normaliser.
        acc_normalizer: Sum of the window's loss normalisers (samples or
            sample-weight total), the divisor at apply time.
        mini_step: Micro-batches added to the current window so far.
        epoch_step: Micro-batches seen in the current epoch, to close a
            partial window on the epoch's last step.
        steps_per_epoch: Steps in the current `fit` epoch, 0 if unknown.
        window_length: The open window's length, fixed when it starts.
        target_length: The length of windows starting from now:
            `accum_steps`, or what its schedule by epoch gives; a variable
            so that changing it does not retrace.
        skipped_windows: Windows dropped because their gradient was not
            finite.
        acc_loss: The window's loss so far, weighted like the gradients.
        acc_samples: Samples in the window so far.
        log_loss, log_samples, log_update: A ring of the last
            `LOG_CAPACITY` updates' pseudo-batch loss, sample count and
            `optimizer.iterations` after the update, published in the graph
            for `PseudoBatchLogger`.
        log_count: Updates published so far (the ring's write position).
        acc_grad_sq: Sum over the window of each micro-batch's squared
            mean-gradient norm times its normaliser (noise scale only).
        log_micro, log_trace, log_grad_sq: Rings of each update's number
            of micro-batches and its estimates of tr(Σ) and |G|² (NaN
            where not estimated), published with the loss.
        noise_every: Estimate the noise scale in every `noise_every`-th
            published window (those whose `log_count` it divides); 0 for
            none. Fixed per trace.
        xla: Whether the step compiles with XLA. Fixed per trace.
        close_hooks: Callables `hook(applied)` run when a window closes,
            inside the step (e.g. `AccumBatchNormalization`).
    """

    def __init__(
        self, trainable_variables, accum_steps, strategy, close_hooks=()
    ):
        self.noise_every = 0
        self.xla = False
        self.close_hooks = list(close_hooks)
        with strategy.scope():
            self.acc_grads = [
                _state_variable(
                    f"acc_grad_{i}", tuple(v.shape), ACC_DTYPE, "sum"
                )
                for i, v in enumerate(trainable_variables)
            ]
            self.acc_normalizer = _state_variable(
                "acc_normalizer", (), ACC_DTYPE, "sum"
            )
            self.acc_loss = _state_variable("acc_loss", (), ACC_DTYPE, "sum")
            self.acc_samples = _state_variable(
                "acc_samples", (), ACC_DTYPE, "sum"
            )
            # Counters agree on every replica; read the first one.
            first = "only_first_replica"
            self.mini_step = _state_variable("mini_step", (), "int64", first)
            self.epoch_step = _state_variable("epoch_step", (), "int64", first)
            self.steps_per_epoch = _state_variable(
                "steps_per_epoch", (), "int64", first
            )
            self.window_length = _state_variable(
                "window_length", (), "int64", first
            )
            self.target_length = _state_variable(
                "target_length", (), "int64", first
            )
            self.acc_grad_sq = _state_variable(
                "acc_grad_sq", (), ACC_DTYPE, "sum"
            )
            self.skipped_windows = _state_variable(
                "skipped_windows", (), "int64", first
            )
            self.log_loss = _state_variable(
                "log_loss", (LOG_CAPACITY,), ACC_DTYPE, first
            )
            self.log_samples = _state_variable(
                "log_samples", (LOG_CAPACITY,), ACC_DTYPE, first
            )
            self.log_update = _state_variable(
                "log_update", (LOG_CAPACITY,), "int64", first
            )
            self.log_count = _state_variable("log_count", (), "int64", first)
            self.log_micro = _state_variable(
                "log_micro", (LOG_CAPACITY,), "int64", first
            )
            self.log_trace = _state_variable(
                "log_trace", (LOG_CAPACITY,), ACC_DTYPE, first
            )
            self.log_grad_sq = _state_variable(
                "log_grad_sq", (LOG_CAPACITY,), ACC_DTYPE, first
            )
        self.window_length.assign(accum_steps)
        self.target_length.assign(accum_steps)

    # -- Inside the train step (replica context) ---------------------------

    def accumulate(
        self, grads, weight, normalizer, loss, samples, scheduled=None
    ):
        """Adds one micro-batch to the window.

        `scheduled`, if given, is the length a window starting now should
        have (an accumulation schedule of the update count); otherwise
        `target_length` is.
        """
        # (The step runs this under control dependencies on the micro-batch,
        # its loss and its gradients: see `AccumModel.train_step`.)
        starting = tf.equal(self.mini_step.value, 0)
        self.window_length.assign(
            _window_rules.next_window_length(self._values(), scheduled)
        )
        weight = tf.cast(weight, ACC_DTYPE)
        pairs = []
        for acc, grad in zip(self.acc_grads, grads, strict=True):
            if grad is None:
                continue
            # Embedding gradients (`IndexedSlices`) densify here: the
            # accumulator is dense anyway.
            grad = tf.cast(tf.convert_to_tensor(grad), ACC_DTYPE)
            pairs.append((acc, grad))

        # A window's first micro-batch overwrites the accumulators instead
        # of adding to zeros: clearing them after an update would allocate
        # a fresh zero buffer per accumulator. The products are formed in
        # the branches, one at a time, not all at once before them.
        def add(overwrite, measure):
            def branch():
                values = []
                for acc, grad in pairs:
                    value = grad * weight
                    if overwrite:
                        acc.assign(value)
                    else:
                        acc.assign_add(value)
                    values.append(value)
                if not measure:
                    return tf.zeros((), ACC_DTYPE)
                return _sum_of_squares(values, self.xla)

            return branch

        def accumulate(measure):
            return lambda: tf.cond(
                starting, add(True, measure), add(False, measure)
            )

        if not self.noise_every:
            accumulate(False)()
        else:
            # The squares of what the window adds. Without XLA they are
            # summed in the branches, where each product is still at hand
            # and nothing else holds the gradients (which would keep
            # TensorFlow from reusing their buffers). Under XLA, nesting
            # the accumulators' writes in one more conditional cost more
            # (measured), so there the sum reads the gradients beside them.
            if self.xla:
                accumulate(False)()
                grads = [grad for _, grad in pairs]
                squares = self._when_sampled(
                    lambda: _sum_of_squares(grads, True) * tf.square(weight),
                    lambda: tf.zeros((), ACC_DTYPE),
                )
            else:
                squares = self._when_sampled(
                    accumulate(True), accumulate(False)
                )
            # Divided by the micro-batch's count (its loss normaliser, or
            # its samples where the loss sums), a product is the
            # micro-batch's mean gradient g_j times its count n_j: this
            # adds n_j |g_j|².
            self.acc_grad_sq.assign_add(
                squares / _window_rules.micro_batch_count(normalizer, samples)
            )
        self.acc_normalizer.assign_add(tf.cast(normalizer, ACC_DTYPE))
        self.acc_loss.assign_add(tf.cast(loss, ACC_DTYPE))
        self.acc_samples.assign_add(tf.cast(samples, ACC_DTYPE))
        self.mini_step.assign_add(1)
        self.epoch_step.assign_add(1)

    def window_is_complete(self, close_at_epoch_end):
        return _window_rules.is_complete(self._values(), close_at_epoch_end)

    def maybe_apply(self, optimizer, variables, should_apply, none_grads):
        """Applies the window once if `should_apply`, in any replica context.

        An optimizer apply calls `merge_call` under most strategies, which
        may not sit inside a per-replica `tf.cond`; there the conditionals
        move to cross-replica context, as in Keras's `LossScaleOptimizer`.
        Either way the replicas exchange one packed vector of window totals
        per update, besides the optimizer's own gradient all-reduce, and
        nothing per micro-step.
        """
        if (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.cond(
                should_apply,
                lambda: self._apply(optimizer, variables, none_grads),
                _nothing,
            )
            return

        def cross_replica(distribution, should_apply):
            # Every replica counts the same micro-steps: take the first.
            flag = distribution.experimental_local_results(should_apply)[0]
            call = distribution.extended.call_for_each_replica

            def apply_window():
                totals = distribution.reduce(
                    tf.distribute.ReduceOp.SUM,
                    call(self._local_totals),
                    axis=None,
                )
                finite, go = _decide(totals, optimizer)
                grads = call(
                    self._window_gradients,
                    args=(totals, variables, optimizer),
                )

                def apply_on_each_replica():
                    call(
                        _apply_gradients,
                        args=(optimizer, grads, variables, none_grads),
                    )

                tf.cond(go, apply_on_each_replica, _nothing)
                call(self._finish, args=(totals, finite, go, optimizer))

            tf.cond(flag, apply_window, _nothing)

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(should_apply,)
        )

    # -- One-micro-batch windows (accum_steps=1) ----------------------------

    def supports_direct_apply(self):
        # Its conditional holds an optimizer apply: fine where the strategy
        # needs no merge_call.
        return (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        )

    def is_direct(self):
        return tf.logical_and(
            tf.equal(self.target_length.value, 1),
            tf.equal(self.mini_step.value, 0),
        )

    def apply_direct(
        self,
        optimizer,
        variables,
        grads,
        none_grads,
        normalizer,
        loss,
        samples,
    ):
        """Applies a one-micro-batch window straight from its gradient.

        The same as accumulating and dividing, (g * n) / n, without the
        accumulator traffic: what `accum_steps=1` costs a plain step is the
        finiteness check and the published loss.
        """
        # What the accumulators would hold: an embedding's repeated rows
        # summed (see `_true_gradient`). Checked after summing, so a sum
        # that overflows is caught as the accumulated window's would be.
        grads = [None if g is None else _true_gradient(g) for g in grads]
        dense = [
            g.values if isinstance(g, tf.IndexedSlices) else g
            for g in grads
            if g is not None
        ]
        local = tf.stack(
            [
                tf.cast(normalizer, ACC_DTYPE),
                tf.cast(loss, ACC_DTYPE),
                tf.cast(samples, ACC_DTYPE),
                tf.cast(tf.logical_not(_all_finite(dense)), ACC_DTYPE),
            ]
        )
        totals = _all_reduce_sum(local)
        finite, go = _decide(totals, optimizer)
        grads = [
            tf.zeros_like(v) if g is None else g
            for g, v in zip(grads, variables, strict=True)
        ]
        tf.cond(
            go,
            lambda: _apply_gradients(optimizer, grads, variables, none_grads),
            _nothing,
        )
        self.epoch_step.assign_add(1)
        self.window_length.assign(1)
        # One micro-batch: no noise-scale estimate (it needs two).
        self._finish(totals, finite, go, optimizer, micro_steps=1)
        return None

    def _apply(self, optimizer, variables, none_grads):
        totals = _all_reduce_sum(self._local_totals())
        finite, go = _decide(totals, optimizer)
        grads = self._window_gradients(totals, variables, optimizer)

        tf.cond(
            go,
            lambda: _apply_gradients(optimizer, grads, variables, none_grads),
            _nothing,
        )
        self._finish(totals, finite, go, optimizer)

    def _local_totals(self):
        """This replica's [normaliser, loss, samples, non-finite flag]."""
        grads_finite = _all_finite([acc.value for acc in self.acc_grads])
        return tf.stack(
            [
                self.acc_normalizer.value,
                self.acc_loss.value,
                self.acc_samples.value,
                tf.cast(tf.logical_not(grads_finite), ACC_DTYPE),
            ]
        )

    def _window_gradients(self, totals, variables, optimizer):
        """This replica's share of the window's gradient.

        Summed over replicas by the optimizer, the shares give the window's
        mean over all replicas' normalisers, or its sum (sum reductions).
        """
        divisor = _divisor(totals)
        grads = [acc.value / divisor for acc in self.acc_grads]
        grads = [
            tf.cast(g, v.dtype) for g, v in zip(grads, variables, strict=True)
        ]
        return _clip_across_replicas(optimizer, grads)

    def _finish(self, totals, finite, applied, optimizer, micro_steps=None):
        """Closes the window: counts, publishes, runs hooks, resets."""
        window_loss = totals[1] / _divisor(totals)
        has_samples = totals[2] > 0
        self.skipped_windows.assign_add(
            tf.cast(
                tf.logical_and(has_samples, tf.logical_not(finite)), "int64"
            )
        )
        nan = tf.constant(float("nan"), ACC_DTYPE)
        trace = grad_sq = nan
        if micro_steps is None:
            micro_steps = self.mini_step.value
            if self.noise_every:
                trace, grad_sq = self._when_sampled(
                    lambda: self._noise_statistics(optimizer),
                    lambda: (nan, nan),
                )
        micro_steps = tf.cast(micro_steps, "int64")
        tf.cond(
            has_samples,
            lambda: self._publish(
                window_loss,
                totals[2],
                optimizer.iterations,
                micro_steps,
                trace,
                grad_sq,
            ),
            _nothing,
        )
        for hook in self.close_hooks:
            hook(applied)
        self.reset_window()

    def _when_sampled(self, estimate, otherwise):
        """`estimate()` in windows that estimate the noise scale.

        `log_count` stays put while a window is open (it moves when the
        window publishes), so every micro-step of a window and its close
        agree on whether it is sampled, with no state of its own.
        """
        if self.noise_every == 1:
            return estimate()
        sampled = tf.equal(self.log_count.value % self.noise_every, 0)
        return tf.cond(sampled, estimate, otherwise)

    def _noise_statistics(self, optimizer):
        """This replica's window estimates of tr(Σ) and |G|²
        (`_window_rules.noise_statistics`)."""
        # Loss scaling multiplies every gradient by the same scale.
        scale = optimizer.scale_loss(tf.ones(()))
        return _window_rules.noise_statistics(
            self._values(),
            scale,
            squares_of=lambda values: _sum_of_squares(values, self.xla),
        )

    def _values(self):
        """The window's values, named as in `_window_rules`, read lazily.

        Only what a formula uses is read: an unused read of an accumulator
        would still be ordered against its writes in the step.
        """
        return _LazyValues(self)

    def _publish(self, window_loss, samples, iterations, micro, trace, gsq):
        slot = [[self.log_count.value % LOG_CAPACITY]]
        for ring, value in (
            (self.log_loss, tf.cast(window_loss, ACC_DTYPE)),
            (self.log_samples, tf.cast(samples, ACC_DTYPE)),
            (self.log_update, tf.cast(iterations, "int64")),
            (self.log_micro, tf.cast(micro, "int64")),
            (self.log_trace, tf.cast(trace, ACC_DTYPE)),
            (self.log_grad_sq, tf.cast(gsq, ACC_DTYPE)),
        ):
            ring.assign(tf.tensor_scatter_nd_update(ring.value, slot, [value]))
        self.log_count.assign_add(1)
        return None

    def reset_window(self):
        # The accumulators keep the closed window's sum: the next
        # micro-batch overwrites them (see `accumulate`).
        self.acc_normalizer.assign(0.0)
        self.acc_loss.assign(0.0)
        self.acc_samples.assign(0.0)
        self.acc_grad_sq.assign(0.0)
        self.mini_step.assign(0)


def _nothing():
    return None


class _LazyValues:
    """A `WindowState`'s variables as a read-on-access `_window_rules` dict."""

    def __init__(self, window):
        self._window = window

    def __getitem__(self, name):
        if name == "acc_grads":
            return [acc.value for acc in self._window.acc_grads]
        return getattr(self._window, name).value


def _divisor(totals):
    return _window_rules.window_divisor(totals[0])


def _decide(totals, optimizer):
    """(whether the window's gradient is finite, whether to apply it).

    A window without samples (Keras 3.15 runs a step on no data when a
    dataset is empty) applies nothing. A `LossScaleOptimizer` gets
    non-finite gradients too: it skips them itself and lowers its scale,
    as for a large batch that overflowed.
    """
    finite = tf.equal(totals[3], 0.0)
    has_samples = totals[2] > 0
    if isinstance(optimizer, LossScaleOptimizer):
        return finite, has_samples
    return finite, tf.logical_and(finite, has_samples)


def _apply_gradients(optimizer, grads, variables, none_grads):
    # A variable the loss never reached gets `None`, as in a plain step:
    # no momentum decay and no weight decay for it.
    grads = [
        None if none else g for g, none in zip(grads, none_grads, strict=True)
    ]
    optimizer.apply(grads, variables)


def _true_gradient(grad):
    """`grad` with an `IndexedSlices`' repeated rows summed, still sparse.

    An `Embedding`'s gradient holds one row per token occurrence. Keras's
    TensorFlow optimizers (Adam, RMSprop, Adagrad, Ftrl, clipping, ...)
    square or clip those rows before the repeats are summed, which is not
    the gradient's square; with each row once, every Keras optimizer's
    sparse update equals its dense one. Across several replicas the
    optimizer's all-reduce concatenates the replicas' rows, repeating
    them again, so there it becomes dense, as an accumulator is.
    """
    if not isinstance(grad, tf.IndexedSlices):
        return grad
    ctx = tf.distribute.get_replica_context()
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        return tf.convert_to_tensor(grad)
    indices, positions = tf.unique(grad.indices)
    values = tf.math.unsorted_segment_sum(
        grad.values, positions, tf.shape(indices)[0]
    )
    return tf.IndexedSlices(values, indices, grad.dense_shape)


def _clip_across_replicas(optimizer, grads):
    """Clips the window's whole gradient when replicas hold shares of it.

    Keras clips each replica's gradient before summing them, which is not
    clipping the sum. With clipping configured and several replicas, sum
    the shares here (one extra gradient all-reduce per update), clip with
    the optimizer's own rules, and hand each replica 1/R of the result:
    the optimizer's clipping then finds nothing above its threshold and its
    all-reduce restores the clipped sum.
    """
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return grads
    if isinstance(optimizer, LossScaleOptimizer):
        # Its gradients are still loss-scaled here; see the docs' limits.
        return grads
    if not (
        optimizer.clipnorm or optimizer.clipvalue or optimizer.global_clipnorm
    ):
        return grads
    grads = ctx.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    grads = optimizer._clip_gradients(grads)
    replicas = ctx.num_replicas_in_sync
    return [g / tf.cast(replicas, g.dtype) for g in grads]


def _sum_of_squares(tensors, xla):
    """The sum of every element's square over `tensors`, as fast as can be.

    Without XLA, `l2_loss` (sum(g²) / 2) is one multi-threaded kernel that
    makes no squared copy. XLA on CPU lowers a reduction to a scalar to a
    single-threaded loop, about ten times slower on a dense layer's kernel
    than the matrix-vector product it runs on its threaded BLAS, so there
    the squares are summed as rows of at least 128 values times ones.
    """
    if not tensors:
        return tf.zeros((), ACC_DTYPE)
    if not xla:
        return 2.0 * tf.add_n([tf.nn.l2_loss(t) for t in tensors])
    sums = []
    for t in tensors:
        width = 1
        for dim in reversed(t.shape):
            if width >= 128:
                break
            width *= dim
        rows = tf.reshape(tf.square(t), (-1, width))
        sums.append(
            tf.reduce_sum(tf.linalg.matvec(rows, tf.ones((width,), t.dtype)))
        )
    return tf.add_n(sums)


def _all_reduce_sum(value):
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)


def _all_finite(grads):
    # Once per update, not per step: an elementwise check, because a sum of
    # large finite values could overflow and drop a valid window.
    if not grads:
        return tf.constant(True)
    return tf.reduce_all(
        tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])
    )
