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

import contextlib
import warnings
from typing import Any, NamedTuple

import jax
import jax.experimental.sparse
import keras

from keras_accum import _compat, _jax_devices, _sizing, _window
from keras_accum._jax_ops import JaxOps, iterations_index
from keras_accum._trainer import AccumTrainer


class JaxAccumTrainer(AccumTrainer):
    """Accumulation for Keras's JAX trainer; a base of `AccumModel` on JAX."""

    _TRAIN_STEP_ARGS = "state, data"

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
        # The batch, split: all micro-batches but the last in a
        # `fori_loop` (one traced step, whose activations do not outlive
        # an iteration), the last (maybe shorter) after it; it closes the
        # window, one update for the batch.
        batch_size, local, count, size, shards = self._split_sizes(
            data, "train"
        )
        self._life.split_length = count
        try:

            def one(i, state):
                # Never the window's last: no close in the loop's body
                # (one conditional update, and one all-reduce, in the
                # compiled step).
                piece = _piece(data, i * size, size, shards)
                step = self._micro_batch_step(
                    state, piece, track=False, closes=False
                )
                return step[1]

            if count > 1:
                state = jax.lax.fori_loop(0, count - 1, one, state)
            start = (count - 1) * size
            last = _piece(data, start, local - start, shards)
            _, state = self._micro_batch_step(state, last, track=False)
        finally:
            self._life.split_length = None
        return self._tracked_batch_loss(state, batch_size)

    def test_step(self, state, data):
        if self._micro_batch_size is None:
            return super().test_step(state, data)
        # The batch, split as in `train_step`: the loss is the batch's,
        # tracked once; the metrics add each micro-batch up.
        batch_size, local, count, size, shards = self._split_sizes(data, "test")
        zero = jax.numpy.zeros((), "float32")

        def one(i, carried):
            state, term, normalizer = carried
            piece = _piece(data, i * size, size, shards)
            state, share, _ = self._evaluated(state, piece)
            return state, term + share[0], normalizer + share[1]

        carried = (state, zero, zero)
        if count > 1:
            carried = jax.lax.fori_loop(0, count - 1, one, carried)
        state, term, normalizer = carried
        start = (count - 1) * size
        last = _piece(data, start, local - start, shards)
        state, share, reg = self._evaluated(state, last)
        loss = self._evaluated_loss(term + share[0], normalizer + share[1], reg)
        trainable, non_trainable, metrics = state
        mapping = list(zip(self.metrics_variables, metrics, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            _compat.track_loss(self, loss, batch_size)
            logs = self.get_metrics_result()
        metrics = _current_values(scope, self.metrics_variables)
        return logs, (trainable, non_trainable, metrics)

    def _evaluated(self, state, data):
        """`(state, _evaluated_share, regularization)` of an evaluated
        micro-batch, its metrics updated."""
        trainable, non_trainable, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        kwargs = {}
        if _compat.call_takes_training(self):
            kwargs["training"] = False
        y_pred, non_trainable, losses = self.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        mapping = [
            *zip(self.trainable_variables, trainable, strict=True),
            *zip(self.non_trainable_variables, non_trainable, strict=True),
            *zip(self.metrics_variables, metrics, strict=True),
        ]
        if losses:
            _compat.override_losses(self, losses)
        try:
            with keras.StatelessScope(state_mapping=mapping) as scope:
                loss = _compat.compute_loss(
                    self, x, y, y_pred, sample_weight, training=False
                )
                reg = self._regularization_loss("float32")
                first = next(i for i in keras.tree.flatten(x) if i is not None)
                share = self._evaluated_share(
                    loss, y_pred, sample_weight, first.shape[0], reg
                )
                self.compute_metrics(x, y, y_pred, sample_weight)
        finally:
            if losses:
                _compat.override_losses(self, None)
        metrics = _current_values(scope, self.metrics_variables)
        return (trainable, non_trainable, metrics), share, reg

    def predict_step(self, state, data):
        if self._micro_batch_size is None:
            return super().predict_step(state, data)
        _, local, count, size, shards = self._split_sizes(data, "predict")
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        trainable, non_trainable = state
        kwargs = {}
        if _compat.call_takes_training(self):
            kwargs["training"] = False

        def predicted(non_trainable, piece):
            return self.stateless_call(
                trainable, non_trainable, piece, **kwargs
            )

        def one(non_trainable, i):
            outputs, non_trainable = predicted(
                non_trainable, _piece(x, i * size, size, shards)
            )
            return non_trainable, outputs

        start = (count - 1) * size
        if count > 1:
            non_trainable, stacked = jax.lax.scan(
                one, non_trainable, jax.numpy.arange(count - 1)
            )
        last, non_trainable = predicted(
            non_trainable, _piece(x, start, local - start, shards)
        )
        if count > 1:
            last = keras.tree.map_structure(
                lambda s, o: _joined(s, o, shards), stacked, last
            )
        return last, non_trainable

    def _split_sizes(self, data, kind):
        """`(batch size, each device's rows, micro-batches, size, devices)`
        of a batch a step of `kind` splits. Under a `keras.distribution`
        each device splits its own rows (the batch's shards along the
        batch axis) into micro-batches of `size`: a micro-batch takes as
        many rows from every device and stays where its rows are."""
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        batch_size = next(
            i for i in keras.tree.flatten(x) if i is not None
        ).shape[0]
        shards = _jax_devices.data_shards()
        if shards > 1 and any(
            isinstance(t, jax.experimental.sparse.BCOO)
            for t in keras.tree.flatten(data)
        ):
            raise ValueError(
                "`micro_batch_size` cannot split a sparse (BCOO) batch that "
                f"a `keras.distribution` shards over {shards} devices: "
                "densify it, or unset `micro_batch_size`. Received: "
                f"micro_batch_size={self._micro_batch_size!r}"
            )
        # Keras's distribution refuses a batch its devices cannot share
        # evenly before the step.
        local = batch_size // shards
        size = self._split_size(kind)
        return batch_size, local, self._split_count(local, size), size, shards

    # -- Sizing the split (`_sizing.py`) -------------------------------------

    def _split_batches(self, kind, args):
        state, batches = args
        return state, iter(batches)

    def _split_args(self, kind, state, batches):
        return state, batches

    def _split_result(self, result):
        return result

    def _split_outputs(self, outputs, state):
        return outputs, state

    def _split_batch_size(self, batch) -> int:
        # Each device splits its own rows (`_split_sizes`).
        return super()._split_batch_size(batch) // _jax_devices.data_shards()

    def _batch_signature(self, batch):
        # Every shape of batch is compiled, and so sized, on its own.
        return tuple(
            (tuple(leaf.shape), str(leaf.dtype))
            for leaf in jax.tree_util.tree_leaves(batch)
        )

    def _fresh_inner(self, kind):
        # Keras jits the bound `train_step`, whose traces `jax.jit` keeps
        # by the function: a new jit of it would reuse the trace made at
        # the old size.
        jax.clear_caches()
        return super()._fresh_inner(kind)

    def _out_of_memory(self, error) -> bool:
        return isinstance(error, jax.errors.JaxRuntimeError) and (
            "RESOURCE_EXHAUSTED" in str(error)
        )

    def _split_snapshot(self):
        # The state is the step's argument, and no step changes it.
        return None

    def _split_restore(self, kept, state, error):
        del kept
        if any(
            getattr(leaf, "is_deleted", lambda: False)()
            for leaf in jax.tree_util.tree_leaves(state)
        ):
            raise RuntimeError(
                "The train step ran out of memory after XLA had taken its "
                "state's buffers (the step donates them, as Keras's does): "
                "the batch cannot be redone. Give a smaller "
                "`micro_batch_size`, or `AutoMicroBatch(margin=...)` larger "
                "than its default."
            ) from error
        return state

    def _split_give_up(self, state) -> None:
        # Keras's `fit` keeps the state out of the variables while it runs
        # and would leave them empty on the error.
        trainable, non_trainable, optimizer_and_window, metrics = state
        optimizer = [*self.optimizer.variables, *self._window.variables]
        pairs = [
            *zip(self.trainable_variables, trainable, strict=True),
            *zip(self.non_trainable_variables, non_trainable, strict=True),
            *zip(optimizer, optimizer_and_window, strict=True),
            *zip(self.metrics_variables, metrics, strict=True),
        ]
        for variable, value in pairs:
            variable.assign(value)

    def _sizing_method(self):
        return True, "XLA's compiled memory analysis"

    def _device_memory(self):
        device = jax.devices()[0]
        stats = device.memory_stats() if device.platform != "cpu" else None
        if stats and stats.get("bytes_limit"):
            return int(stats["bytes_limit"]), f"{device}'s memory"
        available = _sizing.host_available_memory()
        if available is None:
            raise ValueError(
                '`micro_batch_size="auto"` could not read this device\'s '
                "memory: give the bytes a step may use, "
                "`micro_batch_size=keras_accum.AutoMicroBatch("
                f"memory_limit=...)`. Received: micro_batch_size="
                f"{self._micro_batch_size!r} on {device}"
            )
        return available, "the host's available memory"

    @contextlib.contextmanager
    def _probing(self, kind, batch, state):
        """`measure(size)`: the peak XLA assigns the step of `kind` on
        `batch` at that size: its arguments (the state, donated as Keras
        donates them, and the batch), outputs not aliased to them, and
        temporaries. Compiles; runs nothing."""
        step = getattr(self, f"{kind}_step")
        donate = () if kind == "predict" else (0,)

        def measure(size):
            set_size(size)

            # A new function each time: `jax.jit` caches a trace by the
            # function, and the size is read while tracing.
            def sized(state, data):
                return step(state, data)

            try:
                compiled = (
                    jax.jit(sized, donate_argnums=donate)
                    .lower(state, batch)
                    .compile()
                )
            except Exception as error:
                if self._out_of_memory(error):
                    return None
                raise
            return _sizing.compiled_peak(compiled.memory_analysis())

        with self._sizes_probed(kind) as set_size:
            yield measure

    def _tracked_batch_loss(self, state, batch_size):
        """`(logs, state)` with the split batch's loss in the running mean
        `fit` logs, once for the batch, as `Model(B)` adds it."""
        trainable, non_trainable, optimizer_and_window, metrics = state
        count = len(self.optimizer.variables)
        _, counters = self._window.unpack(optimizer_and_window[count:])
        mapping = list(zip(self.metrics_variables, metrics, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            _compat.track_loss(self, self._batch_loss(counters), batch_size)
            logs = self.get_metrics_result()
        metrics = _current_values(scope, self.metrics_variables)
        return logs, (trainable, non_trainable, optimizer_and_window, metrics)

    def _micro_batch_step(self, state, data, track=True, closes=True):
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
        values = _StepValues(non_trainable, metrics, optimizer_values, counters)
        data = (x, y, sample_weight)
        if window_state.partial_sums:
            out = self._gradients_per_device(trainable, values, data)
        else:
            out = self._reduced_gradients(trainable, values, data)
        non_trainable, metrics = out.non_trainable, out.metrics

        # Apply: into the window, and the window once it is complete.
        backend = _ops_class(window_state)(
            accumulators, self.optimizer, trainable, optimizer_values
        )
        updates = optimizer_values[iterations_index(self.optimizer)]
        counters, complete = _window.accumulate(
            counters, backend, out.grads, out.share, self._plan(updates)
        )
        if closes:
            counters, applied = _window.close(
                counters, backend, complete, self._jax_close_policy(backend)
            )
            non_trainable = self._run_close_hooks(
                non_trainable, applied, complete
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
            metrics = _current_values(scope, self.metrics_variables)
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
                    loss, y_pred, sample_weight, batch_size, values.device
                )
                if values.device is not None:
                    loss = self._device_loss(loss, share, values.device)
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

    def _device_loss(self, loss, share, device):
        """A device's part of the loss a plain step reports: summed over
        devices and divided by the normalizer total, it is that loss."""
        if not isinstance(share.normalizer, float):
            return share.loss  # A mean: its value times its normalizer.
        # A sum: with the regularization on the first device only.
        regularization = self._regularization_loss(loss.dtype)
        return loss - keras.ops.cast(device != 0, loss.dtype) * regularization

    def _reduced_gradients(self, trainable, values, data):
        """The micro-batch's gradient over all devices, as an
        `_ObjectiveOut`."""
        grad_fn = jax.value_and_grad(self._jax_objective, has_aux=True)
        (_, out), grads = grad_fn(trainable, values, *data)
        return out._replace(grads=grads)

    def _gradients_per_device(self, trainable, values, data):
        """Each device's partial gradient, as an `_ObjectiveOut`
        (`_jax_devices`)."""
        axis = _jax_devices.batch_axis(self.trainable_weights)
        accumulators = self._window.acc_grads
        slots = int(accumulators[0].shape[0]) if accumulators else 1
        if (
            axis is None  # The distribution was unset since.
            or axis.size != slots
            or not _jax_devices.maps_over_devices(self, axis, data[0])
        ):
            # The reduced gradient, counted on the first device.
            out = self._reduced_gradients(trainable, values, data)
            grads = out.grads
            if out.share.weight is not None:
                grads = [g * out.share.weight for g in grads]
                out = out._replace(share=out.share._replace(weight=None))
            return out._replace(grads=_jax_devices.in_first_slot(grads, slots))
        step = _jax_devices.per_device_gradients(
            self._jax_objective,
            axis,
            trainable,
            values,
            data,
            _jax_devices.seed_states(self),
        )
        return _ObjectiveOut(**step._asdict())

    def _jax_close_policy(self, backend):
        mapping = list(
            zip(self.optimizer.variables, backend.optimizer_values, strict=True)
        )
        with keras.StatelessScope(state_mapping=mapping):
            loss_scale = self.optimizer.scale_loss(
                keras.ops.ones((), "float32")
            )
        return self._close_policy(loss_scale)

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

        def flush_step(trainable, non_trainable, optimizer_values, values):
            accumulators, counters = window_state.unpack(values)
            closing = counters.mini_step > 0
            backend = _ops_class(window_state)(
                accumulators, optimizer, trainable, optimizer_values
            )
            counters, applied = _window.close(
                counters, backend, closing, self._jax_close_policy(backend)
            )
            non_trainable = self._run_close_hooks(
                non_trainable, applied, closing
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
    device computing its own shard's gradient (`_jax_devices`), if any."""

    non_trainable: list
    metrics: list
    optimizer: list
    counters: _window.Counters
    device: Any = None


def _ops_class(window_state):
    """The window's `WindowOps`: each device's partial sums under a
    `keras.distribution` that splits the batch (`_jax_devices`), else the
    one-device values."""
    if window_state.partial_sums:
        return _jax_devices.PartialSumOps
    return JaxOps


def _current_values(scope, variables):
    """The values `scope` holds for `variables` (their own where unset)."""
    values = []
    for variable in variables:
        value = scope.get_current_value(variable)
        values.append(variable.value if value is None else value)
    return values


def _piece(data, start, size, shards=1):
    """`size` samples from `start` (an int or a traced index) of every
    array in `data`; with `shards` > 1, of each shard's rows (the batch
    seen as `shards` blocks along its first axis), joined: what each
    device holds of the batch, sliced where it is."""

    def sliced(t):
        if t is None:  # No sample weight (`train_on_batch(x, y)`).
            return None
        if isinstance(t, jax.experimental.sparse.BCOO):
            return _sparse_piece(t, start, size)
        if shards == 1:
            return jax.lax.dynamic_slice_in_dim(t, start, size)
        blocks = t.reshape((shards, t.shape[0] // shards, *t.shape[1:]))
        piece = jax.lax.dynamic_slice_in_dim(blocks, start, size, axis=1)
        return piece.reshape((shards * size, *t.shape[1:]))

    return keras.tree.map_structure(sliced, data)


def _sparse_piece(t, start, size):
    """`size` rows from `start` of a sparse batch (`BCOO`) on one device
    (`_split_sizes` refuses a sharded one): its stored elements outside
    them dropped, as many kept (a shape XLA knows)."""
    starts = (start,) + (0,) * (t.ndim - 1)
    return jax.experimental.sparse.bcoo_dynamic_slice(
        t, starts, (size, *t.shape[1:])
    )


def _joined(stacked, last, shards):
    """The outputs of a split batch in its rows' order: `stacked`, the
    loop's (one row per micro-batch, each `_piece`'s rows), then `last`."""
    if shards == 1:
        return jax.numpy.concatenate(
            [stacked.reshape((-1, *stacked.shape[2:])), last]
        )
    features = last.shape[1:]
    # (micro-batches, devices, rows) to (devices, micro-batches, rows).
    loop = stacked.reshape((stacked.shape[0], shards, -1, *features))
    loop = jax.numpy.swapaxes(loop, 0, 1).reshape((shards, -1, *features))
    tail = last.reshape((shards, -1, *features))
    joined = jax.numpy.concatenate([loop, tail], axis=1)
    return joined.reshape((-1, *features))
