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

import contextlib
import warnings

import keras
import torch

from keras_accum import _compat, _window
from keras_accum._trainer import AccumTrainer

ACC = getattr(torch, _window.ACC_DTYPE)


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
        if self._micro_batch_size is None:
            return self._micro_batch_step(data)
        # The batch, split: each micro-batch's activations are freed before
        # the next one's forward pass (a Python loop); the last one closes
        # the window, one update for the batch.
        batch_size = _batch_size(data)
        size = self._split_size("train")
        count = int(self._split_count(batch_size, size))
        self._life.split_length = count
        try:
            for start in range(0, (count - 1) * size, size):
                self._micro_batch_step(
                    _sliced(data, start, start + size), track=False
                )
            self._micro_batch_step(
                _sliced(data, (count - 1) * size, batch_size), track=False
            )
        finally:
            self._life.split_length = None
        _compat.track_loss(
            self, self._batch_loss(_read(self._window)), batch_size
        )
        return self.get_metrics_result()

    def test_step(self, data):
        if self._micro_batch_size is None:
            return super().test_step(data)
        # The batch, split as in `train_step`: the loss is the batch's,
        # tracked once; the metrics add each micro-batch up.
        batch_size = _batch_size(data)
        size = self._split_size("test")
        term = normalizer = 0.0
        reg = None
        for start in range(0, batch_size, size):
            stop = min(start + size, batch_size)
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(
                _sliced(data, start, stop)
            )
            y_pred = self._predicted(x)
            loss = _compat.compute_loss(
                self, x, y, y_pred, sample_weight, training=False
            )
            reg = self._regularization_loss("float32")
            share = self._evaluated_share(
                loss, y_pred, sample_weight, stop - start, reg
            )
            term, normalizer = term + share[0], normalizer + share[1]
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        loss = self._evaluated_loss(term, normalizer, reg)
        _compat.track_loss(self, loss, batch_size)
        return self.get_metrics_result()

    def predict_step(self, data):
        if self._micro_batch_size is None:
            return super().predict_step(data)
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        batch_size = _batch_size(data)
        size = self._split_size("predict")
        pieces = [
            self._predicted(_sliced(x, start, min(start + size, batch_size)))
            for start in range(0, batch_size, size)
        ]
        return keras.tree.map_structure(
            lambda *parts: torch.cat(parts), *pieces
        )

    # -- Sizing the split (`_sizing.py`) -------------------------------------

    def _split_batches(self, kind, args):
        # Keras's functions take a list of batches.
        (batches,) = args
        return None, iter(batches)

    def _split_args(self, kind, state, batches):
        return (list(batches),)

    def _split_result(self, result):
        return result, None

    def _split_outputs(self, outputs, state):
        return outputs

    def _out_of_memory(self, error) -> bool:
        if not isinstance(error, torch.OutOfMemoryError):
            return False
        if torch.cuda.is_available():
            # What the failed step held goes back to the device.
            torch.cuda.empty_cache()
        return True

    def _split_snapshot(self):
        values = [
            (v, _compat.backing_value(v).detach().clone())
            for v in self._step_written_variables()
        ]
        # An unseeded `Dropout` on PyTorch draws from torch's global
        # generators, not from a Keras `SeedGenerator`'s variable: the
        # redo draws what the first attempt drew.
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return values, torch.get_rng_state(), cuda

    def _split_restore(self, kept, state, error):
        del error
        values, cpu, cuda = kept
        with torch.no_grad():
            for variable, value in values:
                _assign_in_place(variable, value)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        return state

    def _cuda_device(self):
        device = torch.device(_compat.torch_device())
        return device if device.type == "cuda" else None

    def _sizing_method(self):
        return False, "PyTorch's CUDA allocator peak over probe steps"

    def _device_memory(self):
        device = self._cuda_device()
        if device is None:
            raise ValueError(
                '`micro_batch_size="auto"` needs the allocator\'s figures, '
                "which PyTorch has on CUDA devices only: on a CPU give an "
                "int, e.g. `micro_batch_size=32`. Received: "
                f"micro_batch_size={self._micro_batch_size!r} on "
                f"{_compat.torch_device()}"
            )
        return torch.cuda.mem_get_info(device)[1], f"{device}'s total memory"

    @contextlib.contextmanager
    def _probing(self, kind, batch, state):
        """`measure(size)`: the peak of the step of `kind` run on `batch`
        at that size (None if it ran out of memory): this model's state
        and the batch, plus what the step allocated above the memory in
        use when it started, from the CUDA allocator's figures (other
        models in the process are no part of it). Every variable the
        probes may change is copied to the host first and restored
        after."""
        del state
        device = self._cuda_device()
        if device is None:
            self._device_memory()  # Raises: no figures on a CPU.
        variables = [
            *self.variables,
            *self.optimizer.variables,
            *self.metrics_variables,
            *self._window.variables,
        ]
        kept = [_compat.backing_value(v).detach().cpu() for v in variables]
        # A batch still on the host is moved inside the step, and counted
        # there.
        held = sum(value.nbytes for value in kept) + sum(
            leaf.nbytes
            for leaf in keras.tree.flatten(batch)
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda
        )
        step = getattr(self, f"{kind}_step")

        def measure(size):
            set_size(size)
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            try:
                step(batch)
                torch.cuda.synchronize(device)
            except torch.OutOfMemoryError:
                torch.cuda.empty_cache()
                return None
            return held + torch.cuda.max_memory_allocated(device) - before

        try:
            with self._sizes_probed(kind) as set_size:
                yield measure
        finally:
            with torch.no_grad():
                for variable, value in zip(variables, kept, strict=True):
                    _assign_in_place(variable, value.to(device))

    def _predicted(self, x):
        if _compat.call_takes_training(self):
            return self(x, training=False)
        return self(x)

    def _micro_batch_step(self, data, track=True):
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
            loss, y_pred, sample_weight, batch_size
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
                self._plan(self.optimizer.iterations.value),
            )
            # Eager: only a complete window closes, so the other
            # micro-batches skip the close's passes over the accumulators
            # (finiteness) and its ring writes.
            if bool(complete):
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


def _sliced(data, start, stop):
    """Samples `start` to `stop` of every tensor in `data`."""
    return keras.tree.map_structure(
        lambda t: t if t is None else t[start:stop], data
    )


def _read(state) -> _window.Counters:
    # `Variable._value`: `.value` looks for an autocast scope on every read
    # (about 3 µs each, 23 counters a micro-batch on the eager step), and
    # the window's variables are float32 and int32, which it leaves alone.
    value = _compat.backing_value
    return _window.Counters.from_flat(value(v) for v in state.counters.flat())


def _assign_in_place(variable, value):
    # The rules make each counter's value in its variable's dtype and
    # shape: Keras's `assign` would convert and check it again, which on a
    # small model costs more per step than the copies.
    _compat.backing_value(variable).copy_(value)


def _batch_size(data):
    """The number of samples in a batch's inputs."""
    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    return next(i for i in keras.tree.flatten(x) if i is not None).shape[0]
