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

from keras_accum import _batch_ops, _compat, _window
from keras_accum._torch_batch import TorchBatchOps
from keras_accum._torch_batch import assign_in_place as _assign_in_place
from keras_accum._torch_batch import read_counters as _read
from keras_accum._trainer import AccumTrainer

ACC = getattr(torch, _window.ACC_DTYPE)


class TorchAccumTrainer(AccumTrainer):
    """Accumulation for Keras's PyTorch trainer; a base of `AccumModel`."""

    # What a split batch's steps (`_batch_ops.py`) work with.
    _batch_ops_class = TorchBatchOps

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
        if self._micro_batch_size is None:
            return self._micro_batch_step(data)
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_train_step(
                self._batch_ops_class(self), (), data
            )
        return _batch_ops.train_step(self._batch_ops_class(self), (), data)

    def test_step(self, data):
        if self._micro_batch_size is None:
            return super().test_step(data)
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_test_step(
                self._batch_ops_class(self), (), data
            )
        return _batch_ops.test_step(self._batch_ops_class(self), (), data)

    def predict_step(self, data):
        if self._micro_batch_size is None:
            return super().predict_step(data)
        return _batch_ops.predict_step(self._batch_ops_class(self), (), data)

    def _micro_batch_step(self, data, track=True, closes=True, length=None):
        """Keras's step on `data`, its update replaced by the window's;
        `length`: the pieces of a split batch, which make its window
        (`closes`: whether this piece may close it), else None."""
        # Unpack.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)

        # Forward pass; the leftover gradients of the last step cleared.
        if _compat.call_takes_training(self):
            y_pred = self(x, training=True)
        else:
            y_pred = self(x)
        self.zero_grad()
        loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
        batch_size = next(
            i for i in keras.tree.flatten(x) if i is not None
        ).shape[0]
        if track:
            _compat.track_loss(self, loss, batch_size)
        # Collected once, after the forward pass (which may build layers):
        # each `trainable_weights` walks the layers.
        variables = self.trainable_weights
        window_state = self._window_for_step(variables)

        # Scale: the micro-batch's share of the window's loss.
        objective, share = self._micro_batch_share(
            loss, y_pred, sample_weight, batch_size, length=length
        )

        if not variables:
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
        grads = [v.value.grad for v in variables]
        none_grads = [g is None for g in grads]
        self._life.none_grads = none_grads
        gradients = [
            torch.zeros_like(v.value) if g is None else g
            for g, v in zip(grads, variables, strict=True)
        ]

        # Apply: into the window, and the window once it is complete.
        with torch.no_grad():
            backend = self._torch_ops(variables)
            read = _read(window_state)
            counters, complete = _window.accumulate(
                read,
                backend,
                gradients,
                share,
                self._plan(self.optimizer.iterations.value, length),
            )
            # Eager: only a complete window closes, so the other
            # micro-batches skip the close's passes over the accumulators
            # (finiteness) and its ring writes.
            if closes and bool(complete):
                counters = self._close(counters, backend)
            window_state.write(counters, read, _assign_in_place)

        # Metrics.
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _torch_ops(self, variables=None):
        if variables is None:
            variables = self.trainable_weights
        none_grads = self._life.none_grads or [False] * len(variables)
        return TorchOps(self._window, self.optimizer, variables, none_grads)

    def _close(self, counters, backend):
        loss_scale = self.optimizer.scale_loss(keras.ops.ones((), "float32"))
        counters, applied = _window.close(
            counters, backend, True, self._close_policy(loss_scale)
        )
        # After the update, as on TensorFlow (`AccumBatchNormalization`).
        for hook in self._window.close_hooks:
            hook(applied, True)
        return counters

    def _make_flush_function(self):
        window_state = self._window

        def flush():
            with torch.no_grad():
                read = _read(window_state)
                if bool(read.mini_step > 0):
                    counters = self._close(read, self._torch_ops())
                    window_state.write(counters, read, _assign_in_place)

        return flush


