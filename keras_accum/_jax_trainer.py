"""The JAX side of `AccumModel`: its stateless train step and state plumbing.

Keras's JAX trainer runs `train_step(state, data) -> (logs, state)`, jitted,
with `state = (trainable, non_trainable, optimizer, metrics)` values. The
window's values (`_jax_window.JaxWindowState`) ride at the end of the
optimizer slot: Keras then hands them to the step, donates their buffers,
and keeps them across steps like the optimizer's own state, and callbacks
that sync the model mid-epoch see them too.

`JaxAccumTrainer` is a base of `AccumModel` on the JAX backend only, the way
Keras picks its trainer by backend. It overrides the Keras JAX trainer's
hooks (`make_train_function`, `_get_jax_state`, `jax_state_sync`,
`_symbolic_build`); where `AccumModel` itself defines a method that differs
by backend, that method calls the JAX one here (`_ensure_jax_window`,
`_make_jax_flush_function`).
"""

from __future__ import annotations

import warnings

import jax
import keras
from keras.src import backend, tree
from keras.src.backend.config import is_nnx_enabled
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_accum import _jax_window
from keras_accum.callbacks import PseudoBatchLogger
from keras_accum.layers import AccumBatchNormalization


def unsupported(feature: str, received: str) -> NotImplementedError:
    """The error for a feature the JAX backend does not support yet."""
    return NotImplementedError(
        f"{feature} is not supported on the jax backend yet. Use the "
        "TensorFlow backend for it (`export KERAS_BACKEND=tensorflow` "
        f"before Python imports Keras). Received: {received}"
    )


def check_accum_steps(accum_steps) -> None:
    """Refuses what the JAX step cannot honour in `accum_steps`."""
    if callable(accum_steps):
        raise unsupported(
            "An `accum_steps` callable (a schedule of the update count)",
            f"accum_steps={accum_steps!r}. An int or a schedule by epoch "
            "(`{epoch: steps}`) works on jax",
        )


def check_fit_callbacks(callbacks) -> None:
    """Refuses callbacks that need what the JAX step does not compute."""
    for callback in callbacks:
        if not isinstance(callback, PseudoBatchLogger):
            continue
        name = type(callback).__name__
        # The estimates come from sums of squares only the TensorFlow step
        # takes.
        if callback.noise_scale:
            raise unsupported(
                f"`{name}(noise_scale=True)` (the gradient noise scale)",
                f"noise_scale=True in callbacks=[..., {callback!r}, ...]. "
                f"`{name}()` without it works on jax",
            )
        # Its event files are written with `tf.summary`.
        if callback.log_dir is not None:
            raise unsupported(
                f"`{name}(log_dir=...)` (TensorBoard scalars of the "
                "pseudo-batch loss)",
                f"log_dir={callback.log_dir!r} in callbacks=[..., "
                f"{callback!r}, ...]. `{name}()` without it works on jax",
            )


