"""What the window does differently on TensorFlow: in place, per replica.

The window's rules are `_window.py`'s; TensorFlow's graph step runs them on
its variables, and only these parts differ:

- each accumulator is written as soon as backpropagation has made its
  gradient, and the update runs the optimizer on one weight after
  another (under XLA: the accumulators are divided as the window's last
  micro-batch is added), so that a step holds about one layer's gradient
  at a time, as a plain step does;
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

import contextlib

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
    ready=(),
    close_at_epoch_end=False,
):
    """`_window.accumulate`, each accumulator written as its gradient comes.

    A plain step updates each weight as soon as backpropagation has made
    its gradient, which frees it: a step holds about one layer's gradient
    at a time. So here each accumulator's write waits for its own gradient
    only, and the window's counters and totals for `ready` (the
    micro-batch, its loss and every gradient: see
    `TensorFlowAccumTrainer.train_step`). Waiting for every gradient
    before any write held all of them at once, a copy of the weights
    (measured, 7-layer MLP: the step's peak 0.34 P above the persistent
    state for `Model(B)`, 1.0 P for `AccumModel` before, 0.34 P now).

    Under XLA on one replica, the micro-batch that completes a window
    also divides the accumulators by the window's divisor as it adds to
    them, and `close` hands them to the optimizer as they are
    (`divides_in_step`): XLA made every quotient before the update
    otherwise (7-layer MLP: 1.0 P above the state, against 0.36 P for
    `Model(B)`). Returns whether it does.
    """
    weight = tf.cast(weight, ACC_DTYPE)
    # Read before the counters move: `_window.accumulate` sees the same.
    starting = tf.equal(state.mini_step.value, 0)
    measure = None
    if noise_every == 1:
        measure = True
    elif noise_every:
        measure = _window.is_sampled(state.values(), noise_every)

    def with_micro_batch(noise_every, squares):
        # The window's values with this micro-batch in; the accumulators
        # are written in place, by `_add_each`.
        return _window.accumulate(
            state.values(),
            grads,
            weight,
            normalizer,
            loss,
            samples,
            scheduled,
            noise_every,
            add=lambda *_: (None, squares),
        )

    divisor = None
    if xla and divides_in_step():
        # As the step writes them below: does it complete the window?
        counted = with_micro_batch(0, None)
        divisor = tf.where(
            _window.is_complete(counted, close_at_epoch_end),
            _window.window_divisor(counted["acc_normalizer"]),
            tf.ones((), ACC_DTYPE),
        )
    squares = _add_each(state, grads, weight, starting, measure, xla, divisor)
    with tf.control_dependencies(list(ready)):
        state.write(with_micro_batch(noise_every, squares))
    return divisor is not None


def divides_in_step():
    """Whether `accumulate` under XLA divides a completing window here.

    One replica, on a strategy whose optimizer apply needs no
    `merge_call`: elsewhere the divisor is a sum over replicas, known
    only at the update.
    """
    ctx = tf.distribute.get_replica_context()
    one_replica = ctx is None or ctx.num_replicas_in_sync == 1
    return one_replica and supports_direct_apply()


def _add_each(state, grads, weight, starting, measure, xla, divisor=None):
    """Writes `grads` times `weight` into the accumulators, one by one.

    A window's first micro-batch overwrites what the last window left
    (`_window.add_weighted`'s rule), so nothing clears the accumulators
    after an update; a conditional per accumulator picks the write, so
    that it takes that accumulator's gradient only and writes in place
    (a select of `value` and `acc + value` costs two more passes over the
    weights per micro-batch: measured +19% CPU time per sample on a
    784-512-512-10 MLP). With a `divisor` (XLA, see `accumulate`), a
    select whose result is divided: XLA fuses it into one pass. Returns
    the sum of the squares of what was added
    where `measure` (a boolean scalar, or True for every window) holds,
    zero elsewhere; None if `measure` is None.
    """
    zero = tf.zeros((), ACC_DTYPE)
    squares = []
    for acc, grad in zip(state.acc_grads, grads, strict=True):
        if grad is None:
            continue
        # Embedding gradients (`IndexedSlices`) densify here: the
        # accumulator is dense anyway.
        value = tf.cast(tf.convert_to_tensor(grad), ACC_DTYPE) * weight
        if divisor is not None:
            acc.assign(tf.where(starting, value, acc.value + value) / divisor)
        else:
            tf.cond(
                starting,
                lambda acc=acc, value=value: acc.assign(value),
                lambda acc=acc, value=value: acc.assign_add(value),
            )
        if measure is None:
            continue
        # Per accumulator, so that no gradient waits for the others; in a
        # conditional where windows are sampled, so that the others skip
        # the pass.
        if measure is True:
            squares.append(_sum_of_squares([value], xla))
        else:
            squares.append(
                tf.cond(
                    measure,
                    lambda value=value: _sum_of_squares([value], xla),
                    lambda: zero,
                )
            )
    if measure is None:
        return None
    return tf.add_n(squares) if squares else zero


# -- Closing a window (any replica context) -----------------------------------


def close(
    state,
    optimizer,
    variables,
    should_close,
    none_grads,
    noise_every=0,
    xla=False,
    divided_in_step=False,
):
    """Closes the window once if `should_close`: `_window.close`, in place.

    `divided_in_step`: `accumulate` divided the accumulators already.

    An optimizer apply calls `merge_call` under most strategies, which may
    not sit inside a per-replica `tf.cond`; there the conditionals move to
    cross-replica context, and the rules' stages run on each replica.
    """
    scales_loss = isinstance(optimizer, LossScaleOptimizer)

    def estimate_noise(window, totals):
        nan = tf.constant(float("nan"), ACC_DTYPE)
        if not noise_every:
            return nan, nan
        # Loss scaling multiplies every gradient by the same scale.
        scale = optimizer.scale_loss(tf.ones(()))

        # Of the window's sum: undo a division made in the step.
        undivide = tf.ones((), ACC_DTYPE)
        if divided_in_step:
            undivide = tf.square(_window.window_divisor(totals[0]))

        def estimate():
            return _window.noise_statistics(
                window,
                scale,
                squares_of=lambda values: (
                    _sum_of_squares(values, xla) * undivide
                ),
            )

        if noise_every == 1:
            return estimate()
        sampled = _window.is_sampled(window, noise_every)
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
                    optimizer,
                    grads,
                    variables,
                    none_grads,
                    one_at_a_time=not xla,
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
                divide=_divide(state, xla, divided_in_step),
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


def _divide(state, xla, divided_in_step):
    """`_window.window_gradients`'s `divide` for this close."""
    if divided_in_step:
        return lambda accs, divisor: list(accs)
    if xla:
        # An assignment there costs XLA a copy of each accumulator
        # (measured): new quotients, then.
        return None
    return _divide_in_place(state)


def _divide_in_place(state):
    """`_window.window_gradients`'s `divide`, into the accumulators.

    The optimizer then reads the accumulators themselves: a new quotient
    per weight, alive until the apply, would cost another copy of the
    weights (measured: the update's peak fell from about 1.8 to 1.0-1.2
    times the weights' size above `Model(B)`'s). Not under XLA, where it
    costs more than it saves (wide MLP: 1.0 without it, 2.2 with it).
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


def _apply_gradients(
    optimizer, grads, variables, none_grads, one_at_a_time=False
):
    # A variable the loss never reached gets `None`, as in a plain step:
    # no momentum decay and no weight decay for it.
    grads = [
        None if none else g for g, none in zip(grads, none_grads, strict=True)
    ]
    if not one_at_a_time:
        optimizer.apply(grads, variables)
        return
    with _updates_one_at_a_time(optimizer):
        optimizer.apply(grads, variables)


@contextlib.contextmanager
def _updates_one_at_a_time(optimizer):
    """Runs the optimizer's per-weight updates one after another.

    Handed the accumulators, every weight's update can start at once, and
    the graph executor interleaves them: one weight's temporaries (Adam:
    `sqrt(v)` and `g - m`, each the weight's size) stay alive while
    another's are made (measured, 7-layer MLP: the update's peak 0.67 to
    0.84 P above the persistent state, by process and threads, against
    0.34 P for `Model(B)`, whose updates backpropagation paces). Within
    this context each `update_step` (of the optimizer, and of the one it
    wraps, as a `LossScaleOptimizer` does) reads its gradient only after
    every operation the previous one made has run: 0.34 P.
    """
    optimizers = []
    while optimizer is not None and optimizer not in optimizers:
        optimizers.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    previous = {"graph": None, "ops": []}

    def after_the_previous(update_step):
        def update_step_in_turn(gradient, variable, *args, **kwargs):
            graph = tf.compat.v1.get_default_graph()
            if previous["graph"] is graph and previous["ops"]:
                with tf.control_dependencies(previous["ops"]):
                    gradient = tf.identity(gradient)
            start = len(graph.get_operations())
            result = update_step(gradient, variable, *args, **kwargs)
            # Its last operations: waiting for them waits for all of it.
            previous["graph"] = graph
            previous["ops"] = [
                op
                for op in graph.get_operations()[start:]
                if not any(output.consumers() for output in op.outputs)
            ]
            return result

        return update_step_in_turn

    # On the instances, for this trace only: Keras calls
    # `self.update_step(gradient, variable, learning_rate)` once per weight.
    patched = []
    try:
        for each in optimizers:
            own = each.__dict__.get("update_step")
            object.__setattr__(
                each, "update_step", after_the_previous(each.update_step)
            )
            patched.append((each, own))
        yield
    finally:
        for each, own in patched:
            if own is None:
                object.__delattr__(each, "update_step")
            else:
                object.__setattr__(each, "update_step", own)


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
