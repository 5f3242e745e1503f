"""The PyTorch side of `AccumModel`: its eager train step.

Keras's PyTorch trainer runs `train_step(data)` eagerly: a forward pass,
`loss.backward()` into each weight's `.grad`, then `optimizer.apply` in
place under `torch.no_grad()`. `TorchAccumTrainer.train_step` is that step
with the backward pass on the micro-batch's share of the window
(`AccumTrainer._micro_batch_share`) and the update replaced by the window
rules (`_window.py`): accumulate in place, then, once the window is
complete, a Python `if` around the in-place optimizer apply.
`TorchAccumTrainer` is a base of `AccumModel` on the PyTorch backend only,
the way Keras picks its trainer by backend.
"""

from __future__ import annotations

import warnings

import keras
import torch

from keras_accum import _window
from keras_accum._trainer import AccumTrainer


class TorchAccumTrainer(AccumTrainer):
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

    def train_step(self, data):
        # Unpack.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
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
        batch_size = next(
            i for i in keras.tree.flatten(x) if i is not None
        ).shape[0]
        self._loss_tracker.update_state(loss, sample_weight=batch_size)

        # Scale: the micro-batch's share of the window's loss.
        if batch_size == 1:
            # Under `torch.compile` (torch 2.13), a one-sample micro-batch's
            # loss and its share traced into one graph came out without a
            # gradient ("element 0 of tensors does not require grad"); a
            # graph break between them avoids it. A no-op when eager.
            torch._dynamo.graph_break()
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

        # Apply: into the window, and the window once it is complete.
        with torch.no_grad():
            window = _window.accumulate(
                window_state.values(),
                gradients,
                weight,
                normalizer,
                term,
                batch_size,
                self._scheduled_length(self.optimizer.iterations.value),
                self._noise_scale_every,
                add=_add_in_place,
            )
            # Eager: the window closes only when it is complete, so the
            # other micro-batches skip the close's passes over the
            # accumulators (finiteness) and its ring writes.
            complete = _window.is_complete(
                window, self._partial_window == "apply"
            )
            if bool(complete):
                window = self._close(window, True)
            window_state.write(window)

        # Metrics.
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _close(self, window, should_close):
        window, applied = _window.close(
            window,
            should_close,
            self._torch_update,
            scales_loss=isinstance(
                self.optimizer, keras.optimizers.LossScaleOptimizer
            ),
            noise_every=self._noise_scale_every,
            loss_scale=self.optimizer.scale_loss(keras.ops.ones((), "float32")),
            divide=_divide_in_place,
        )
        # After the update, as on TensorFlow (`AccumBatchNormalization`).
        for hook in self._window.close_hooks:
            hook(applied, should_close)
        return window

    def _torch_update(self, go, gradients):
        """`_window.close`'s update: in place, only where `go` holds."""
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

    def _make_flush_function(self):
        window_state = self._window

        def flush():
            with torch.no_grad():
                window = window_state.values()
                if bool(window["mini_step"] > 0):
                    window = self._close(window, True)
                    window_state.write(window)

        return flush


def _add_in_place(window, grads, weight, starting, measure):
    """`_window.add_weighted`, writing into the accumulators.

    The same rule (a window's first micro-batch overwrites, later ones
    add), without the new tensors the functional form allocates per
    accumulator and micro-batch.
    """
    accs = window["acc_grads"]
    first = bool(starting)
    squares = None if measure is None else keras.ops.zeros((), "float32")
    for acc, grad in zip(accs, grads, strict=True):
        grad = grad.to(acc.dtype)
        if measure is not None and bool(measure):
            squares = squares + torch.sum(torch.square(grad * weight))
        if first:
            torch.mul(grad, weight, out=acc)
        else:
            acc.addcmul_(grad, weight)
    return accs, squares


def _divide_in_place(accs, divisor):
    """The window's gradient, divided in place: the optimizer gets the
    accumulators themselves, so an update needs no second gradient-sized
    buffer per weight. (A window's first micro-batch overwrites them.)"""
    for acc in accs:
        acc.div_(divisor)
    return accs
