"""The JAX side of `AccumModel`: its stateless train step and state plumbing.

Keras's JAX trainer runs `train_step(state, data) -> (logs, state)`, jitted,
with `state = (trainable, non_trainable, optimizer, metrics)` values. The
window's values (`_window.WindowState`) ride at the end of the
optimizer slot: Keras then hands them to the step, donates their buffers,
and keeps them across steps like the optimizer's own state, and callbacks
that sync the model mid-epoch see them too.

`JaxAccumTrainer` is a base of `AccumModel` on the JAX backend only, the way
Keras picks its trainer by backend. Its `train_step(state, data)` is the one
Keras's own `make_train_function` jits (donating the state's buffers); it
runs the window rules (`_window.py`) on the window's values, with
`jax.lax.cond` around the stateless optimizer apply. It also overrides the
hooks that carry the window in the state (`_get_jax_state`,
`jax_state_sync`, `_get_state_sharding_spec`) and `_symbolic_build`.
"""

from __future__ import annotations

import warnings
from typing import Any, NamedTuple

import jax
import jax.experimental.sparse
import keras

from keras_accum import _batch_ops, _compat, _jax_devices, _window
from keras_accum._jax_batch import JaxBatchOps, current_values
from keras_accum._jax_ops import (
    close_policy,
    iterations_index,
    run_close_hooks,
)
from keras_accum._trainer import AccumTrainer


