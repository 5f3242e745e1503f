"""What the window does differently on TensorFlow: in place, per replica.

The window's rules are `_window.py`'s; TensorFlow's graph step runs them on
its variables, and only these parts differ:

- the accumulators are written in place, inside conditionals that form
  each weighted gradient one at a time (less memory than new values);
- under `tf.distribute` every window variable is per replica (`ON_READ`):
  micro-steps touch only local memory, and nothing crosses devices until
  the update, where the replicas exchange one packed vector of window
  totals besides the optimizer's own gradient all-reduce; where an
  optimizer apply needs `merge_call`, the update's conditionals run in
  cross-replica context, as in Keras's `LossScaleOptimizer`;
- a one-micro-batch window (`accum_steps=1`) can be applied straight from
  its gradient (`apply_direct`);
- embedding gradients (`IndexedSlices`) have their repeated rows summed;
- under XLA, sums of squares avoid a single-threaded reduction.
"""

from __future__ import annotations

import keras
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from keras_accum import _window
from keras_accum._window import ACC_DTYPE, WindowState


def create(trainable_variables, length, strategy, close_hooks=()):
    """A `WindowState` of per-replica variables under `strategy`."""

    def make_variable(name, shape, dtype, summed, like):
        # No layout to follow: Keras's TensorFlow backend implements no
        # `keras.distribution` (3.15; `check_model` warns of one).
        del like
        return keras.Variable(
            initializer="zeros",
            shape=shape,
            dtype=dtype,
            trainable=False,
            # Per-replica copies: reading one in cross-replica context
            # aggregates, writing one in replica context stays local.
            synchronization="on_read",
            aggregation="sum" if summed else "only_first_replica",
            name=name,
        )

    with strategy.scope():
        return WindowState(
            trainable_variables, length, make_variable, close_hooks
        )


# -- Adding a micro-batch (replica context) -----------------------------------


def accumulate(
    state,
    grads,
    weight,
    normalizer,
    loss,
    samples,
    scheduled=None,
    noise_every=0,
    xla=False,
):
    """`_window.accumulate`, with the accumulators written in place."""
    # (The step runs this under control dependencies on the micro-batch,
    # its loss and its gradients: see `TensorFlowAccumTrainer.train_step`.)
    window = _window.accumulate(
        state.values(),
        grads,
        weight,
        normalizer,
        loss,
        samples,
        scheduled,
        noise_every,
        add=_in_place_add(state, noise_every, xla),
    )
    state.write(window)


def _in_place_add(state, noise_every, xla):
    """`_window.accumulate`'s `add`, assigning into the variables."""

    def add(window, grads, weight, starting, measure):
        del window  # Written in place: the values are never read.
        pairs = []
        for acc, grad in zip(state.acc_grads, grads, strict=True):
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
        def branch(overwrite, measure_here):
            def run():
                values = []
                for acc, grad in pairs:
                    value = grad * weight
                    if overwrite:
                        acc.assign(value)
                    else:
                        acc.assign_add(value)
                    values.append(value)
                if not measure_here:
                    return tf.zeros((), ACC_DTYPE)
                return _sum_of_squares(values, xla)

            return run

        def write(measure_here):
            return lambda: tf.cond(
                starting,
                branch(True, measure_here),
                branch(False, measure_here),
            )

        def when_sampled(estimate, otherwise):
            if noise_every == 1:
                return estimate()
            return tf.cond(measure, estimate, otherwise)

        if measure is None:
            write(False)()
            return None, None
        # The squares of what the window adds. Without XLA they are summed
        # in the branches, where each product is still at hand and nothing
        # else holds the gradients (which would keep TensorFlow from
        # reusing their buffers). Under XLA, nesting the accumulators'
        # writes in one more conditional cost more (measured), so there the
        # sum reads the gradients beside them.
        if xla:
            write(False)()
            grads = [grad for _, grad in pairs]
            squares = when_sampled(
                lambda: _sum_of_squares(grads, True) * tf.square(weight),
                lambda: tf.zeros((), ACC_DTYPE),
            )
        else:
            squares = when_sampled(write(True), write(False))
        return None, squares

    return add


# -- Closing a window (any replica context) -----------------------------------


