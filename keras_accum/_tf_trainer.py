"""The TensorFlow side of `AccumModel`: its graph train step.

`TensorFlowAccumTrainer` is a base of `AccumModel` on the TensorFlow
backend only, the way Keras picks its trainer by backend. Its `train_step`
is Keras's TensorFlow step (forward pass under a `tf.GradientTape`, loss,
gradients) with the update replaced by the window: the micro-batch's
weighted gradient goes into the accumulators in place, and a complete
window is applied once, inside the compiled step (`_tf_window.py`), under
any `tf.distribute` strategy.
"""

from __future__ import annotations

import contextlib
import logging
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from keras_accum import _compat, _sizing, _tf_window, _window
from keras_accum._compat import optimizer_strategy
from keras_accum._trainer import AccumTrainer


class TensorFlowAccumTrainer(AccumTrainer):
    """Accumulation for Keras's TensorFlow trainer; a base of `AccumModel`."""

    def _create_window(self, length, close_hooks):
        strategy = self.distribute_strategy
        # The optimizer belongs to the strategy `compile()` ran under.
        for each in {strategy, optimizer_strategy(self.optimizer)} - {None}:
            _check_created_in_scope(self.trainable_weights, each)
        with strategy.scope():
            if not self.optimizer.built:
                self.optimizer.build(self.trainable_variables)
        return _tf_window.create(
            self.trainable_weights,
            length,
            strategy,
            close_hooks,
            self._accumulator_dtype,
        )

    # -- The train step -------------------------------------------------------

    def train_step(self, data):
        if self._micro_batch_size is None:
            return self._micro_batch_step(data)
        # The batch, split: all micro-batches but the last in a
        # `tf.while_loop` (one traced step, whose activations do not
        # outlive an iteration), the last (maybe shorter) after it; it
        # closes the window, one update for the batch.
        batch_size, count, full, size = self._split_sizes(data, "train")
        self._life.split_length = count
        try:

            def one(i):
                # Never the window's last: no close (and so no replicas'
                # exchange, which a loop's body cannot hold) in the loop.
                piece = _sliced(data, i * size, full)
                self._micro_batch_step(piece, track=False, closes=False)
                return (i + 1,)

            done = []
            if not isinstance(count, int) or count > 1:
                # One iteration at a time: TensorFlow would otherwise start
                # the next micro-batch's forward pass (which reads only the
                # weights) beside this one's, up to 10 at once.
                done = tf.while_loop(
                    lambda i: i < count - 1,
                    one,
                    (tf.constant(0),),
                    parallel_iterations=1,
                )
            start = (count - 1) * size
            # After the loop: run beside it, the last micro-batch's
            # activations would add to an iteration's at the peak.
            with tf.control_dependencies(done):
                last = _sliced(data, start, batch_size - start)
            self._micro_batch_step(last, track=False)
        finally:
            self._life.split_length = None
        _compat.track_loss(
            self, self._batch_loss(self._window.read()), batch_size
        )
        return self._logs_for_strategy(self.get_metrics_result())

    def _micro_batch_step(self, data, track=True, closes=True):
        # Unpack.
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        window = self._window_for_step()

        # Forward pass under the tape.
        with tf.GradientTape() as tape:
            if _compat.call_takes_training(self):
                y_pred = self(x, training=True)
            else:
                y_pred = self(x)

            # Loss, as Keras reports it.
            loss = _compat.compute_loss(self, x, y, y_pred, sample_weight)
            batch_size = tf.shape(
                next(i for i in keras.tree.flatten(x) if i is not None)
            )[0]
            if track:
                _compat.track_loss(
                    self,
                    _compat.unscale_loss_for_distribution(loss),
                    batch_size,
                )

            # Scale: the micro-batch's share of the window's loss.
            objective, share = self._micro_batch_share(
                loss, y_pred, sample_weight, batch_size
            )

        if not self.trainable_weights:
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
            return self.compute_metrics(
                x, y, y_pred, sample_weight=sample_weight
            )

        # Gradients.
        gradients = tape.gradient(objective, self.trainable_weights)
        self._life.none_grads = [g is None for g in gradients]

        # Apply: into the window, and the window once it is complete.
        ready = [
            t
            for t in tf.nest.flatten(data, expand_composites=True)
            if tf.is_tensor(t)
        ]
        ready += [loss, *(_dense_part(g) for g in gradients if g is not None)]
        self._add_to_window(window, gradients, share, ready, closes)

        # Metrics.
        return self._logs_for_strategy(
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        )

    def _add_to_window(self, window, gradients, share, ready, closes=True):
        """Adds a micro-batch to the window and applies a complete one.

        Each accumulator's write waits for its own gradient only (see
        `_tf_window.TensorFlowOps.add`); the window's counters and its
        update wait for `ready`: the micro-batch, its loss and every
        gradient. Without that, ops that read no data (counters, a constant
        batch size) still run when the step fails: on the call that finds
        an input of unknown length exhausted, or on an error in the
        forward pass, they would count a micro-batch whose gradient never
        entered the window. On every gradient, not only the loss: under
        MultiWorkerMirroredStrategy a narrower set let the workers launch
        their gradient all-reduces in different orders.
        """
        backend = self._tensorflow_ops()
        read = backend.read()
        counters, complete = _window.accumulate(
            read,
            backend,
            gradients,
            share,
            self._plan(self.optimizer.iterations),
        )
        with tf.control_dependencies(ready):
            window.write(counters, read)
            if closes:
                _tf_window.close_when(
                    tf.identity(complete), self._close_window, backend
                )

    def _tensorflow_ops(self):
        variables = self.trainable_weights
        return _tf_window.TensorFlowOps(
            self._window,
            self.optimizer,
            variables,
            self._life.none_grads or [False] * len(variables),
            xla=bool(self.jit_compile),
        )

    def _close_window(self, backend):
        """Closes the window with `backend`'s operations: `_window.close`."""
        read = backend.read()
        # Loss scaling multiplies every gradient by the same scale.
        loss_scale = self.optimizer.scale_loss(tf.ones(()))
        counters, applied = _window.close(
            read, backend, True, self._close_policy(loss_scale)
        )
        backend.write(counters, read)
        backend.close_hooks(applied)

    def _check_length_in_step(self, length, updates, message):
        if tf.executing_eagerly():
            return super()._check_length_in_step(length, updates, message)
        if self.jit_compile:
            # XLA would drop an assertion and has no string ops: clamped.
            return length
        text = tf.strings.join(
            [
                message,
                tf.strings.as_string(length),
                " at update ",
                tf.strings.as_string(ops.convert_to_tensor(updates)),
            ]
        )
        check = tf.debugging.Assert(length >= 1, [text])
        with tf.control_dependencies([check]):
            return tf.identity(length)

    # -- Applying an open window outside the step -----------------------------

    def _make_flush_function(self):
        strategy = self.distribute_strategy

        def replica_fn():
            open_ = self._window.counters.mini_step.value > 0
            _tf_window.close_when(
                open_, self._close_window, self._tensorflow_ops()
            )

        @tf.function
        def flush():
            strategy.run(replica_fn)

        return flush

    # -- Evaluation and logs under tf.distribute ------------------------------

    def test_step(self, data):
        if self._micro_batch_size is None:
            return self._logs_for_strategy(super().test_step(data))
        # The batch, split as in `train_step`: the loss is the batch's,
        # tracked once; the metrics add each micro-batch up.
        batch_size, count, full, size = self._split_sizes(data, "test")

        def one(i, term, normalizer):
            share, _ = self._evaluated(_sliced(data, i * size, full))
            return i + 1, term + share[0], normalizer + share[1]

        zero = tf.zeros((), tf.float32)
        done, term, normalizer = tf.while_loop(
            lambda i, *_: i < count - 1,
            one,
            (tf.constant(0), zero, zero),
            parallel_iterations=1,  # As in `train_step`.
        )
        start = (count - 1) * size
        with tf.control_dependencies([done]):  # Not beside the loop.
            last = _sliced(data, start, batch_size - start)
        share, reg = self._evaluated(last)
        loss = self._evaluated_loss(term + share[0], normalizer + share[1], reg)
        _compat.track_loss(self, loss, batch_size)
        return self._logs_for_strategy(self.get_metrics_result())

    def _evaluated(self, data):
        """`(_evaluated_share, regularization)` of an evaluated
        micro-batch, its metrics updated."""
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._predicted(x)
        loss = _compat.compute_loss(
            self, x, y, y_pred, sample_weight, training=False
        )
        reg = self._regularization_loss("float32")
        first = next(i for i in keras.tree.flatten(x) if i is not None)
        share = self._evaluated_share(
            loss, y_pred, sample_weight, tf.shape(first)[0], reg
        )
        self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return share, reg

    def predict_step(self, data):
        if self._micro_batch_size is None:
            return super().predict_step(data)
        batch_size, count, full, size = self._split_sizes(data, "predict")
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        start = (count - 1) * size
        last = self._predicted(_sliced(x, start, batch_size - start))
        flat = tf.nest.flatten(last)

        def one(i, arrays):
            outputs = tf.nest.flatten(
                self._predicted(_sliced(x, i * size, full))
            )
            return i + 1, [
                a.write(i, o) for a, o in zip(arrays, outputs, strict=True)
            ]

        arrays = [
            tf.TensorArray(o.dtype, size=tf.maximum(count - 1, 0)) for o in flat
        ]
        with tf.control_dependencies(flat):  # Not beside the loop.
            first = tf.identity(tf.constant(0))
        _, arrays = tf.while_loop(
            lambda i, _: i < count - 1,
            one,
            (first, arrays),
            parallel_iterations=1,  # As in `train_step`.
        )

        def joined():
            found = []
            for array, output in zip(arrays, flat, strict=True):
                stacked = tf.reshape(
                    array.stack(),
                    tf.concat([[-1], tf.shape(output)[1:]], 0),
                )
                found.append(tf.concat([stacked, output], 0))
            return found

        # An empty array has no shape to stack: a batch of one piece is it.
        if isinstance(count, int):
            outputs = joined() if count > 1 else flat
        else:
            outputs = tf.cond(count > 1, joined, lambda: flat)
        return tf.nest.pack_sequence_as(last, outputs)

    def _predicted(self, x):
        if _compat.call_takes_training(self):
            return self(x, training=False)
        return self(x)

    def _split_sizes(self, data, kind):
        """`(batch size, micro-batches, full micro-batch's size, size)` of
        a batch a step of `kind` splits: Python ints where the batch's
        size is static."""
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        first = next(i for i in keras.tree.flatten(x) if i is not None)
        batch_size = first.shape[0]
        if batch_size is None:  # Known when the step runs.
            batch_size = tf.shape(first)[0]
        size = self._split_size(kind)
        count = self._split_count(batch_size, size)
        # Never above the batch: XLA compiles the loop's slice for a last
        # batch shorter than the size too, where it never runs.
        full = tf.minimum(size, batch_size)
        return batch_size, count, full, size

    # -- Sizing the split (`_sizing.py`) -------------------------------------

    def _split_batches(self, kind, args):
        # Keras's train and test functions take an iterator, its predict
        # function a list of batches.
        (batches,) = args
        return None, iter(batches)

    def _split_args(self, kind, state, batches):
        del state
        return (list(batches),) if kind == "predict" else (batches,)

    def _split_result(self, result):
        return result, None

    def _split_outputs(self, outputs, state):
        return outputs

    def _local_shape(self, value):
        # A distributed batch: each replica splits its own part.
        return self.distribute_strategy.experimental_local_results(value)[
            0
        ].shape

    def _out_of_memory(self, error) -> bool:
        return isinstance(error, tf.errors.ResourceExhaustedError)

    def _can_redo_out_of_memory(self) -> bool:
        # Another worker, its step whole, would wait in the next exchange.
        return not _multi_worker(self.distribute_strategy)

    def _split_snapshot(self):
        cache = self._life.split.cache
        if cache.get("window", False) is not self._window:
            cache["window"] = self._window
            parts = _parts(
                self.distribute_strategy, self._step_written_variables()
            )

            # One call for every read (about 40 eager reads otherwise). A
            # read keeps its value: a later write to the variable copies
            # the buffer first (TensorFlow's copy-on-write).
            @tf.function(autograph=False)
            def read():
                return [part.read_value() for part in parts]

            cache["snapshot"] = (parts, read)
        parts, read = cache["snapshot"]
        return list(zip(parts, read(), strict=True))

    def _split_restore(self, kept, state, error):
        del error
        for part, value in kept:
            part.assign(value)
        return state

    def _sizing_method(self):
        exact = all(d == "CPU" for d, _ in self._replica_devices())
        return exact, (
            "TensorFlow's allocator peak over probe steps "
            "(tf.config.experimental.get_memory_info)"
        )

    def _device_memory(self):
        kinds = {kind for kind, _ in self._replica_devices()}
        if kinds == {"CPU"}:
            available = _sizing.host_available_memory()
            if available is not None:
                return available, "the host's available memory"
        else:
            index = self._replica_devices()[0][1]
            total = _sizing.nvidia_total_memory(index)
            if total is not None:
                return total, f"GPU:{index}'s total memory (NVML)"
        raise ValueError(
            '`micro_batch_size="auto"` could not read this device\'s '
            "memory: give the bytes a step may use, "
            "`micro_batch_size=keras_accum.AutoMicroBatch(memory_limit=...)`"
            f". Received: micro_batch_size={self._micro_batch_size!r} on "
            f"{sorted(kinds)}"
        )

    def _replica_devices(self):
        """`[(device type, index)]` of the devices the step runs on."""
        try:
            names = self.distribute_strategy.extended.worker_devices
        except RuntimeError:  # The default strategy: the default device.
            gpu = bool(tf.config.list_logical_devices("GPU"))
            return [("GPU", 0)] if gpu else [("CPU", 0)]
        found = []
        for name in names:
            spec = tf.DeviceSpec.from_string(name)
            found.append((spec.device_type or "CPU", spec.device_index or 0))
        return found

    @contextlib.contextmanager
    def _probing(self, kind, batch, state):
        """`measure(size)`: the peak, in bytes, of the step of `kind` run
        on `batch` at that size (the largest of the replicas' devices; None
        if it ran out of memory): this model's state and the batch, plus
        what the step allocated above the memory in use when it started,
        from the allocator's figures. Memory that other models in the
        process hold is not the step's (JAX's compiled figures do not see
        it either). Every variable the probes may change is copied to the
        host first and restored after."""
        del state
        strategy = self.distribute_strategy
        if _multi_worker(strategy):
            # Each worker would measure its own devices and could trace a
            # step of another size than the others: their exchanges of
            # gradients would not match.
            raise NotImplementedError(
                '`micro_batch_size="auto"` does not run under '
                "MultiWorkerMirroredStrategy: the workers would size their "
                "steps apart. Give an int (the same on every worker). "
                f"Received: micro_batch_size={self._micro_batch_size!r}"
            )
        variables = [
            *self.variables,
            *self.optimizer.variables,
            *self.metrics_variables,
            *self._window.variables,
        ]
        parts = _parts(strategy, variables)
        # Host copies: a view would keep the device's old buffer alive
        # through the probes' updates and count it in their peaks.
        kept = [np.array(part.numpy(), copy=True) for part in parts]
        devices = sorted({f"{d}:{i}" for d, i in self._replica_devices()})
        _check_allocator_figures(devices, self._micro_batch_size)
        # Each device holds its replica's copy of the state and its part
        # of the batch.
        held = sum(value.nbytes for value in kept) + _nbytes(batch, strategy)
        held //= len(devices)
        step = getattr(self, f"{kind}_step")

        def measure(size):
            set_size(size)

            def probe(data):
                return strategy.run(step, args=(data,))

            if not self.run_eagerly:
                probe = tf.function(probe, jit_compile=bool(self.jit_compile))
            allocated = _allocator_peak(probe, batch, strategy, devices)
            return None if allocated is None else held + allocated

        # Each probe traces the step at its size, on purpose.
        quiet = _RetracingFilter()
        tf.get_logger().addFilter(quiet)
        try:
            with self._sizes_probed(kind) as set_size:
                yield measure
        finally:
            tf.get_logger().removeFilter(quiet)
            for part, value in zip(parts, kept, strict=True):
                part.assign(value)

    def _logs_for_strategy(self, logs):
        """Works around Keras 3.15 reducing scalar logs with `axis=0`.

        Under MultiWorkerMirroredStrategy Keras averages each replica's logs
        with `strategy.reduce("MEAN", value, axis=0)`, which fails for the
        scalars every metric returns; one-element vectors average to the
        same scalar.
        """
        if not _multi_worker(self.distribute_strategy):
            return logs
        return keras.tree.map_structure(
            lambda v: tf.reshape(v, [1]) if v.shape.rank == 0 else v, logs
        )