class JaxAccumTrainer(AccumTrainer):
    """Accumulation for Keras's JAX trainer; a base of `AccumModel` on JAX."""

    _TRAIN_STEP_ARGS = "state, data"
    # What a split batch's steps (`_batch_ops.py`) work with.
    _batch_ops_class = JaxBatchOps

    # -- Building the window state before tracing -----------------------------

    def _symbolic_build(self, iterator=None, data_batch=None):
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        # The window's values must be in the state handed to the first step.
        self._ensure_window()

    def _create_window(self, length, close_hooks, make_variable=None):
        axis = _jax_devices.batch_axis(self.trainable_weights)
        if axis is None:
            return super()._create_window(length, close_hooks)
        # Each device keeps its own partial sum (`_jax_devices`).
        window = super()._create_window(
            length, close_hooks, _jax_devices.partial_sum_variables(axis)
        )
        window.hold_partial_sums(_jax_devices.summed_on_host)
        return window

    # -- State plumbing: the window rides in the optimizer slot ---------------

    def _get_jax_state(
        self,
        trainable_variables=False,
        non_trainable_variables=False,
        optimizer_variables=False,
        metrics_variables=False,
        purge_model_variables=False,
    ):
        state = super()._get_jax_state(
            trainable_variables=trainable_variables,
            non_trainable_variables=non_trainable_variables,
            optimizer_variables=optimizer_variables,
            metrics_variables=metrics_variables,
            purge_model_variables=purge_model_variables,
        )
        window = self._window
        if not optimizer_variables or window is None:
            return state
        state = list(state)
        slot = int(bool(trainable_variables)) + int(
            bool(non_trainable_variables)
        )
        state[slot] = [*state[slot], *(v.value for v in window.variables)]
        if purge_model_variables:
            # The step donates these buffers; `jax_state_sync` reattaches
            # the new values, as Keras does for the model's variables.
            for variable in window.variables:
                _compat.release_value(variable)
        return tuple(state)

    def _get_state_sharding_spec(self):
        specs = super()._get_state_sharding_spec()
        if self._window is None:
            return specs
        trainable, non_trainable, optimizer, metrics = specs
        window = [v.value.sharding for v in self._window.variables]
        return trainable, non_trainable, [*optimizer, *window], metrics

    def jax_state_sync(self):
        state, synced = _compat.jax_state(self)
        window = self._window
        if state and not synced and window is not None:
            values = state.get("optimizer_variables") or []
            count = len(self.optimizer.variables)
            if len(values) == count + len(window.variables):
                for variable, value in zip(
                    window.variables, values[count:], strict=True
                ):
                    variable.assign(value)
        # Keras pairs optimizer variables with values by `zip`: the window's
        # values at the end are left out.
        super().jax_state_sync()

    # -- The train step -------------------------------------------------------

    def _check_length_in_step(self, length, updates, message):
        if isinstance(length, jax.core.Tracer):
            # A jitted step cannot raise: the length is clamped (documented).
            return length
        return super()._check_length_in_step(length, updates, message)

    def train_step(self, state, data):
        if self._micro_batch_size is None:
            return self._micro_batch_step(state, data)
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_train_step(
                self._batch_ops_class(self), state, data
            )
        return _batch_ops.train_step(self._batch_ops_class(self), state, data)

    def test_step(self, state, data):
        if self._micro_batch_size is None:
            return super().test_step(state, data)
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_test_step(
                self._batch_ops_class(self), state, data
            )
        return _batch_ops.test_step(self._batch_ops_class(self), state, data)

    def predict_step(self, state, data):
        if self._micro_batch_size is None:
            return super().predict_step(state, data)
        return _batch_ops.predict_step(self._batch_ops_class(self), state, data)

    def _micro_batch_step(
        self, state, data, track=True, closes=True, length=None
    ):
        """Keras's step on `data`, its update replaced by the window's;
        `length`: the pieces of a split batch, which make its window
        (`closes`: whether this piece may close it), else None."""
        # Unpack: the window's values ride after the optimizer's.
        trainable, non_trainable, optimizer_and_window, metrics = state
        count = len(self.optimizer.variables)
        optimizer_values = list(optimizer_and_window[:count])
        window_state = self._window_for_step()
        accumulators, counters = window_state.unpack(
            optimizer_and_window[count:]
        )
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )

        # Forward pass, loss and its share of the window, and gradients.
        values = _StepValues(
            non_trainable, metrics, optimizer_values, counters, length=length
        )
        data = (x, y, sample_weight)
        if window_state.partial_sums:
            out = _gradients_per_device(self, trainable, values, data)
        else:
            out = _reduced_gradients(self, trainable, values, data)
        non_trainable, metrics = out.non_trainable, out.metrics

        # Apply: into the window, and the window once it is complete.
        backend = _jax_devices.ops_class(window_state)(
            accumulators, self.optimizer, trainable, optimizer_values
        )
        updates = optimizer_values[iterations_index(self.optimizer)]
        counters, complete = _window.accumulate(
            counters, backend, out.grads, out.share, self._plan(updates, length)
        )
        if closes:
            counters, applied = _window.close(
                counters, backend, complete, close_policy(self, backend)
            )
            non_trainable = run_close_hooks(
                self, non_trainable, applied, complete
            )

        # Metrics.
        if track:
            logs, metrics = _compat.update_metrics_variables(
                self, metrics, out.loss, x, y, out.y_pred, sample_weight
            )
        else:
            # A split batch's loss is tracked once, for the batch.
            mapping = list(zip(self.metrics_variables, metrics, strict=True))
            with keras.StatelessScope(state_mapping=mapping) as scope:
                logs = self.compute_metrics(x, y, out.y_pred, sample_weight)
            metrics = current_values(scope, self.metrics_variables)
        window = window_state.pack(backend.accumulators, counters)
        state = (
            backend.trainable,
            non_trainable,
            [*backend.optimizer_values, *window],
            metrics,
        )
        return logs, state

    def _jax_objective(self, trainable, values, x, y, sample_weight):
        """What the step differentiates: the micro-batch's window objective.

        Keras's `compute_loss_and_updates`, except that the loss is turned
        into the micro-batch's share of the window by `_micro_batch_share`
        (shared with the other backends), with the state's values mapped
        onto the variables (`values`: the `_StepValues` besides the
        differentiated `trainable`).

        Returns:
            `(scaled objective, _ObjectiveOut)`.
        """
        kwargs = {}
        if _compat.call_takes_training(self):
            kwargs["training"] = True
        y_pred, non_trainable, losses = self.stateless_call(
            trainable, values.non_trainable, x, return_losses=True, **kwargs
        )
        mapping = [
            *zip(self.trainable_variables, trainable, strict=True),
            *zip(self.non_trainable_variables, non_trainable, strict=True),
            *zip(self.metrics_variables, values.metrics, strict=True),
            *zip(
                self._window.counters.flat(),
                values.counters.flat(),
                strict=True,
            ),
            # For `scale_loss`.
            *zip(self.optimizer.variables, values.optimizer, strict=True),
        ]
        if losses:
            # The forward pass's losses (regularization included), for
            # `compute_loss` and the window's regularization term.
            _compat.override_losses(self, losses)
        try:
            with keras.StatelessScope(state_mapping=mapping) as scope:
                loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
                batch_size = next(
                    i for i in keras.tree.flatten(x) if i is not None
                ).shape[0]
                objective, share = self._micro_batch_share(
                    loss,
                    y_pred,
                    sample_weight,
                    batch_size,
                    values.device,
                    values.length,
                )
                if values.device is not None:
                    loss = _device_loss(self, loss, share, values.device)
        finally:
            if losses:
                _compat.override_losses(self, None)
        non_trainable = [
            scope.get_current_value(v) for v in self.non_trainable_variables
        ]
        metrics = [scope.get_current_value(v) for v in self.metrics_variables]
        return objective, _ObjectiveOut(
            loss, y_pred, non_trainable, metrics, share
        )

    # -- Applying an open window outside the step -----------------------------

    def _make_flush_function(self):
        window_state = self._window
        optimizer = self.optimizer

        def flush_step(trainable, non_trainable, optimizer_values, values):
            accumulators, counters = window_state.unpack(values)
            closing = counters.mini_step > 0
            backend = _jax_devices.ops_class(window_state)(
                accumulators, optimizer, trainable, optimizer_values
            )
            counters, applied = _window.close(
                counters, backend, closing, close_policy(self, backend)
            )
            non_trainable = run_close_hooks(
                self, non_trainable, applied, closing
            )
            return (
                backend.trainable,
                non_trainable,
                backend.optimizer_values,
                window_state.pack(backend.accumulators, counters),
            )

        if not self.run_eagerly and self.jit_compile:
            flush_step = jax.jit(flush_step)

        def flush():
            # Reattach values a running epoch holds, if any.
            self.jax_state_sync()
            groups = (
                self.trainable_variables,
                self.non_trainable_variables,
                optimizer.variables,
                window_state.variables,
            )
            results = flush_step(
                *([v.value for v in group] for group in groups)
            )
            for group, values in zip(groups, results, strict=True):
                for variable, value in zip(group, values, strict=True):
                    variable.assign(value)

        return flush


