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

ACC_DTYPE = "float32"
# Updates remembered for `PseudoBatchLogger` between two reads.
LOG_CAPACITY = 256


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


class WindowState:
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
        window_length: `accum_steps`, as a variable so that changing it
            does not retrace.
        skipped_windows: Windows dropped because their gradient was not
            finite.
        acc_loss: The window's loss so far, weighted like the gradients.
        acc_samples: Samples in the window so far.
        log_loss, log_samples, log_update: A ring of the last
            `LOG_CAPACITY` updates' pseudo-batch loss, sample count and
            `optimizer.iterations` after the update, published in the graph
            for `PseudoBatchLogger`.
        log_count: Updates published so far (the ring's write position).
    """

    def __init__(self, trainable_variables, accum_steps, strategy):
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
        self.window_length.assign(accum_steps)

    @property
    def variables(self):
        return [
            *self.acc_grads,
            self.acc_normalizer,
            self.acc_loss,
            self.acc_samples,
            self.mini_step,
            self.epoch_step,
            self.steps_per_epoch,
            self.window_length,
            self.skipped_windows,
            self.log_loss,
            self.log_samples,
            self.log_update,
            self.log_count,
        ]

    # -- Inside the train step (replica context) ---------------------------

    def accumulate(self, grads, normalizer, loss, samples):
        for acc, grad in zip(self.acc_grads, grads, strict=True):
            if grad is None:
                continue
            # Embedding gradients (`IndexedSlices`) densify here: the
            # accumulator is dense anyway.
            acc.assign_add(tf.cast(tf.convert_to_tensor(grad), ACC_DTYPE))
        self.acc_normalizer.assign_add(tf.cast(normalizer, ACC_DTYPE))
        self.acc_loss.assign_add(tf.cast(loss, ACC_DTYPE))
        self.acc_samples.assign_add(tf.cast(samples, ACC_DTYPE))
        self.mini_step.assign_add(1)
        self.epoch_step.assign_add(1)

    def window_is_complete(self, close_at_epoch_end):
        complete = self.mini_step >= self.window_length
        if close_at_epoch_end:
            epoch_done = tf.logical_and(
                self.steps_per_epoch > 0,
                self.epoch_step >= self.steps_per_epoch,
            )
            complete = tf.logical_or(complete, epoch_done)
        return complete

    def maybe_apply(
        self, optimizer, variables, should_apply, sum_mode, none_grads
    ):
        """Applies the window once if `should_apply`, in any replica context.

        An optimizer apply calls `merge_call`, which may not sit inside a
        per-replica `tf.cond`; where the strategy needs `merge_call`, the
        conditional is moved to cross-replica context as Keras's
        `LossScaleOptimizer` does.
        """
        if (
            not tf.distribute.has_strategy()
            or tf.__internal__.distribute.strategy_supports_no_merge_call()
        ):
            tf.cond(
                should_apply,
                lambda: self._apply(optimizer, variables, sum_mode, none_grads),
                _nothing,
            )
            return

        def cross_replica(distribution, should_apply):
            # Every replica counts the same micro-steps: take the first.
            flag = distribution.experimental_local_results(should_apply)[0]

            def apply_on_each_replica():
                distribution.extended.call_for_each_replica(
                    self._apply,
                    args=(optimizer, variables, sum_mode, none_grads),
                )

            tf.cond(flag, apply_on_each_replica, _nothing)

        tf.distribute.get_replica_context().merge_call(
            cross_replica, args=(should_apply,)
        )

    def _apply(self, optimizer, variables, sum_mode, none_grads):
        # The window's totals over all replicas: three scalar all-reduces
        # per update, beside the optimizer's own.
        total = _all_reduce_sum(self.acc_normalizer.value)
        window_loss = _all_reduce_sum(self.acc_loss.value)
        samples = _all_reduce_sum(self.acc_samples.value)
        if sum_mode:
            grads = [acc.value for acc in self.acc_grads]
        else:
            grads = [
                tf.math.divide_no_nan(acc.value, total)
                for acc in self.acc_grads
            ]
            window_loss = tf.math.divide_no_nan(window_loss, total)
        grads = [
            tf.cast(g, v.dtype) for g, v in zip(grads, variables, strict=True)
        ]
        finite = _all_finite(grads)
        # A variable the loss never reached gets `None`, as in a plain
        # step: no momentum decay, no weight decay for it.
        grads = [
            None if none else g
            for g, none in zip(grads, none_grads, strict=True)
        ]
        if isinstance(optimizer, LossScaleOptimizer):
            # It checks finiteness itself, skips, and lowers its scale.
            optimizer.apply(grads, variables)
        else:
            tf.cond(
                finite,
                lambda: optimizer.apply(grads, variables),
                _nothing,
            )
        self.skipped_windows.assign_add(
            tf.cast(tf.logical_not(finite), "int64")
        )
        self._publish(window_loss, samples, optimizer.iterations)
        self.reset_window()

    def _publish(self, window_loss, samples, iterations):
        slot = [[self.log_count.value % LOG_CAPACITY]]
        for ring, value in (
            (self.log_loss, tf.cast(window_loss, ACC_DTYPE)),
            (self.log_samples, samples),
            (self.log_update, tf.cast(iterations, "int64")),
        ):
            ring.assign(tf.tensor_scatter_nd_update(ring.value, slot, [value]))
        self.log_count.assign_add(1)

    def reset_window(self):
        for acc in self.acc_grads:
            acc.assign(tf.zeros_like(acc.value))
        self.acc_normalizer.assign(0.0)
        self.acc_loss.assign(0.0)
        self.acc_samples.assign(0.0)
        self.mini_step.assign(0)


def _nothing():
    return None


def _all_reduce_sum(value):
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return value
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, value)


def _all_finite(grads):
    # The sum is cheap and non-finite iff some element is (or overflows,
    # which the optimizer step would then meet too).
    checks = [tf.math.is_finite(tf.reduce_sum(g)) for g in grads]
    return tf.reduce_all(tf.stack(checks))