def _check_created_in_scope(variables, strategy) -> None:
    """Refuses weights that `strategy` does not hold.

    A model built outside `strategy.scope()` and compiled inside it has
    plain variables where the strategy expects distributed ones; the
    optimizer would fail on them deep inside its apply.
    """
    outside = [
        v.path
        for v in variables
        if not strategy.extended.variable_created_in_scope(v.value)
    ]
    if outside:
        raise ValueError(
            f"The model's weights were created outside the scope of its "
            f"distribution strategy ({type(strategy).__name__}): the "
            "accumulators and the optimizer's state would be per replica "
            "and the weights not. Create the model (its layers, and so its "
            "weights) inside `with strategy.scope():`, as well as "
            "`compile()`, as `tf.distribute` requires of any Keras model. "
            f"Received: {len(outside)} weight(s) outside the scope, "
            f"e.g. {outside[:3]}"
        )


def _multi_worker(strategy) -> bool:
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and _compat.in_multi_worker_mode(strategy)


def _allocator_peak(probe, batch, strategy, devices):
    """The most bytes `probe(batch)` allocated on one of `devices` above
    what was in use when it started (the allocator's peak less its
    current bytes then: other models' weights are no part of the step);
    None if it ran out of memory. Run twice: the first run holds one-time
    buffers (its trace's constants, kernels' caches); the second is every
    step's."""
    info = tf.config.experimental.get_memory_info
    try:
        for _ in range(2):
            before = {}
            for device in devices:
                tf.config.experimental.reset_memory_stats(device)
                before[device] = info(device)["current"]
            tf.nest.map_structure(
                lambda t: t.numpy() if hasattr(t, "numpy") else t,
                strategy.experimental_local_results(probe(batch)),
            )
    except tf.errors.ResourceExhaustedError:
        return None
    return max(info(device)["peak"] - before[device] for device in devices)


