"""TensorFlow's `BatchOps` (`_batch_ops.py`): a split batch in a graph step.

The pieces run in a `tf.while_loop` of one iteration at a time (TensorFlow
would otherwise start the next piece's forward pass, which reads only the
weights, beside this one's, up to 10 at once); a piece is a `tf.slice` of
every tensor (ragged and sparse ones by rows), each replica splitting its
own part under `tf.distribute`. The batch's size may be known only when
the step runs: the sizes are then scalar tensors.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

from keras_accum import _batch_ops, _compat, _sizing
from keras_accum._batch_ops import Looped, Split


class TensorFlowBatchOps(_batch_ops.EagerStateOps):
    """`BatchOps` of `TensorFlowAccumTrainer`."""

    # -- The batch ------------------------------------------------------------

    def split(self, data, size):
        first = _batch_ops.first_input(data)
        batch_size = first.shape[0]
        if batch_size is None:  # Known when the step runs.
            batch_size = tf.shape(first)[0]
        count = _batch_ops.piece_count(batch_size, size)
        full = tf.minimum(size, batch_size)
        return Split(batch_size, batch_size, count, size, full)

    def piece(self, tree, start, size):
        if isinstance(tree, _After):
            with tf.control_dependencies(tree.done):
                return self.piece(tree.tree, start, size)
        return tf.nest.map_structure(lambda t: _sliced(t, start, size), tree)

    def loop(self, count, body, carry, collect=None):
        if isinstance(count, int) and count <= 0:
            return Looped(carry, None, [])
        arrays = None
        if collect is not None:
            arrays = [
                tf.TensorArray(o.dtype, size=tf.maximum(count, 0))
                for o in tf.nest.flatten(collect)
            ]

        def one(i, carry, arrays):
            out = body(i, carry)
            if collect is None:
                return i + 1, out, arrays
            carry, outputs = out
            written = [
                a.write(i, o)
                for a, o in zip(arrays, tf.nest.flatten(outputs), strict=True)
            ]
            return i + 1, carry, written

        done, carry, arrays = tf.while_loop(
            lambda i, *_: i < count,
            one,
            (tf.constant(0), carry, arrays or []),
            parallel_iterations=1,
        )
        return Looped(carry, None if collect is None else arrays, [done])

    def after(self, done, tree):
        done = [t for t in tf.nest.flatten(done) if tf.is_tensor(t)]
        # The slices of `tree` wait for `done`, not copies of it.
        return _After(tree, done) if done else tree

    def join(self, collected, last, split):
        flat = tf.nest.flatten(last)
        if collected is None:
            return last

        def joined():
            found = []
            for array, output in zip(collected, flat, strict=True):
                stacked = tf.reshape(
                    array.stack(), tf.concat([[-1], tf.shape(output)[1:]], 0)
                )
                found.append(tf.concat([stacked, output], 0))
            return found

        # An empty array has no shape to stack: a batch of one piece is it.
        count = split.count
        if isinstance(count, int):
            outputs = joined() if count > 1 else flat
        else:
            outputs = tf.cond(count > 1, joined, lambda: flat)
        return tf.nest.pack_sequence_as(last, outputs)

    def rows_of(self, x):
        return tf.shape(_batch_ops.first_input(x))[0]

    def train_result(self, state, batch_size):
        return self.model._logs_for_strategy(
            super().train_result(state, batch_size)
        )

    def test_result(self, state, loss, batch_size):
        return self.model._logs_for_strategy(
            super().test_result(state, loss, batch_size)
        )

    # -- Keras's functions around the step ------------------------------------

    def unpack_call(self, kind, args):
        # Keras's train and test functions take an iterator, its predict
        # function a list of batches.
        (batches,) = args
        return (), iter(batches)

    def pack_call(self, kind, state, batches):
        return (list(batches),) if kind == "predict" else (batches,)

    def train_call(self, function, args):
        (iterator,) = args
        model = self.model
        if (
            model.run_eagerly
            or not isinstance(
                iterator, (tf.data.Iterator, tf.distribute.DistributedIterator)
            )
            or _has_optionals(iterator.element_spec)
        ):
            # Keras's own function takes these batches in Python too (a
            # list's iterator, `train_on_batch`'s) or eagerly.
            return function.train_each(args)
        size = function.settled_size()
        if size is None:  # "auto" sizes from the batch itself.
            return function.train_each(args)
        outputs = None
        steps = model.steps_per_execution
        while True:
            graph, call = self._graph_train(function.inner, iterator)
            try:
                return call(iterator, steps)
            except tf.errors.OutOfRangeError:
                if outputs is None:
                    raise
                # The redone batch was the data's last.
                return outputs
            except BaseException as error:
                # The failed step's batch is taken out of the graph's
                # keeping whatever the error (an interrupt too): the next
                # call's step would wait for the room.
                failed = graph.failed_step()
                if failed is None or not self.is_out_of_memory(error):
                    raise
                done, batch, kept = failed
                self.restore(kept, (), error)
                oom = error
            outputs, _ = function.redo(batch, (), size, oom)
            steps -= done + 1
            if steps <= 0:
                return outputs
            size = function.settled_size()

    def _graph_train(self, inner, iterator):
        """`(GraphTrainFunction, its call checked to reach the window)` for
        Keras's train function `inner` (whose step was made at the size
        in force), made anew where it, the window or the batches' spec
        changed."""
        cache = self.sizes.cache
        spec = iterator.element_spec
        found = cache.get("graph")
        if (
            found is None
            or found[0] is not inner
            or found[1] is not self.model._window
            or found[2] != spec
        ):
            from keras_accum._trainer import _checked_train_function

            model = self.model
            parts = _parts(model.distribute_strategy, self.written_variables())
            distributed = isinstance(
                iterator, tf.distribute.DistributedIterator
            )
            graph = GraphTrainFunction(model, parts, spec, distributed)
            checked = _checked_train_function(model, graph)
            found = (inner, model._window, spec, graph, checked)
            cache["graph"] = found
        return found[3], found[4]

    # -- Sizing, and redoing a batch ------------------------------------------

    def batch_rows(self, batch):
        # A distributed batch: each replica splits its own part.
        first = _batch_ops.first_input(batch)
        local = self.model.distribute_strategy.experimental_local_results(first)
        return int(local[0].shape[0])

    def is_out_of_memory(self, error):
        return isinstance(error, tf.errors.ResourceExhaustedError)

    def can_redo(self):
        # Another worker, its step whole, would wait in the next exchange.
        return not multi_worker(self.model.distribute_strategy)

    def snapshot(self):
        cache = self.sizes.cache
        window = self.model._window
        if cache.get("window", False) is not window:
            cache["window"] = window
            parts = _parts(
                self.model.distribute_strategy, self.written_variables()
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

    def restore(self, kept, state, error):
        for part, value in kept:
            part.assign(value)
        return state

    def sizing_method(self):
        exact = all(d == "CPU" for d, _ in self._replica_devices())
        return exact, (
            "TensorFlow's allocator peak over probe steps "
            "(tf.config.experimental.get_memory_info)"
        )

    def device_memory(self):
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
            f". Received: micro_batch_size={self.setting!r} on "
            f"{sorted(kinds)}"
        )

    def _replica_devices(self):
        """`[(device type, index)]` of the devices the step runs on."""
        try:
            names = self.model.distribute_strategy.extended.worker_devices
        except RuntimeError:  # The default strategy: the default device.
            gpu = bool(tf.config.list_logical_devices("GPU"))
            return [("GPU", 0)] if gpu else [("CPU", 0)]
        found = []
        for name in names:
            spec = tf.DeviceSpec.from_string(name)
            found.append((spec.device_type or "CPU", spec.device_index or 0))
        return found

    @contextlib.contextmanager
    def probing(self, kind, batch, state):
        """`measure(size)`: the peak, in bytes, of the step of `kind` run
        on `batch` at that size (the largest of the replicas' devices; None
        if it ran out of memory): this model's state and the batch, plus
        what the step allocated above the memory in use when it started,
        from the allocator's figures. Memory that other models in the
        process hold is not the step's (JAX's compiled figures do not see
        it either). Every variable the probes may change is copied to the
        host first and restored after."""
        model = self.model
        strategy = model.distribute_strategy
        if multi_worker(strategy):
            # Each worker would measure its own devices and could trace a
            # step of another size than the others: their exchanges of
            # gradients would not match.
            raise NotImplementedError(
                '`micro_batch_size="auto"` does not run under '
                "MultiWorkerMirroredStrategy: the workers would size their "
                "steps apart. Give an int (the same on every worker). "
                f"Received: micro_batch_size={self.setting!r}"
            )
        variables = [
            *model.variables,
            *model.optimizer.variables,
            *model.metrics_variables,
            *model._window.variables,
        ]
        parts = _parts(strategy, variables)
        # Host copies: a view would keep the device's old buffer alive
        # through the probes' updates and count it in their peaks.
        kept = [np.array(part.numpy(), copy=True) for part in parts]
        devices = sorted({f"{d}:{i}" for d, i in self._replica_devices()})
        _check_allocator_figures(devices, self.setting)
        # Each device holds its replica's copy of the state and its part
        # of the batch.
        held = sum(value.nbytes for value in kept) + _nbytes(batch, strategy)
        held //= len(devices)
        step = getattr(model, f"{kind}_step")

        def measure(size):
            set_size(size)

            def probe(data):
                return strategy.run(step, args=(data,))

            if not model.run_eagerly:
                # Traced as Keras traces its steps: without autograph.
                probe = tf.function(
                    probe,
                    autograph=False,
                    jit_compile=bool(model.jit_compile),
                )
            allocated = _allocator_peak(probe, batch, strategy, devices)
            return None if allocated is None else held + allocated

        # Each probe traces the step at its size, on purpose.
        quiet = _RetracingFilter()
        tf.get_logger().addFilter(quiet)
        try:
            with self.sizes_probed(kind) as set_size:
                yield measure
        finally:
            tf.get_logger().removeFilter(quiet)
            for part, value in zip(parts, kept, strict=True):
                part.assign(value)

    # -- The whole-batch step -------------------------------------------------

    @property
    def primitives(self):
        from keras_accum import _tf_output_grads

        return _tf_output_grads

    def device_count(self):
        return self.model.distribute_strategy.num_replicas_in_sync

    def unsupported_devices(self):
        strategy = self.model.distribute_strategy
        replicas = strategy.num_replicas_in_sync
        if replicas == 1:
            return None
        # Not across workers (MultiWorkerMirroredStrategy), nor on TPUs:
        # untested.
        if type(strategy) is not tf.distribute.MirroredStrategy:
            return f"under {type(strategy).__name__} ({replicas} replicas)"
        return None

    def global_rows(self, rows):
        context = _replicas()
        if context is None:
            return rows
        return context.all_reduce("sum", tf.cast(rows, tf.float32))

    def whole_loss(self, state, data, y_pred, scale=None):
        # Each replica runs the step on its rows: the loss sees every
        # replica's (gathered), and each replica carries its own rows of
        # the output gradient back. Keras's losses divide by the replica
        # count, and the window sums the replicas: a weight the loss reads
        # itself gets its gradient once in all, and so does the loss's log;
        # the output gradient, whose rows the replicas share out, gets the
        # count back.
        context = _replicas()
        if context is None:
            return super().whole_loss(state, data, y_pred, scale)
        state, found = super().whole_loss(
            state, _gathered(context, data), _gathered(context, y_pred), scale
        )
        rows = tf.shape(tf.nest.flatten(y_pred)[0])[0]
        sizes = context.all_gather(tf.reshape(rows, [1]), axis=0)
        start = tf.reduce_sum(sizes[: context.replica_id_in_sync_group])
        replicas = context.num_replicas_in_sync
        own = tf.nest.map_structure(
            lambda g: _sliced(g, start, rows) * tf.cast(replicas, g.dtype),
            found.y_pred,
        )
        return state, found._replace(y_pred=own)

    def whole_test(self, state, data, y_pred):
        # Every replica evaluates the global batch (its loss undivided by
        # the replica count: `unscale_loss_for_distribution`); the logs
        # average the replicas' equal values.
        context = _replicas()
        if context is None:
            return super().whole_test(state, data, y_pred)
        return super().whole_test(
            state, _gathered(context, data), _gathered(context, y_pred)
        )

    def add_piece(self, state, grads, share, count, closes):
        model = self.model
        window = model._window_for_step()
        model._life.none_grads = [g is None for g in grads]
        # The window's counters wait for every gradient (as
        # `_add_to_window` says why).
        ready = [getattr(g, "values", g) for g in grads if g is not None]
        ready.append(share.loss)
        model._add_to_window(window, grads, share, ready, closes, count)
        return state


class GraphTrainFunction:
    """Keras's train function for the split step, its batches kept in the
    graph: called with the iterator (a `tf.data` iterator, or a
    `tf.distribute` strategy's distributed one), it takes up to `steps`
    batches out of it in the graph, each step run by `strategy.run` (the
    one-step function compiled with XLA where `jit_compile` says, as
    Keras's own): `steps_per_execution` steps in one graph call, one per
    call from a distributed iterator.

    Before each step runs, the graph keeps the step's index in the call,
    its batch (its flattened components: every replica's part under a
    strategy) and what the step writes before its window closes (the
    `snapshot`'s variables' values, every replica's copy) in a queue of
    one on the host, and drops them once the step is done. A step that
    raises leaves them: `failed_step` gives them back, for the batch to be
    undone and redone in Python (`_sizing.SplitFunction.redo`) and the
    call's other batches run after it: none is lost.

    Args:
        model: The `AccumModel`.
        parts: The `tf.Variable`s the step writes before its window
            closes.
        spec: The iterator's `element_spec`.
        distributed: Whether the iterator is a distributed one.
    """

    def __init__(self, model, parts, spec, distributed: bool) -> None:
        self.parts = parts
        self.spec = spec
        specs = tf.nest.flatten(spec, expand_composites=True)
        self.components = len(specs)
        with tf.init_scope(), tf.device("/device:CPU:0"):
            self.queue = tf.queue.FIFOQueue(
                1,
                [tf.int32]
                + [s.dtype for s in specs]
                + [part.dtype for part in parts],
            )
        self.steps = {}
        # The steps one call takes; `before`: those earlier calls of the
        # same `__call__` took.
        self.every = model.steps_per_execution
        if distributed:
            # A collective all-reduce in the step (`MirroredStrategy` on
            # CPUs) takes its key when the function is called
            # (`capture_call_time_value`), which a step called inside a
            # `tf.cond` or `tf.while_loop` does not get: "You must feed a
            # value for placeholder tensor", as Keras's own function with
            # steps_per_execution > 1 there. One step per call, the calls
            # looped in Python, each batch still taken in the graph.
            self.every = 1
        self.before = 0
        strategy = self.strategy = model.distribute_strategy

        def one_step(data):
            outputs = strategy.run(model.train_step, args=(data,))
            # The replicas' logs, reduced as Keras's own function does.
            return _compat.reduce_per_replica(outputs, strategy)

        if not model.run_eagerly:
            one_step = tf.function(
                one_step,
                reduce_retracing=True,
                jit_compile=bool(model.jit_compile),
                autograph=False,
            )
        self.one_step = one_step
        self.function = tf.function(
            self._steps_on_iterator, reduce_retracing=True, autograph=False
        )

    def _kept_step(self, data, index):
        """Step `index` of the call on `data`, which waits for its batch
        and the values the step writes to be kept, and drops them once
        done."""
        flat = tf.nest.flatten(data, expand_composites=True)
        values = [part.read_value() for part in self.parts]
        put = self.queue.enqueue([index, *flat, *values])
        # The step's call waits for the keeping (each replica's part left
        # where the iterator put it).
        with tf.control_dependencies([put]):
            outputs = self.one_step(data)
        with tf.control_dependencies(tf.nest.flatten(outputs)):
            dropped = self.queue.dequeue()
        # The outputs wait for the batch to be dropped.
        with tf.control_dependencies(dropped):
            return tf.nest.map_structure(tf.identity, outputs)

    def _steps_on_iterator(self, iterator, steps):
        outputs = self._kept_step(iterator.get_next(), tf.constant(0))
        if self.every == 1:
            return outputs

        def more(i, outputs):
            return i < steps

        def step(i, outputs):
            optional = iterator.get_next_as_optional()
            has = optional.has_value()
            outputs = tf.cond(
                has,
                lambda: self._kept_step(optional.get_value(), i),
                lambda: outputs,
            )
            # No batch left: the loop ends.
            return tf.where(has, i + 1, steps), outputs

        invariants = tf.nest.map_structure(
            lambda t: tf.TensorShape(None), outputs
        )
        _, outputs = tf.while_loop(
            more,
            step,
            (tf.constant(1), outputs),
            shape_invariants=(tf.TensorShape([]), invariants),
        )
        return outputs

    def __call__(self, iterator, steps: int):
        """The last step's outputs of up to `steps` steps on `iterator`'s
        batches (at least one: `OutOfRangeError` where none is left)."""
        outputs = None
        for before in range(0, steps, self.every):
            self.before = before
            try:
                outputs = self.function(
                    iterator, self._count(min(self.every, steps - before))
                )
            except tf.errors.OutOfRangeError:
                if outputs is None:
                    raise
                break
        return outputs

    def _count(self, steps):
        count = self.steps.get(steps)
        if count is None:
            count = self.steps[steps] = tf.constant(steps, tf.int32)
        return count

    def failed_step(self):
        """After a call raised: `(steps done before, the failed step's
        batch, [(variable, value before the step)])`, taken out of the
        queue; None where no step failed (the error came from elsewhere)."""
        if int(self.queue.size()) == 0:
            return None
        index, *values = self.queue.dequeue()
        flat = values[: self.components]
        batch = tf.nest.pack_sequence_as(
            self.spec, flat, expand_composites=True
        )
        kept = list(zip(self.parts, values[self.components :], strict=True))
        done = self.before + int(index)
        return done, self._on_replicas(batch), kept

    def _on_replicas(self, batch):
        """`batch`, kept on the host, as the iterator gave it: a
        distributed batch's parts back on their replicas' devices."""
        strategy = self.strategy
        leaves = tf.nest.flatten(batch)
        # Across workers a batch is not redone (`can_redo`).
        if multi_worker(strategy) or not any(
            isinstance(v, tf.distribute.DistributedValues) for v in leaves
        ):
            return batch
        devices = strategy.extended.worker_devices

        def part(context):
            replica = context.replica_id_in_sync_group
            with tf.device(devices[replica]):
                return tf.nest.map_structure(
                    lambda value: tf.identity(
                        strategy.experimental_local_results(value)[replica]
                    ),
                    batch,
                )

        return strategy.experimental_distribute_values_from_function(part)


def _has_optionals(spec) -> bool:
    """Whether a batch of `spec` holds `tf.experimental.Optional`s, which
    Keras's function turns into None before the step."""
    return any(
        isinstance(s, tf.OptionalSpec)
        for s in tf.nest.flatten(spec, expand_composites=False)
    )


def multi_worker(strategy) -> bool:
    """Whether `strategy` runs over several workers."""
    return isinstance(
        strategy, tf.distribute.MultiWorkerMirroredStrategy
    ) and _compat.in_multi_worker_mode(strategy)


def _replicas():
    """The replica context of a step under several replicas, else None."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return None
    return context


def _gathered(context, tree):
    """Every replica's rows of each tensor in `tree`, in the replicas'
    order: the global batch's (None passes)."""

    def gathered(t):
        if t is None:
            return None
        if isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
            raise NotImplementedError(
                "`whole_batch_loss=True` under a `tf.distribute` strategy "
                "gathers the batch over the replicas for the loss, and does "
                "not gather ragged or sparse tensors yet: densify them in "
                "the input pipeline, or train on one replica. Received: a "
                f"{type(t).__name__} in the batch"
            )
        return context.all_gather(t, axis=0)

    return tf.nest.map_structure(gathered, tree)


class _After(NamedTuple):
    """A tree whose pieces are sliced after `done` (`after`)."""

    tree: Any
    done: list


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


def _sliced(t, start, size):
    """`size` rows from `start` of tensor `t` (`tf.slice`, whose size XLA
    needs known when it compiles)."""
    if t is None:
        return None
    if isinstance(t, tf.RaggedTensor):
        # Rows of a ragged tensor: its row splits, sliced.
        start_ = tf.cast(start, t.row_splits.dtype)
        return t[start_ : start_ + tf.cast(size, t.row_splits.dtype)]
    if isinstance(t, tf.SparseTensor):
        rest = t.shape.rank - 1
        begin = tf.stack([tf.cast(start, tf.int64)] + [0] * rest)
        extent = tf.concat([[tf.cast(size, tf.int64)], t.dense_shape[1:]], 0)
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
    sliced = tf.slice(t, begin, extent)
    # A slice at a tensor's position loses every static dimension; the
    # layers need the others (a Keras convolution whose channels are
    # unknown runs compiled apart, on a slower path, on CPU).
    rows = size if isinstance(size, int) else None
    sliced.set_shape([rows, *t.shape[1:]])
    return sliced