class TorchOps(_window.WindowOps):
    """The accumulators and optimizer of PyTorch's eager step, in place.

    Args:
        state: The `WindowState`.
        optimizer: The model's optimizer.
        variables: The trainable variables, in the accumulators' order.
        none_grads: For each variable, whether its gradient is None: it
            gets None at the update too.
    """

    def __init__(self, state, optimizer, variables, none_grads):
        self.accumulators = [
            _compat.backing_value(acc) for acc in state.acc_grads
        ]
        self.codecs = state.codecs
        self.exact = state.exact
        self.optimizer = optimizer
        self.variables = variables
        self.none_grads = none_grads

    def add(self, grads, weight, starting, sampled, draw=None):
        # Not divided here: in place at the close (`gradients`).
        accs = self.accumulators
        first = bool(starting)
        if not self.exact:
            return self._add_encoded(grads, weight, first, sampled, draw)
        grads = [g.to(acc.dtype) for g, acc in zip(grads, accs, strict=True)]
        if weight is None:
            # One call for every accumulator: on a small model, a call per
            # tensor from Python costs more than the adds.
            if first:
                torch._foreach_copy_(accs, grads)
            else:
                torch._foreach_add_(accs, grads)
        else:
            for acc, grad in zip(accs, grads, strict=True):
                if first:
                    torch.mul(grad, weight, out=acc)
                else:
                    acc.addcmul_(grad, weight)
            grads = [grad * weight for grad in grads] if sampled else grads
        if sampled is None:
            return None
        if not bool(sampled):
            return torch.zeros((), dtype=ACC)
        return _window.sum_of_squares(grads)

    def _add_encoded(self, grads, weight, first, sampled, draw):
        # One weight at a time: each low-precision sum is made in float32
        # and encoded into its accumulator before the next weight's.
        added = []
        for i, (acc, grad, codec) in enumerate(
            zip(self.accumulators, grads, self.codecs, strict=True)
        ):
            value = grad.to(ACC)
            if weight is not None:
                value = value * weight
            if codec.exact:
                if first:
                    acc.copy_(value)
                else:
                    acc.add_(value)
            else:
                acc.copy_(codec.add(acc, value, first, draw, i))
            if sampled is not None and bool(sampled):
                added.append(value)
        if sampled is None:
            return None
        if not added:
            return torch.zeros((), dtype=ACC)
        return _window.sum_of_squares(added)

    def all_finite(self, closing=True):
        # `closing` unread: only a closing window asks.
        # `_window.sums_finite`'s test, on norms: one call for every
        # accumulator, and an inf or NaN still stays in the total. A large
        # finite total may overflow, and asks for the elementwise test.
        # A bfloat16 accumulator's norm as it is (float32's range): a cast
        # of each would be a float32 copy of the model.
        norms = torch._foreach_norm(self.accumulators, 2)
        if bool(torch.isfinite(torch.stack([n.to(ACC) for n in norms]).sum())):
            return torch.tensor(True)
        return _window.all_finite(self.accumulators)

    def sum_of_squares(self, closing=True):
        # `closing` unread: an eager close runs only when it closes.
        return _window.sum_of_squares(self.accumulators)

    def gradients(self, divisor):
        # In place: the optimizer gets the accumulators themselves, so an
        # update needs no second gradient-sized buffer per weight. (A
        # window's first micro-batch overwrites them.)
        pairs = list(zip(self.accumulators, self.codecs, strict=True))
        exact = [acc for acc, codec in pairs if codec.exact]
        if exact:
            torch._foreach_div_(exact, divisor)
        for acc, codec in pairs:
            if not codec.exact:
                # Divided in float32, one weight at a time, and encoded
                # into the accumulator whatever the weight's dtype
                # (`AccumulatorCodec.quotient` says why).
                acc.copy_(codec.quotient(acc, divisor))
        return list(self.accumulators)

    def apply(self, go, divisor):
        if bool(go):
            grads = [
                None if none else g.to(v.value.dtype)
                for g, v, none in zip(
                    self.gradients(divisor),
                    self.variables,
                    self.none_grads,
                    strict=True,
                )
            ]
            self.optimizer.apply(grads, self.variables)
        return self.optimizer.iterations.value