def _check_allocator_figures(devices, setting) -> None:
    """Refuses `"auto"` where TensorFlow's allocator keeps no figures (its
    CPU allocator unless it is the BFC allocator), naming the fix."""
    for device in devices:
        try:
            tf.config.experimental.get_memory_info(device)
        except ValueError:
            # "Allocator stats not available for device ...".
            pass
        else:
            continue
        raise ValueError(
            '`micro_batch_size="auto"` measures the step with TensorFlow\'s '
            f"allocator figures, and {device}'s allocator keeps none. On a "
            "CPU, TensorFlow keeps them only with its BFC allocator: set "
            "the environment variable `TF_CPU_ALLOCATOR_USE_BFC=true` "
            "before TensorFlow is imported (e.g. "
            '`os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"` before '
            "`import keras`, or in the shell), or give an int "
            "`micro_batch_size`. A `memory_limit` does not replace the "
            f"figures. Received: micro_batch_size={setting!r} on {devices}"
        )


def _nbytes(data, strategy) -> int:
    """The bytes of `data`'s tensors, every replica's part counted."""
    total = 0
    for leaf in tf.nest.flatten(data):
        if leaf is None:
            continue
        for part in strategy.experimental_local_results(leaf):
            if hasattr(part, "shape") and hasattr(part, "dtype"):
                count = int(np.prod([d or 0 for d in tuple(part.shape)]))
                total += count * tf.as_dtype(part.dtype).size
    return total