class JaxAccumTrainer:
    """Accumulation for Keras's JAX trainer; a base of `AccumModel` on JAX."""

    # -- Building the window state before tracing ---------------------------

    def _symbolic_build(self, iterator=None, data_batch=None):
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        # The window's values must be in the state handed to the first step.
        self._ensure_window()

    def _ensure_jax_window(self):
        if self._window is not None or getattr(self, "optimizer", None) is None:
            return
        if not all(layer.built for layer in self._flatten_layers()):
            return
        self._check_jax_support()
        if not self.optimizer.built:
            self.optimizer.build(self.trainable_variables)
        self._window = _jax_window.JaxWindowState(
            self.trainable_weights, self._steps_for_now() or 1
        )
        self._window_refs = [id(v) for v in self.trainable_weights]
        self._window.steps_per_epoch.assign(self._steps_per_epoch)

    def _check_jax_support(self):
        batch_norms = [
            layer.name
            for layer in self._flatten_layers()
            if isinstance(layer, AccumBatchNormalization)
        ]
        if batch_norms:
            raise unsupported(
                "`AccumBatchNormalization`",
                f"layers {batch_norms} in model {self.name!r}. "
                "`keras.layers.BatchNormalization` works on jax (moving "
                "statistics updated per micro-batch)",
            )
        optimizer = getattr(self, "optimizer", None)
        if isinstance(optimizer, LossScaleOptimizer):
            raise unsupported(
                "A `LossScaleOptimizer` (mixed precision)",
                f"optimizer={optimizer.name!r}",
            )
        if keras.distribution.distribution() is not None:
            raise unsupported(
                "`keras.distribution`",
                f"distribution={keras.distribution.distribution()!r}",
            )
        if is_nnx_enabled():
            raise unsupported("Flax NNX mode", "nnx enabled in Keras config")

    # -- State plumbing: the window rides in the optimizer slot -------------

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

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return
        self._check_jax_support()
        # `AccumModel.train_step` is the TensorFlow step; this is the JAX one.
        step = self._jax_train_step
        if not self.run_eagerly and self.jit_compile:
            step = jax.jit(step, donate_argnums=0)
        self.train_function = self._make_function(step)

    def _jax_train_step(self, state, data):
        trainable, non_trainable, optimizer_and_window, metrics = state
        count = len(self.optimizer.variables)
        optimizer_values = list(optimizer_and_window[:count])
        window_state = self._window_for_step()
        window = window_state.unpack(optimizer_and_window[count:])
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        batch_size = next(i for i in tree.flatten(x) if i is not None).shape[0]

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )

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

        # Added to the window; applied once per window, in the step.
        window = _jax_window.accumulate(
            window, grads, weight, normalizer, term, batch_size
        )
        complete = _jax_window.is_complete(
            window, self._partial_window == "apply"
        )
        window, trainable, optimizer_values = _jax_window.close(
            window, complete, self.optimizer, trainable, optimizer_values
        )

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
        into the micro-batch's share of the window by `_window_objective`
        (shared with the TensorFlow step), with the window's values mapped
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
        ]
        if losses:
            # The forward pass's losses (regularization included), for
            # `compute_loss` and the window's regularization term.
            self._losses_override.clear()
            self._losses_override = losses
        try:
            with backend.StatelessScope(state_mapping=mapping) as scope:
                loss = self._compute_loss(
                    x,
                    y,
                    y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
                objective, weight, normalizer = self._window_objective(
                    loss, y, y_pred, sample_weight, batch_size, self._window
                )
        finally:
            if losses:
                self._losses_override.clear()
        non_trainable = [
            scope.get_current_value(v) for v in self.non_trainable_variables
        ]
        metrics = [scope.get_current_value(v) for v in self.metrics_variables]
        term = keras.ops.cast(objective, "float32") * weight
        optimizer_mapping = list(
            zip(self.optimizer.variables, optimizer_values, strict=True)
        )
        with backend.StatelessScope(state_mapping=optimizer_mapping):
            scaled = self.optimizer.scale_loss(objective)
        aux = (loss, y_pred, non_trainable, metrics, weight, normalizer, term)
        return scaled, aux

    # -- Applying an open window outside the step ---------------------------

    def _make_jax_flush_function(self):
        window_state = self._window
        optimizer = self.optimizer

        def flush_step(trainable, optimizer_values, window_values):
            window = window_state.unpack(window_values)
            window, trainable, optimizer_values = _jax_window.close(
                window,
                window["mini_step"] > 0,
                optimizer,
                trainable,
                optimizer_values,
            )
            return trainable, optimizer_values, window_state.pack(window)

        if not self.run_eagerly and self.jit_compile:
            flush_step = jax.jit(flush_step)

        def flush():
            # Reattach values a running epoch holds, if any.
            self.jax_state_sync()
            groups = (
                self.trainable_variables,
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