def _device_loss(model, loss, share, device):
    """A device's part of the loss a plain step reports: summed over
    devices and divided by the normalizer total, it is that loss."""
    if not isinstance(share.normalizer, float):
        return share.loss  # A mean: its value times its normalizer.
    # A sum: with the regularization on the first device only.
    regularization = model._regularization_loss(loss.dtype)
    return loss - keras.ops.cast(device != 0, loss.dtype) * regularization


def _reduced_gradients(model, trainable, values, data):
    """The micro-batch's gradient over all devices, as an
    `_ObjectiveOut`."""
    grad_fn = jax.value_and_grad(model._jax_objective, has_aux=True)
    (_, out), grads = grad_fn(trainable, values, *data)
    return out._replace(grads=grads)


def _gradients_per_device(model, trainable, values, data):
    """Each device's partial gradient, as an `_ObjectiveOut`
    (`_jax_devices`)."""
    axis = _jax_devices.batch_axis(model.trainable_weights)
    accumulators = model._window.acc_grads
    slots = int(accumulators[0].shape[0]) if accumulators else 1
    if (
        axis is None  # The distribution was unset since.
        or axis.size != slots
        or not _jax_devices.maps_over_devices(model, axis, data[0])
    ):
        # The reduced gradient, counted on the first device.
        out = _reduced_gradients(model, trainable, values, data)
        grads = out.grads
        if out.share.weight is not None:
            grads = [g * out.share.weight for g in grads]
            out = out._replace(share=out.share._replace(weight=None))
        return out._replace(grads=_jax_devices.in_first_slot(grads, slots))
    step = _jax_devices.per_device_gradients(
        model._jax_objective,
        axis,
        trainable,
        values,
        data,
        _jax_devices.seed_states(model),
    )
    return _ObjectiveOut(**step._asdict())


class _ObjectiveOut(NamedTuple):
    """What `_jax_objective` returns besides the objective."""

    loss: Any
    y_pred: Any
    non_trainable: list
    metrics: list
    share: _window.Share
    # Set by the step once differentiated.
    grads: Any = None


class _StepValues(NamedTuple):
    """The state's values a step maps onto the model's variables, besides
    the trainable ones it differentiates; `device` is the index of the
    device computing its own shard's gradient (`_jax_devices`), if any;
    `length` the pieces of a split batch (its window's length), else
    None."""

    non_trainable: list
    metrics: list
    optimizer: list
    counters: _window.Counters
    device: Any = None
    length: Any = None