def close(
    state,
    optimizer,
    variables,
    should_close,
    none_grads,
    noise_every=0,
    xla=False,
):
    """Closes the window once if `should_close`: `_window.close`, in place.

    An optimizer apply calls `merge_call` under most strategies, which may
    not sit inside a per-replica `tf.cond`; there the conditionals move to
    cross-replica context, and the rules' stages run on each replica.
    """
    scales_loss = isinstance(optimizer, LossScaleOptimizer)

    def estimate_noise(window, totals):
        del totals
        nan = tf.constant(float("nan"), ACC_DTYPE)
        if not noise_every:
            return nan, nan
        # Loss scaling multiplies every gradient by the same scale.
        scale = optimizer.scale_loss(tf.ones(()))

        def estimate():
            return _window.noise_statistics(
                window,
                scale,
                squares_of=lambda values: _sum_of_squares(values, xla),
            )

        if noise_every == 1:
            return estimate()
        sampled = tf.equal(window["log_count"] % noise_every, 0)
        return tf.cond(sampled, estimate, lambda: (nan, nan))

    def prepared(grads):
        grads = [
            tf.cast(g, v.dtype) for g, v in zip(grads, variables, strict=True)
        ]
        return _clip_across_replicas(optimizer, grads)

    def finish_here(totals, finite, applied, trace, grad_sq):
        window = _window.finish(
            state.values(),
            totals,
            finite,
            True,
            optimizer.iterations,
            trace,
            grad_sq,
        )
        state.write(window)
        _run_hooks(state, applied)

    if (
        not tf.distribute.has_strategy()
        or tf.__internal__.distribute.strategy_supports_no_merge_call()
    ):

        def update(go, gradients):
            grads = prepared(gradients())
            tf.cond(
                go,
                lambda: _apply_gradients(
                    optimizer, grads, variables, none_grads
                ),
                _nothing,
            )
            return optimizer.iterations

        def close_here():
            window, applied = _window.close(
                state.values(),
                True,
                update,
                scales_loss=scales_loss,
                reduce_totals=_all_reduce_sum,
                estimate_noise=estimate_noise,
                # XLA fuses the division into the update already, and an
                # assignment there cost it a copy (measured).
                divide=None if xla else _divide_in_place(state),
            )
            state.write(window)
            _run_hooks(state, applied)

        tf.cond(should_close, close_here, _nothing)
        return

    def cross_replica(distribution, should_close):
        # Every replica counts the same micro-steps: take the first.
        flag = distribution.experimental_local_results(should_close)[0]
        call = distribution.extended.call_for_each_replica

        def close_window():
            totals = distribution.reduce(
                tf.distribute.ReduceOp.SUM,
                call(lambda: _window.local_totals(state.values())),
                axis=None,
            )
            finite, go = _window.decide(totals, True, scales_loss)
            trace, grad_sq = call(
                lambda t: estimate_noise(state.values(), t), args=(totals,)
            )
            grads = call(
                lambda t: prepared(_window.window_gradients(state.values(), t)),
                args=(totals,),
            )

            def apply_on_each_replica():
                call(
                    _apply_gradients,
                    args=(optimizer, grads, variables, none_grads),
                )

            tf.cond(go, apply_on_each_replica, _nothing)
            call(finish_here, args=(totals, finite, go, trace, grad_sq))

        tf.cond(flag, close_window, _nothing)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(should_close,)
    )


# -- One-micro-batch windows (accum_steps=1) ----------------------------------


def supports_direct_apply():
    # Its conditional holds an optimizer apply: fine where the strategy
    # needs no merge_call.
    return (
        not tf.distribute.has_strategy()
        or tf.__internal__.distribute.strategy_supports_no_merge_call()
    )


def is_direct(state):
    return tf.logical_and(
        tf.equal(state.target_length.value, 1),
        tf.equal(state.mini_step.value, 0),
    )


def apply_direct(
    state,
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
    # summed (see `_true_gradient`). Checked after summing, so a sum that
    # overflows is caught as the accumulated window's would be.
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
            tf.cast(tf.logical_not(_window.all_finite(dense)), ACC_DTYPE),
        ]
    )
    totals = _all_reduce_sum(local)
    finite, go = _window.decide(
        totals, True, isinstance(optimizer, LossScaleOptimizer)
    )
    grads = [
        tf.zeros_like(v) if g is None else g
        for g, v in zip(grads, variables, strict=True)
    ]
    tf.cond(
        go,
        lambda: _apply_gradients(optimizer, grads, variables, none_grads),
        _nothing,
    )
    window = state.values()
    window = window.replace(
        epoch_step=window["epoch_step"] + 1,
        window_length=tf.ones((), window["window_length"].dtype),
    )
    # One micro-batch: no noise-scale estimate (it needs two).
    nan = tf.constant(float("nan"), ACC_DTYPE)
    window = _window.finish(
        window,
        totals,
        finite,
        True,
        optimizer.iterations,
        nan,
        nan,
        micro_steps=1,
    )
    state.write(window)
    _run_hooks(state, go)
    return None


# -- Helpers ------------------------------------------------------------------


def _nothing():
    return None


def _divide_in_place(state):
    """`_window.window_gradients`'s `divide`, into the accumulators.

    The optimizer then reads the accumulators themselves: a new quotient
    per weight, alive until the apply, would cost another copy of the
    weights (measured: the update's peak fell from about 1.8 to 1.0-1.2
    times the weights' size above `Model(B)`'s). Not under XLA, which
    fuses the division into the update (1.0 without this, 2.2 with it).
    The window's noise estimates and finiteness are read
    before this, and a window's first micro-batch overwrites what is left.
    """

    def divide(accs, divisor):
        del accs  # The variables are divided, not these reads.
        grads = []
        for acc in state.acc_grads:
            acc.assign(acc.value / divisor)
            grads.append(acc.value)
        return grads

    return divide


def _run_hooks(state, applied):
    for hook in state.close_hooks:
        hook(applied, tf.constant(True))


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
