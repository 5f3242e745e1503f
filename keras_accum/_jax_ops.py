"""The window's operations in JAX's stateless step, as values.

`JaxOps` is the one-device `WindowOps`; `_jax_devices.PartialSumOps`
extends it where each device keeps its own partial sum of the window.
"""

from __future__ import annotations

import jax
import keras

from keras_accum import _window
from keras_accum._codecs import codec_of


class JaxOps(_window.WindowOps):
    """The accumulators and optimizer of JAX's stateless step, as values.

    Each operation returns or keeps new values (`accumulators`,
    `trainable`, `optimizer_values`), which the step puts in its state.
    Subclasses change how the accumulators become the window's sum
    (`_sums`), how a micro-batch's squares are taken (`_squares_added`) and
    what the accumulators hold after an update (`_after_update`).
    """

    def __init__(self, accumulators, optimizer, trainable, optimizer_values):
        self.accumulators = list(accumulators)
        self.trainable = list(trainable)
        self.optimizer_values = list(optimizer_values)
        self._optimizer = optimizer

    def _sums(self, values):
        """The window's sums the accumulators `values` hold."""
        return list(values)

    def _squares_added(self, added, sampled):
        """The sum of the squares of a micro-batch's `added` gradients
        where `sampled`, else zero."""
        squares = _window.sum_of_squares(added)
        return keras.ops.where(sampled, squares, keras.ops.zeros_like(squares))

    def _after_update(self, window_gradients, accumulators):
        """The accumulators' values after an update. The window's gradient
        (the next micro-batch overwrites it): XLA then divides each
        accumulator into its own buffer, where a quotient of every weight
        alive until the apply would cost a copy of the weights. A
        low-precision accumulator's quotient is in its own dtype
        (`AccumulatorCodec.quotient`): into its own buffer too."""
        del accumulators
        return list(window_gradients)

    def add(self, grads, weight, starting, sampled, draw=None):
        added = []
        for grad in grads:
            value = keras.ops.cast(grad, _window.ACC_DTYPE)
            added.append(value if weight is None else value * weight)
        # XLA fuses each sum, its bits and its rounding into one pass over
        # the weight: no float32 copy of the model.
        self.accumulators = [
            codec_of(acc.dtype).add(acc, value, starting, draw, i)
            for i, (acc, value) in enumerate(
                zip(self.accumulators, added, strict=True)
            )
        ]
        if sampled is None:
            return None
        return self._squares_added(added, sampled)

    def all_finite(self, closing=True):
        if closing is True:
            return _window.all_finite(self.accumulators)
        # The step runs the close's stages on every micro-batch; in a
        # conditional, the others skip this pass over the accumulators.
        return jax.lax.cond(
            closing, _window.all_finite, _finite_anyway, self.accumulators
        )

    def sum_of_squares(self, closing=True):
        return _window.sum_of_squares(self.accumulators)

    def gradients(self, divisor):
        return [quotient(acc, divisor) for acc in self._sums(self.accumulators)]

    def apply(self, go, divisor):
        optimizer = self._optimizer

        def apply(trainable, optimizer_values, accumulators):
            window_gradients = [
                quotient(acc, divisor) for acc in self._sums(accumulators)
            ]
            grads = [
                keras.ops.cast(g, value.dtype)
                for g, value in zip(window_gradients, trainable, strict=True)
            ]
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
            after = self._after_update(window_gradients, accumulators)
            return trainable, optimizer_values, after

        def keep(trainable, optimizer_values, accumulators):
            return list(trainable), list(optimizer_values), list(accumulators)

        # Only the chosen branch runs: one optimizer apply per window.
        self.trainable, self.optimizer_values, self.accumulators = jax.lax.cond(
            go,
            apply,
            keep,
            self.trainable,
            self.optimizer_values,
            self.accumulators,
        )
        return self.optimizer_values[iterations_index(optimizer)]


def quotient(total, divisor):
    """The window's gradient from its sum `total`, as its codec encodes it
    (`AccumulatorCodec.quotient`)."""
    return codec_of(total.dtype).quotient(total, divisor)


def only_if(condition, function, values):
    """`function(values)` where `condition` holds, else zero; in a
    conditional, so that the others skip its work."""
    if condition is True:
        return function(values)
    return jax.lax.cond(condition, function, _zero_anyway, values)


def _zero_anyway(values):
    del values
    return jax.numpy.zeros((), _window.ACC_DTYPE)


def _finite_anyway(accumulators):
    del accumulators
    return jax.numpy.asarray(True)


def iterations_index(optimizer):
    """Where `optimizer.iterations` sits in the optimizer's values."""
    return next(
        i
        for i, variable in enumerate(optimizer.variables)
        if variable is optimizer.iterations
    )


def close_policy(model, backend):
    """The model's `ClosePolicy`, the loss scale read from the optimizer's
    values in `backend` (a stateless step's)."""
    mapping = list(
        zip(model.optimizer.variables, backend.optimizer_values, strict=True)
    )
    with keras.StatelessScope(state_mapping=mapping):
        loss_scale = model.optimizer.scale_loss(keras.ops.ones((), "float32"))
    return model._close_policy(loss_scale)


def run_close_hooks(model, non_trainable, applied, closing):
    """Runs the window's close hooks on the model's non-trainable values.

    Returns:
        The new non-trainable values.
    """
    hooks = model._window.close_hooks
    if not hooks:
        return non_trainable
    mapping = list(
        zip(model.non_trainable_variables, non_trainable, strict=True)
    )
    with keras.StatelessScope(state_mapping=mapping) as scope:
        for hook in hooks:
            hook(applied, closing)
    return [scope.get_current_value(v) for v in model.non_trainable_variables]
