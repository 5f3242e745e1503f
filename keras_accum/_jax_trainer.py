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

import jax
import keras

from keras_accum import _window
from keras_accum._trainer import AccumTrainer


class JaxAccumTrainer(AccumTrainer):
    """Accumulation for Keras's JAX trainer; a base of `AccumModel` on JAX."""

    _TRAIN_STEP_ARGS = "state, data"

    # -- Building the window state before tracing -----------------------------

    def _symbolic_build(self, iterator=None, data_batch=None):
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        # The window's values must be in the state handed to the first step.
        self._ensure_window()

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
                variable._value = None
        return tuple(state)

    def _get_state_sharding_spec(self):
        specs = super()._get_state_sharding_spec()
        if self._window is None:
            return specs
        trainable, non_trainable, optimizer, metrics = specs
        window = [v.value.sharding for v in self._window.variables]
        return trainable, non_trainable, [*optimizer, *window], metrics

    def jax_state_sync(self):
        state = getattr(self, "_jax_state", None)
        window = self._window
        if state and not self._jax_state_synced and window is not None:
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
        # Unpack: the window's values ride after the optimizer's.
        trainable, non_trainable, optimizer_and_window, metrics = state
        count = len(self.optimizer.variables)
        optimizer_values = list(optimizer_and_window[:count])
        window_state = self._window_for_step()
        window = window_state.unpack(optimizer_and_window[count:])
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        batch_size = next(
            i for i in keras.tree.flatten(x) if i is not None
        ).shape[0]

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )

        # Forward pass, loss and its share of the window, and gradients.
        grad_fn = jax.value_and_grad(self._jax_objective, has_aux=True)
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics,
            window_state.pack(window),
            optimizer_values,
            x,
            y,
            sample_weight,
            batch_size,
        )
        loss, y_pred, non_trainable, metrics, weight, normalizer, term = aux

        scheduled = self._scheduled_length(
            optimizer_values[_iterations_index(self.optimizer)]
        )

        # Apply: into the window, and the window once it is complete.
        window = _window.accumulate(
            window,
            grads,
            weight,
            normalizer,
            term,
            batch_size,
            scheduled,
            self._noise_scale_every,
        )
        complete = _window.is_complete(window, self._partial_window == "apply")
        window, trainable, optimizer_values, applied = _close(
            window,
            complete,
            self.optimizer,
            trainable,
            optimizer_values,
            self._noise_scale_every,
        )
        non_trainable = self._run_close_hooks(non_trainable, applied, complete)

        # Metrics.
        logs, metrics = self._update_metrics_variables(
            metrics, loss, x, y, y_pred, sample_weight
        )
        state = (
            trainable,
            non_trainable,
            [*optimizer_values, *window_state.pack(window)],
            metrics,
        )
        return logs, state

    def _jax_objective(
        self,
        trainable,
        non_trainable,
        metrics,
        window_values,
        optimizer_values,
        x,
        y,
        sample_weight,
        batch_size,
    ):
        """What the step differentiates: the micro-batch's window objective.

        Keras's `compute_loss_and_updates`, except that the loss is turned
        into the micro-batch's share of the window by `_micro_batch_share`
        (shared with the other backends), with the window's values mapped
        onto its variables.

        Returns:
            `(scaled objective, (loss, y_pred, non_trainable, metrics,
            weight, normaliser, window loss term))`.
        """
        kwargs = {}
        if self._call_has_training_arg:
            kwargs["training"] = True
        y_pred, non_trainable, losses = self.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        mapping = [
            *zip(self.trainable_variables, trainable, strict=True),
            *zip(self.non_trainable_variables, non_trainable, strict=True),
            *zip(self.metrics_variables, metrics, strict=True),
            *zip(self._window.variables, window_values, strict=True),
            # For `scale_loss`.
            *zip(self.optimizer.variables, optimizer_values, strict=True),
        ]
        if losses:
            # The forward pass's losses (regularization included), for
            # `compute_loss` and the window's regularization term.
            self._losses_override.clear()
            self._losses_override = losses
        try:
            with keras.StatelessScope(state_mapping=mapping) as scope:
                loss = self._compute_loss(
                    x,
                    y,
                    y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
                scaled, weight, normalizer, term = self._micro_batch_share(
                    loss, y, y_pred, sample_weight, batch_size, self._window
                )
        finally:
            if losses:
                self._losses_override.clear()
        non_trainable = [
            scope.get_current_value(v) for v in self.non_trainable_variables
        ]
        metrics = [scope.get_current_value(v) for v in self.metrics_variables]
        aux = (loss, y_pred, non_trainable, metrics, weight, normalizer, term)
        return scaled, aux

    def _run_close_hooks(self, non_trainable, applied, closing):
        """Runs the window's close hooks on the model's non-trainable values.

        Returns:
            The new non-trainable values.
        """
        hooks = self._window.close_hooks
        if not hooks:
            return non_trainable
        mapping = list(
            zip(self.non_trainable_variables, non_trainable, strict=True)
        )
        with keras.StatelessScope(state_mapping=mapping) as scope:
            for hook in hooks:
                hook(applied, closing)
        return [
            scope.get_current_value(v) for v in self.non_trainable_variables
        ]

    # -- Applying an open window outside the step -----------------------------

    def _make_flush_function(self):
        window_state = self._window
        optimizer = self.optimizer

        noise_every = self._noise_scale_every

        def flush_step(trainable, non_trainable, optimizer_values, values):
            window = window_state.unpack(values)
            closing = window["mini_step"] > 0
            window, trainable, optimizer_values, applied = _close(
                window,
                closing,
                optimizer,
                trainable,
                optimizer_values,
                noise_every,
            )
            non_trainable = self._run_close_hooks(
                non_trainable, applied, closing
            )
            return (
                trainable,
                non_trainable,
                optimizer_values,
                window_state.pack(window),
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


def _close(
    window,
    should_close,
    optimizer,
    trainable_values,
    optimizer_values,
    noise_every=0,
):
    """`_window.close` with a stateless apply under `jax.lax.cond`.

    Returns:
        `(window, trainable_values, optimizer_values, applied)`: new values,
        and whether the optimizer applied the window.
    """
    new = {}

    def update(go, gradients):
        def apply(trainable_values, optimizer_values, accumulators):
            del accumulators  # `gradients()` reads them.
            window_gradients = gradients()
            grads = [
                keras.ops.cast(g, value.dtype)
                for g, value in zip(
                    window_gradients, trainable_values, strict=True
                )
            ]
            trainable, optimizer_new = optimizer.stateless_apply(
                optimizer_values, grads, trainable_values
            )
            # The window's gradient becomes the accumulators' value (the
            # next micro-batch overwrites it): XLA then divides each
            # accumulator into its own buffer, where a quotient of every
            # weight alive until the apply cost a copy of the weights
            # (measured, 7-layer MLP: the step's temporaries 1.0 P before,
            # 0.23 P now, 0.36 P for `Model(B)`).
            return trainable, optimizer_new, window_gradients

        def keep(trainable_values, optimizer_values, accumulators):
            return (
                list(trainable_values),
                list(optimizer_values),
                list(accumulators),
            )

        # Only the chosen branch runs: one optimizer apply per window.
        new["trainable"], new["optimizer"], new["acc_grads"] = jax.lax.cond(
            go,
            apply,
            keep,
            list(trainable_values),
            list(optimizer_values),
            list(window["acc_grads"]),
        )
        return new["optimizer"][_iterations_index(optimizer)]

    mapping = list(zip(optimizer.variables, optimizer_values, strict=True))
    with keras.StatelessScope(state_mapping=mapping):
        loss_scale = optimizer.scale_loss(keras.ops.ones((), "float32"))
    window, applied = _window.close(
        window,
        should_close,
        update,
        scales_loss=isinstance(optimizer, keras.optimizers.LossScaleOptimizer),
        noise_every=noise_every,
        loss_scale=loss_scale,
    )
    window = window.replace(acc_grads=new["acc_grads"])
    return window, new["trainable"], new["optimizer"], applied


def _iterations_index(optimizer):
    # Where `optimizer.iterations` sits in the optimizer's values.
    return next(
        i
        for i, variable in enumerate(optimizer.variables)
        if variable is optimizer.iterations
    )
