"""PyTorch's `BatchOps` (`_batch_ops.py`): a split batch in an eager step.

The loop is Python's: each piece's activations are freed before the next
one's forward pass. A piece is a view of every tensor's rows.
"""

from __future__ import annotations

import contextlib

import keras
import torch

from keras_accum import _batch_ops, _compat, _seeds, _window
from keras_accum._batch_ops import Looped, Split


class TorchBatchOps(_batch_ops.EagerStateOps):
    """`BatchOps` of `TorchAccumTrainer`."""

    # -- The batch ------------------------------------------------------------

    def split(self, data, size):
        rows = int(_batch_ops.first_input(data).shape[0])
        count = _batch_ops.piece_count(rows, size)
        return Split(rows, rows, count, size, min(size, rows))

    def piece(self, tree, start, size):
        stop = start + size
        return keras.tree.map_structure(
            lambda t: t if t is None else t[start:stop], tree
        )

    def loop(self, count, body, carry, collect=None):
        collected = [] if collect is not None else None
        for i in range(count):
            if collect is None:
                carry = body(i, carry)
            else:
                carry, output = body(i, carry)
                collected.append(output)
        return Looped(carry, collected, None)

    def after(self, done, tree):
        # Eager: in program order.
        return tree

    def join(self, collected, last, split):
        if not collected:
            return last
        return keras.tree.map_structure(
            lambda *parts: torch.cat(parts), *collected, last
        )

    def train_result(self, state, batch_size):
        model = self.model
        counters = read_counters(model._window)
        _compat.track_loss(model, _batch_ops.batch_loss(counters), batch_size)
        return model.get_metrics_result()

    # -- Keras's functions around the step ------------------------------------

    def unpack_call(self, kind, args):
        # Keras's functions take a list of batches.
        (batches,) = args
        return (), iter(batches)

    def pack_call(self, kind, state, batches):
        return (list(batches),)

    # -- Sizing, and redoing a batch ------------------------------------------

    def is_out_of_memory(self, error):
        if not isinstance(error, torch.OutOfMemoryError):
            return False
        if torch.cuda.is_available():
            # What the failed step held goes back to the device.
            torch.cuda.empty_cache()
        return True

    def snapshot(self):
        # The variables and the copies' buffers are made once per window
        # state: walking the layers for the variables, and a new copy of
        # each, would cost every step more than the copies.
        cache = self.sizes.cache
        window = self.model._window
        if cache.get("window", False) is not window:
            cache["window"] = window
            variables = self.written_variables()
            copies = [_compat.backing_value(v).clone() for v in variables]
            cache["snapshot"] = (variables, copies)
        variables, copies = cache["snapshot"]
        tensors = [_compat.backing_value(v) for v in variables]
        with torch.no_grad():
            torch._foreach_copy_(copies, tensors)
        # An unseeded `Dropout` on PyTorch draws from torch's global
        # generators, not from a Keras `SeedGenerator`'s variable: the
        # redo draws what the first attempt drew.
        cuda = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            cuda = torch.cuda.get_rng_state_all()
        return (tensors, copies), torch.get_rng_state(), cuda

    def restore(self, kept, state, error):
        (tensors, copies), cpu, cuda = kept
        with torch.no_grad():
            torch._foreach_copy_(tensors, copies)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        return state

    def _cuda_device(self):
        device = torch.device(_compat.torch_device())
        return device if device.type == "cuda" else None

    def sizing_method(self):
        return False, "PyTorch's CUDA allocator peak over probe steps"

    def device_memory(self):
        device = self._cuda_device()
        if device is None:
            raise ValueError(
                '`micro_batch_size="auto"` needs the allocator\'s figures, '
                "which PyTorch has on CUDA devices only: on a CPU give an "
                "int, e.g. `micro_batch_size=32`. Received: "
                f"micro_batch_size={self.setting!r} on "
                f"{_compat.torch_device()}"
            )
        return torch.cuda.mem_get_info(device)[1], f"{device}'s total memory"

    @contextlib.contextmanager
    def probing(self, kind, batch, state):
        """`measure(size)`: the peak of the step of `kind` run on `batch`
        at that size (None if it ran out of memory): this model's state
        and the batch, plus what the step allocated above the memory in
        use when it started, from the CUDA allocator's figures (other
        models in the process are no part of it). Every variable the
        probes may change is copied to the host first and restored
        after."""
        model = self.model
        device = self._cuda_device()
        if device is None:
            self.device_memory()  # Raises: no figures on a CPU.
        variables = [
            *model.variables,
            *model.optimizer.variables,
            *model.metrics_variables,
            *model._window.variables,
        ]
        kept = [_compat.backing_value(v).detach().cpu() for v in variables]
        # A batch still on the host is moved inside the step, and counted
        # there.
        held = sum(value.nbytes for value in kept) + sum(
            leaf.nbytes
            for leaf in keras.tree.flatten(batch)
            if isinstance(leaf, torch.Tensor) and leaf.is_cuda
        )
        step = getattr(model, f"{kind}_step")

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
            with self.sizes_probed(kind) as set_size:
                yield measure
        finally:
            with torch.no_grad():
                for variable, value in zip(variables, kept, strict=True):
                    assign_in_place(variable, value.to(device))

    # -- The whole-batch step -------------------------------------------------

    @property
    def primitives(self):
        from keras_accum import _torch_output_grads

        return _torch_output_grads

    def without_gradients(self):
        return torch.no_grad()

    # Unseeded dropout draws from torch's global generators (`_seeds`): the
    # states pass 1 enters each piece at are kept, and pass 2 enters each
    # piece at its own, whatever the order of the pieces.

    def seeds_start(self, state):
        replay, values = super().seeds_start(state)
        self.torch_draws = {} if replay.torch_global else None
        replay.torch_global = False
        if self.torch_draws is not None:
            values = (values[0], None)
        return replay, values

    def forward_piece(self, state, x, start, i):
        if self.torch_draws is not None:
            self.torch_draws[i] = _seeds._torch_rng_state()
        state, y_pred = super().forward_piece(state, x, start, i)
        if self.torch_draws is not None:
            self.torch_draws["end"] = _seeds._torch_rng_state()
        return state, y_pred

    def vjp_piece(self, state, x, output_grads, draws, last, scale=None):
        if self.torch_draws is not None:
            _seeds._set_torch_rng_state(self.torch_draws[draws[1]])
        return super().vjp_piece(state, x, output_grads, draws, last, scale)

    def add_piece(self, state, grads, share, count, closes):
        model = self.model
        variables = model.trainable_weights
        window_state = model._window_for_step(variables)
        model._life.none_grads = [g is None for g in grads]
        grads = [
            torch.zeros_like(v.value) if g is None else g
            for g, v in zip(grads, variables, strict=True)
        ]
        with torch.no_grad():
            backend = model._torch_ops(variables)
            read = read_counters(window_state)
            counters, complete = _window.accumulate(
                read,
                backend,
                grads,
                share,
                model._plan(model.optimizer.iterations.value, count),
            )
            if closes and bool(complete):
                counters = model._close(counters, backend)
            window_state.write(counters, read, assign_in_place)
        return state

    def seeds_finish(self, state, start, last_piece):
        if self.torch_draws is not None:
            _seeds._set_torch_rng_state(self.torch_draws["end"])
        return super().seeds_finish(state, start, last_piece)


def assign_in_place(variable, value):
    """Copies `value` into `variable`'s tensor.

    The rules make each counter's value in its variable's dtype and shape:
    Keras's `assign` would convert and check it again, which on a small
    model costs more per step than the copies."""
    _compat.backing_value(variable).copy_(value)


def read_counters(state) -> _window.Counters:
    """The window's counters, as their variables' own tensors.

    `Variable._value`: `.value` looks for an autocast scope on every read
    (about 3 µs each, 23 counters a micro-batch on the eager step), and
    the window's variables are float32 and int32, which it leaves alone.
    """
    value = _compat.backing_value
    return _window.Counters.from_flat(value(v) for v in state.counters.flat())
