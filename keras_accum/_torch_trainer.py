"""The PyTorch side of `AccumModel`: its eager train step.

Keras's PyTorch trainer runs `train_step(data)` eagerly: a forward pass,
`loss.backward()` into each weight's `.grad`, then `optimizer.apply` in
place under `torch.no_grad()`. Here the backward pass differentiates the
micro-batch's window objective instead (shared with the other backends,
`AccumModel._window_objective`), and the window rules (`_window_rules.py`,
shared with JAX) advance the window's variables: read, accumulate, close
with a Python `if` around the in-place optimizer apply, write back.

`TorchAccumTrainer` is a base of `AccumModel` on the PyTorch backend only,
the way Keras picks its trainer by backend.
"""

from __future__ import annotations

import warnings

import keras
import torch
from keras.src import tree
from keras.src.optimizers.loss_scale_optimizer import LossScaleOptimizer
from keras.src.trainers.data_adapters import data_adapter_utils

from keras_accum import _window_rules
from keras_accum._backend_support import check_model


class TorchAccumTrainer:
    """Accumulation for Keras's PyTorch trainer; a base of `AccumModel`."""

    def _symbolic_build(self, iterator=None, data_batch=None):
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)
        self._ensure_window()

    def get_compile_config(self):
        config = super().get_compile_config()
        optimizer = (config or {}).get("optimizer")
        module = (
            optimizer.get("module") if isinstance(optimizer, dict) else None
        )
        if module and module.startswith("keras.src.backend.torch."):
            # Keras on PyTorch swaps `keras.optimizers.Adam` and its kin for
            # fused subclasses (`TorchOptimizer.__new__`) and saves their
            # module, which no other backend can use (Keras 3.15 loads them
            # and then fails in `fit`). The public class gives the same
            # optimizer on every backend, the fused one again on PyTorch.
            config["optimizer"] = {
                **optimizer,
                "module": "keras.optimizers",
                "registered_name": None,
            }
        return config

    def make_train_function(self, force=False):
        if self.train_function is not None and not force:
            return self.train_function
        check_model(self)
        if self.steps_per_execution > 1:
            # As Keras's own PyTorch trainer.
            raise ValueError(
                "`steps_per_execution` must be 1 with the PyTorch backend. "
                f"Received: steps_per_execution={self.steps_per_execution}"
            )

        def one_step_on_data(data):
            # `AccumModel.train_step` is the TensorFlow step.
            return self._torch_train_step(data[0])

        if self._should_torch_compile():
            one_step_on_data = torch.compile(one_step_on_data)
        self.train_function = one_step_on_data
        return self.train_function

    def _torch_train_step(self, data):
        x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
        window_state = self._window_for_step()

        # Forward pass; the leftover gradients of the last step cleared.
        if self._call_has_training_arg:
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)
        self.zero_grad()
        loss = self._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True
        )
        batch_size = next(i for i in tree.flatten(x) if i is not None).shape[0]
        self._loss_tracker.update_state(loss, sample_weight=batch_size)

        # Weight the micro-batch by its share of the window's loss.
        objective, weight, normalizer, term = self._micro_batch_share(
            loss, y, y_pred, sample_weight, batch_size, window_state
        )

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
            return self.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )

        # Gradients; a weight the loss does not reach has none, and gets
        # none at the update either, as in a plain step (no momentum or
        # weight decay for it).
        objective.backward()
        grads = [v.value.grad for v in self.trainable_weights]
        self._window_none_grads = [g is None for g in grads]
        gradients = [
            torch.zeros_like(v.value) if g is None else g
            for g, v in zip(grads, self.trainable_weights, strict=True)
        ]

        # Added to the window; applied once per window, in the step.
        with torch.no_grad():
            window = _window_rules.accumulate(
                window_state.read(),
                gradients,
                weight,
                normalizer,
                term,
                batch_size,
                self._scheduled_length(self.optimizer.iterations.value),
                self._noise_scale_every,
                add_to_accumulators=_add_in_place,
            )
            # Eager: the window closes only when it is complete, so the
            # other micro-batches skip the close's passes over the
            # accumulators (finiteness) and its ring writes.
            complete = _window_rules.is_complete(
                window, self._partial_window == "apply"
            )
            if bool(complete):
                window = self._close(window, True)
            window_state.write(window)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _close(self, window, should_close):
        applied = []

        def update(go, gradients):
            applied.append(go)
            return self._torch_update(go, gradients)

        window = _window_rules.close(
            window,
            should_close,
            update,
            scales_loss=isinstance(self.optimizer, LossScaleOptimizer),
            noise_every=self._noise_scale_every,
            loss_scale=self.optimizer.scale_loss(keras.ops.ones((), "float32")),
        )
        # After the update, as on TensorFlow (`AccumBatchNormalization`).
        for hook in self._window.close_hooks:
            hook(applied[0], should_close)
        return window

    def _torch_update(self, go, gradients):
        """`_window_rules.close`'s update: in place, only where `go` holds."""
        if bool(go):
            variables = self.trainable_weights
            none_grads = self._window_none_grads or [False] * len(variables)
            grads = [
                None if none else keras.ops.cast(g, v.dtype)
                for g, v, none in zip(
                    gradients(), variables, none_grads, strict=True
                )
            ]
            self.optimizer.apply(grads, variables)
        return self.optimizer.iterations.value

    def _make_value_flush_function(self):
        window_state = self._window

        def flush():
            with torch.no_grad():
                window = window_state.read()
                if bool(window["mini_step"] > 0):
                    window = self._close(window, True)
                    window_state.write(window)

        return flush


def _add_in_place(accs, grads, weight, starting):
    """`_window_rules.add_weighted`, writing into the accumulators.

    The same rule (a window's first micro-batch overwrites, later ones
    add), without the new tensors the functional form allocates per
    accumulator and micro-batch.
    """
    first = bool(starting)
    for acc, grad in zip(accs, grads, strict=True):
        grad = grad.to(acc.dtype)
        if first:
            torch.mul(grad, weight, out=acc)
        else:
            acc.addcmul_(grad, weight)
    return accs
