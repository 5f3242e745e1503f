"""The window's operations on TensorFlow: in place, per replica.

`TensorFlowOps` is the `_window.WindowOps` of TensorFlow's graph step; the
rules are `_window.py`'s. What differs from the other backends:

- each accumulator is written as soon as backpropagation has made its
  gradient, in place, and the update runs the optimizer on one weight
  after another (`_updates_one_at_a_time`), so that a step holds about one
  layer's gradient at a time, as a plain step does;
- under XLA on one replica, the micro-batch that completes a window
  divides the accumulators as it adds to them, and the optimizer reads
  them as they are: XLA would otherwise make every quotient before the
  update, a copy of the weights (`benchmarks/bench_step_memory.py`, the
  deep MLP; figures in docs/benchmarks.md);
- under `tf.distribute` every window variable is per replica (`ON_READ`):
  micro-steps touch only local memory, and nothing crosses devices until
  the update, where the replicas exchange one packed vector of window
  totals besides the optimizer's own gradient all-reduce. An optimizer
  apply there needs `merge_call`, which may not sit inside a per-replica
  conditional: the conditionals move to cross-replica context
  (`close_when`, `CrossReplicaOps`), as in Keras's `LossScaleOptimizer`;
- under XLA, sums of squares avoid a single-threaded reduction.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf
from keras.optimizers import LossScaleOptimizer

from keras_accum import _compat, _window
from keras_accum._rounding import Draw
from keras_accum._window import WindowState
from keras_accum._window_fields import ACC_DTYPE, TOTALS, is_accumulator_key


def create(
    trainable_variables,
    length,
    strategy,
    close_hooks=(),
    accumulator_dtype=None,
):
    """A `WindowState` of per-replica variables under `strategy`."""

    def make_variable(name, shape, dtype, like):
        # No layout to follow: Keras's TensorFlow backend implements no
        # `keras.distribution` (3.15; `check_model` warns of one).
        del like
        summed = is_accumulator_key(name) or name in TOTALS
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
            trainable_variables,
            length,
            make_variable,
            close_hooks,
            accumulator_dtype,
        )


def needs_merge_call() -> bool:
    """Whether an optimizer apply here calls `merge_call` (the strategies
    of `tf.distribute`), which may not sit inside a per-replica
    conditional."""
    return tf.distribute.has_strategy() and not (
        _compat.strategy_supports_no_merge_call()
    )


def close_when(condition, close, replica_ops) -> None:
    """Runs `close(backend)` where the boolean scalar `condition` holds.

    In replica context under a `tf.cond`, with `replica_ops`; where an
    optimizer apply needs `merge_call`, which may not sit inside a
    per-replica conditional, under a `tf.cond` in cross-replica context
    (taking the first replica's `condition`: every replica computes the
    same), with `CrossReplicaOps`, as Keras's `LossScaleOptimizer` does.
    """
    if not needs_merge_call():
        tf.cond(condition, lambda: _call(close, replica_ops), _nothing)
        return

    def cross_replica(distribution, condition):
        flag = distribution.experimental_local_results(condition)[0]
        backend = CrossReplicaOps(replica_ops, distribution)
        tf.cond(flag, lambda: _call(close, backend), _nothing)

    tf.distribute.get_replica_context().merge_call(
        cross_replica, args=(condition,)
    )


class TensorFlowOps(_window.WindowOps):
    """The accumulators, replicas and optimizer of a TensorFlow step, in
    replica context (all of them where `needs_merge_call` is False).

    Args:
        state: The `WindowState`.
        optimizer: The model's optimizer.
        variables: The trainable variables, in the accumulators' order.
        none_grads: For each variable, whether its gradient is None (the
            loss does not reach it): it gets None at the update too.
        xla: The step is compiled by XLA.
    """

    def __init__(self, state, optimizer, variables, none_grads, xla=False):
        self.state = state
        self.optimizer = optimizer
        self.variables = variables
        self.none_grads = none_grads
        self.xla = xla
        ctx = tf.distribute.get_replica_context()
        one_replica = ctx is None or ctx.num_replicas_in_sync == 1
        # Each replica rounds with its own bits.
        self._replica = 0 if ctx is None else ctx.replica_id_in_sync_group
        # Under XLA on one replica, `add` divides a completing window as
        # it writes it: XLA fuses the select and the divide into one pass.
        # Only into exact accumulators: another codec's close divides in
        # float32 and encodes the quotient.
        self.divides_in_step = (
            xla and one_replica and not needs_merge_call() and state.exact
        )
        # The divisor `add` divides by: the window's, where the micro-batch
        # completes it, else 1 (`before_add`).
        self._closing_divisor = None
        # Set by `add` where it divided a completing window.
        self._divided_by = None

    def before_add(self, added, complete):
        if self.divides_in_step:
            self._closing_divisor = tf.where(
                complete,
                _window.window_divisor(added.acc_normalizer),
                tf.ones((), ACC_DTYPE),
            )

    def add(self, grads, weight, starting, sampled, draw=None):
        """Writes each accumulator as soon as its own gradient exists.

        A conditional per accumulator picks the write (a window's first
        micro-batch assigns, later ones add in place), so that it takes
        that accumulator's gradient only: waiting for every gradient
        before any write would hold all of them at once, and clearing the
        accumulators after an update would allocate a buffer of each.
        Where `divides_in_step`, a select whose result is divided by the
        closing divisor (`before_add`).
        """
        zero = tf.zeros((), ACC_DTYPE)
        squares, encoded = [], []
        for i, (acc, grad, codec) in enumerate(
            zip(self.state.acc_grads, grads, self.state.codecs, strict=True)
        ):
            if grad is None:
                continue
            # Embedding gradients (`IndexedSlices`) densify here, their
            # repeated rows summed: the accumulator is dense anyway.
            grad = tf.convert_to_tensor(grad)
            if not codec.exact:
                # The gradient as it came: cast and weighted in the
                # codec's kernel. (A cast made here and left unused
                # still runs in a graph, and was held to the step's end: a
                # float32 copy of every large weight.)
                encoded.append((i, acc, grad, codec))
                if sampled is not None:
                    value = _weighted(grad, weight)
                    squares.append(self._squares_of_added(value, sampled, zero))
                continue
            value = _weighted(grad, weight)
            if self.divides_in_step:
                total = tf.where(starting, value, acc.value + value)
                acc.assign(total / self._closing_divisor)
            else:
                tf.cond(
                    starting,
                    lambda acc=acc, value=value: acc.assign(value),
                    lambda acc=acc, value=value: acc.assign_add(value),
                )
            if sampled is not None:
                squares.append(self._squares_of_added(value, sampled, zero))
        self._encode_into(encoded, weight, starting, draw)
        if self.divides_in_step:
            self._divided_by = self._closing_divisor
        if sampled is None:
            return None
        return tf.add_n(squares) if squares else zero

    def _encode_into(self, encoded, weight, starting, draw) -> None:
        """Adds `(index, accumulator, gradient, codec)` of each accumulator
        whose codec is not exact (times `weight`, unless None), the sum
        made in float32 and encoded (`AccumulatorCodec.add`: bfloat16's
        rounds stochastically).

        Each in one XLA kernel (`_kernels`), which makes no buffer
        but the result, where the graph executor would make the float32
        sum, the bits and their intermediates op by op; and, without XLA,
        one weight after another, the last weight first (the order
        backpropagation makes their gradients in), not side by side.
        Before both, the deep MLP of `bench_step_memory.py
        --low-precision` requested 0.94 P beyond the state (P: the
        weights' float32 size), against 0.50 P with float32
        accumulators.
        """
        if not encoded:
            return
        if draw is not None:
            # Each replica rounds with its own bits.
            seed = tf.bitwise.bitwise_xor(
                _value(draw.seed), tf.cast(self._replica, tf.int32) * 7919
            )
            draw = Draw(seed, _value(draw.count))
        if weight is None:
            weight = tf.ones((), ACC_DTYPE)
        previous = []
        for i, acc, grad, codec in reversed(encoded):
            # The accumulator read once its gradient exists: read at the
            # step's start, every one would be held until its write, and
            # the write would copy it.
            with tf.control_dependencies([grad, *previous]):
                result = _kernels(codec).add(
                    acc.value,
                    grad,
                    (weight, starting),
                    draw,
                    tf.constant(i),
                )
                acc.assign(result)
            if not self.xla:
                previous = [result]

    def _squares_of_added(self, value, sampled, zero):
        # Per accumulator, so that no gradient waits for the others; in a
        # conditional where windows are sampled, so that the others skip
        # the pass.
        if sampled is True:
            return _sum_of_squares([value], self.xla)
        return tf.cond(
            sampled, lambda: _sum_of_squares([value], self.xla), lambda: zero
        )

    def all_finite(self, closing=True):
        # `closing` unread: the close runs in its conditional (`close_when`).
        # A bfloat16 accumulator as it is: float32's range, and a cast of
        # each would be held for both tests.
        accs = [acc.value for acc in self.state.acc_grads]
        if self.xla:
            # One fused reduction each there, like the sums.
            return _window.all_finite(accs)
        return tf.cond(
            _window.sums_finite(accs),
            lambda: tf.constant(True),
            lambda: _window.all_finite(accs),
        )

    def sum_of_squares(self, closing=True):
        # `closing` unread: the close runs in its conditional (`close_when`).
        pairs = list(zip(self.state.acc_grads, self.state.codecs, strict=True))
        squares = _sum_of_squares(
            [acc.value for acc, codec in pairs if codec.exact], self.xla
        )
        encoded = [
            _kernels(codec).squares(acc.value)
            for acc, codec in pairs
            if not codec.exact
        ]
        if encoded:
            # Widened to float32 inside one kernel each: a graph would make
            # every float32 cast at once.
            squares += tf.add_n(encoded)
        if self._divided_by is not None:
            # Of the window's sum, not of what `add` divided it into.
            squares = squares * tf.square(self._divided_by)
        return squares

    def gradients(self, divisor):
        accs = self.state.acc_grads
        if self._divided_by is not None:
            return [acc.value for acc in accs]
        pairs = list(zip(accs, self.state.codecs, strict=True))
        if self.xla:
            # An assignment there costs XLA a copy of each accumulator:
            # new quotients, then, each encoded by its codec as below.
            return [codec.quotient(acc.value, divisor) for acc, codec in pairs]
        # Into the accumulators: the optimizer then reads them, without a
        # new quotient per weight alive until the apply, which would cost
        # another copy of the weights at the update's peak. The noise
        # estimates and finiteness are read before this, and a window's
        # first micro-batch overwrites it. Another codec's accumulator is
        # divided in float32 and encoded into itself, whatever its weight's
        # dtype (`AccumulatorCodec.quotient` says why).
        quotients, previous = [], []
        for acc, codec in pairs:
            if codec.exact:
                acc.assign(acc.value / divisor)
            else:
                # In one kernel, one weight after another: the executor
                # would otherwise make every float32 cast at once.
                with tf.control_dependencies(previous):
                    quotient = _kernels(codec).quotient(acc.value, divisor)
                    acc.assign(quotient)
                previous = [quotient]
            # Read here: handed on as a variable, under a strategy it
            # would be read where no replica's device is set.
            quotients.append(tf.identity(acc.value))
        return quotients

    def apply(self, go, divisor):
        tf.cond(
            go,
            lambda: self.applied(self.prepared(self.gradients(divisor))),
            _nothing,
        )
        return self.optimizer.iterations

    def prepared(self, gradients) -> list:
        """This replica's share of the window's gradient, as the optimizer
        takes it."""
        grads = [
            tf.cast(g, v.dtype)
            for g, v in zip(gradients, self.variables, strict=True)
        ]
        grads = _clip_across_replicas(self.optimizer, grads)
        # A variable the loss never reached gets `None`, as in a plain
        # step: no momentum decay and no weight decay for it.
        return [
            None if none else g
            for g, none in zip(grads, self.none_grads, strict=True)
        ]

    def applied(self, grads) -> None:
        """The optimizer's apply of `prepared` gradients: one weight after
        another in a graph step on one device (under a strategy Keras
        updates each weight in cross-replica context, where the ordering
        does not reach)."""
        if self.xla or needs_merge_call():
            self.optimizer.apply(grads, self.variables)
            return
        with _updates_one_at_a_time(self.optimizer):
            self.optimizer.apply(grads, self.variables)

    def read(self):
        """The counters as the rules read them here: the variables, each
        read where a rule uses it (reading every counter at every step
        would cost a read of each)."""
        return self.state.counters

    def write(self, counters, read) -> None:
        """Assigns the counters `close` changed."""
        self.state.write(counters, read)

    def close_hooks(self, applied) -> None:
        """Runs the window's close hooks for a window that closed."""
        for hook in self.state.close_hooks:
            hook(applied, tf.constant(True))


class CrossReplicaOps(_window.WindowOps):
    """`TensorFlowOps` seen from cross-replica context, where a close that
    may call `merge_call` runs (`close_when`).

    `close` there gets the counters as variables: each stage that reads
    them runs on each replica (`each`), where a variable reads as that
    replica's copy; the totals are reduced across replicas, and the update
    runs on each replica under a conditional of this context. The counters
    `close` returns are each replica's; `write` assigns them there.
    """

    def __init__(self, replica_ops, distribution):
        self._replica = replica_ops
        self._distribution = distribution

    def add(self, grads, weight, starting, sampled, draw=None):
        raise NotImplementedError("a micro-batch is added in replica context")

    def all_finite(self, closing=True):
        return self._replica.all_finite(closing)

    def sum_of_squares(self, closing=True):
        return self._replica.sum_of_squares(closing)

    def gradients(self, divisor):
        return self._replica.gradients(divisor)

    def reduce_sum(self, value):
        return self._distribution.reduce(
            tf.distribute.ReduceOp.SUM, value, axis=None
        )

    def each(self, function, *args):
        def on_each_replica(*args):
            # A variable given as an argument reads as this replica's copy.
            return function(*keras.tree.map_structure(_value_of, args))

        return self._distribution.extended.call_for_each_replica(
            on_each_replica, args=args
        )

    def apply(self, go, divisor):
        replica = self._replica
        # Each replica's share, made before the conditional, as the
        # optimizer's update inside it takes them (its all-reduce fails
        # under MultiWorkerMirroredStrategy otherwise).
        grads = self.each(
            lambda divisor: replica.prepared(replica.gradients(divisor)),
            divisor,
        )
        tf.cond(go, lambda: self.each(replica.applied, grads), _nothing)
        return replica.optimizer.iterations

    def read(self):
        # The variables: `each` reads them on each replica.
        return self._replica.state.counters

    def write(self, counters, read) -> None:
        del read  # Each replica's counters are new.
        self.each(self._replica.state.write_all, counters)

    def close_hooks(self, applied) -> None:
        self.each(self._replica.close_hooks, applied)


# -- Helpers ------------------------------------------------------------------


def _nothing():
    return None


def _call(function, *args):
    function(*args)


def _value_of(value):
    return value.value if isinstance(value, keras.Variable) else value


@contextlib.contextmanager
def _updates_one_at_a_time(optimizer):
    """Runs the optimizer's per-weight updates one after another.

    Handed the accumulators, every weight's update can start at once, and
    the graph executor interleaves them: one weight's temporaries (Adam:
    `sqrt(v)` and `g - m`, each the weight's size) stay alive while
    another's are made, where a plain step's updates are paced by
    backpropagation, one weight at a time (the deep MLP of
    `benchmarks/bench_step_memory.py`). Within this context each
    `update_step` (of the optimizer, and of the one it wraps, as a
    `LossScaleOptimizer` does) reads its gradient only after every
    operation the previous one made has run.
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
    grads = _compat.clip_gradients(optimizer, grads)
    replicas = ctx.num_replicas_in_sync
    return [g / tf.cast(replicas, g.dtype) for g in grads]


def _weighted(grad, weight):
    value = tf.cast(grad, ACC_DTYPE)
    return value if weight is None else value * weight


def _xla_kernel(function):
    """`function` compiled by XLA, called with tensors only.

    A `tf.distribute` variable handed to a `tf.function` is not an input:
    its trace type (TensorFlow's `DistributedVariableTraceType`) compares
    shape and dtype alone, and the trace captures the variable itself. A
    kernel shared by every model then read and rounded into the first
    model's accumulators of that shape on every later model's step (and
    the same model's after a recompile): wrong sums, silently. Each
    variable is read here instead, in the caller's replica context, so
    that a kernel's traces hold nothing of any model.
    """
    compiled = tf.function(function, jit_compile=True, autograph=False)

    @functools.wraps(function)
    def call(*args):
        return compiled(*tf.nest.map_structure(_tensor, args))

    return call


def _tensor(value):
    """`value`, a variable read as a tensor (this replica's copy)."""
    if isinstance(value, keras.Variable):
        value = value.value
    if isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value)
    return value


class _Kernels(NamedTuple):
    """A codec's operations, each one XLA kernel (no float32 buffer).

    Attributes:
        add: `add(acc, grad, (weight, starting), draw, index)`: `acc +
            grad * weight` (`grad * weight` where `starting`) in float32,
            encoded into `acc`'s dtype (`AccumulatorCodec.add`).
        quotient: `quotient(acc, divisor)` (`AccumulatorCodec.quotient`).
        squares: `squares(acc)` (`AccumulatorCodec.squares`).
    """

    add: Callable
    quotient: Callable
    squares: Callable


@functools.cache
def _kernels(codec) -> _Kernels:
    """`codec`'s `_Kernels`, made once per codec (and shared by every
    model: `_xla_kernel` says why that is safe)."""

    def add(acc, grad, weighting, draw, index):
        weight, starting = weighting
        value = tf.cast(grad, ACC_DTYPE) * weight
        return codec.add(acc, value, starting, draw, index)

    return _Kernels(
        _xla_kernel(add),
        _xla_kernel(codec.quotient),
        _xla_kernel(codec.squares),
    )


def _value(value):
    """A tensor of a counter, read where it is a variable."""
    return value.value if isinstance(value, keras.Variable) else value


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