class _RetracingFilter(logging.Filter):
    def filter(self, record) -> bool:
        return "triggered tf.function retracing" not in record.getMessage()


def _parts(strategy, variables) -> list:
    """The `tf.Variable`s behind Keras `variables`: one per replica where
    a strategy keeps copies."""
    parts = []
    for variable in variables:
        parts.extend(strategy.experimental_local_results(variable.value))
    return parts


def _dense_part(gradient):
    # `IndexedSlices` (embeddings) are no tensor; their values are.
    return getattr(gradient, "values", gradient)


def _sliced(data, start, size):
    """`size` samples from `start` of every tensor in `data` (`tf.slice`,
    whose size XLA needs known when it compiles)."""

    def piece(t):
        if t is None:
            return None
        if isinstance(t, tf.RaggedTensor):
            # Rows of a ragged tensor: its row splits, sliced.
            start_ = tf.cast(start, t.row_splits.dtype)
            return t[start_ : start_ + tf.cast(size, t.row_splits.dtype)]
        if isinstance(t, tf.SparseTensor):
            rest = t.shape.rank - 1
            begin = tf.stack([tf.cast(start, tf.int64)] + [0] * rest)
            extent = tf.concat(
                [[tf.cast(size, tf.int64)], t.dense_shape[1:]], 0
            )
            sliced = tf.sparse.slice(t, begin, extent)
            # Static shape for the layers (the batch dimension unknown).
            return tf.SparseTensor(
                sliced.indices,
                sliced.values,
                tf.ensure_shape(sliced.dense_shape, t.dense_shape.shape),
            )
        rest = t.shape.rank - 1
        begin = tf.stack([tf.cast(start, tf.int32)] + [0] * rest)
        extent = tf.stack([tf.cast(size, tf.int32)] + [-1] * rest)
        return tf.slice(t, begin, extent)

    return tf.nest.map_structure(piece, data)
