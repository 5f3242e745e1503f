"""JAX's `BatchOps` (`_batch_ops.py`): a split batch in a stateless step.

The pieces run in a `jax.lax.fori_loop` (`scan` where each piece's outputs
are kept), carrying the step's state values; a piece is a
`dynamic_slice` of every array. Under a `keras.distribution` each device
splits its own rows (the batch's shards along the batch axis): a piece
takes as many rows from every device and stays where its rows are. Every
shape of batch is compiled, and so sized, on its own.

On a CPU the loop's body is traced with its convolutions in the one
layout XLA:CPU runs fast (`cpu_convolutions`): XLA puts them there only
at the program's top level, and those autodiff writes for a gradient (the
kernel's, with the batch as the summed axis; the input's, with the
kernel's axes swapped) ran in the loop as XLA's generic loop nests.

The loop's structure, measured on XLA:CPU (`bench_micro_batch.py`'s small
CNN, 8 pieces of 32, on 2 shared cores: CPU time per sample against the
classic mode's, median of 5 rounds, then with the convolutions in the fast
layout; the compiled step's temporaries in units of the trainable
weights' size P, the classic step's being 206 P):

- `fori_loop`: 6.2x, fast layout 1.05x; 382 P;
- `scan` over the pieces' indices: 5.95x, 1.05x; 382 P;
- `fori_loop(unroll=2)`: 5.2x, 1.21x; 733 P (two pieces' activations);
- `scan` over the batch reshaped to (pieces, rows, ...), the last piece
  after it: 6.5x, 1.08x; 387 P;
- a Python loop (unrolled in the trace): 1.37x, 1.37x; 1434 P, 2837 P
  at 16 pieces (`fori_loop`: 382 P still).

`fori_loop` with the fast layout it is: the fastest, one piece's
activations at a time. Its compiled loop already carries only what the
pieces change: the weights pass through uncopied, the optimizer's state
stays outside, the accumulators are written in place (the step donates
its state). `lax.map` has no carry: it would keep every piece's gradient.
"""

from __future__ import annotations

import contextlib

import jax
import jax.experimental.sparse
import keras
from jax.extend import core as jaxpr_core

from keras_accum import _batch_ops, _compat, _jax_devices, _jax_ops, _sizing
from keras_accum._batch_ops import Looped, Split


class JaxBatchOps(_batch_ops.BaseBatchOps):
    """`BatchOps` of `JaxAccumTrainer`: the state is the step's values."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.shards = _jax_devices.data_shards()
        # XLA:CPU's convolutions in the loop need their layout written.
        self.cpu = jax.devices()[0].platform == "cpu"

    # -- The batch ------------------------------------------------------------

    def split(self, data, size):
        batch_size = _batch_ops.first_input(data).shape[0]
        shards = self.shards
        if shards > 1 and any(
            isinstance(t, jax.experimental.sparse.BCOO)
            for t in keras.tree.flatten(data)
        ):
            raise ValueError(
                "`micro_batch_size` cannot split a sparse (BCOO) batch that "
                f"a `keras.distribution` shards over {shards} devices: "
                "densify it, or unset `micro_batch_size`. Received: "
                f"micro_batch_size={self.setting!r}"
            )
        # Keras's distribution refuses a batch its devices cannot share
        # evenly before the step.
        rows = batch_size // shards
        count = _batch_ops.piece_count(rows, size)
        return Split(batch_size, rows, count, size, min(size, rows))

    def piece(self, tree, start, size):
        return keras.tree.map_structure(
            lambda t: _piece(t, start, size, self.shards), tree
        )

    def loop(self, count, body, carry, collect=None):
        if count <= 0:
            return Looped(carry, None, None)
        if self.cpu:
            body = cpu_convolutions(body)
        if collect is None:
            return Looped(jax.lax.fori_loop(0, count, body, carry), None, None)
        carry, stacked = jax.lax.scan(
            lambda carry, i: body(i, carry), carry, jax.numpy.arange(count)
        )
        return Looped(carry, stacked, None)

    def after(self, done, tree):
        # A traced program runs in its data's order.
        return tree

    def join(self, collected, last, split):
        if collected is None:
            return last
        return keras.tree.map_structure(
            lambda s, o: _joined(s, o, self.shards), collected, last
        )

    # -- One piece ------------------------------------------------------------

    def train_piece(self, state, piece, count, closes):
        return self.model._micro_batch_step(
            state, piece, track=False, closes=closes, length=count
        )[1]

    def evaluate_piece(self, state, piece):
        model = self.model
        trainable, non_trainable, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(piece)
        kwargs = {}
        if _compat.call_takes_training(model):
            kwargs["training"] = False
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        state = (trainable, non_trainable, metrics)
        with _evaluation_scope(model, state, losses) as scope:
            loss = _compat.compute_loss(
                model, x, y, y_pred, sample_weight, training=False
            )
            rows = _batch_ops.first_input(x).shape[0]
            part = _batch_ops.evaluated_piece(
                model, loss, y_pred, sample_weight, rows
            )
            model.compute_metrics(x, y, y_pred, sample_weight)
        metrics = current_values(scope, model.metrics_variables)
        return (trainable, non_trainable, metrics), part

    def predict_piece(self, state, x):
        model = self.model
        trainable, non_trainable = state
        kwargs = {}
        if _compat.call_takes_training(model):
            kwargs["training"] = False
        outputs, non_trainable = model.stateless_call(
            trainable, non_trainable, x, **kwargs
        )
        return (trainable, non_trainable), outputs

    def train_result(self, state, batch_size):
        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        count = len(model.optimizer.variables)
        _, counters = model._window.unpack(optimizer_and_window[count:])
        logs, metrics = self._tracked_logs(
            metrics, _batch_ops.batch_loss(counters), batch_size
        )
        return logs, (trainable, non_trainable, optimizer_and_window, metrics)

    def test_result(self, state, loss, batch_size):
        trainable, non_trainable, metrics = state
        logs, metrics = self._tracked_logs(metrics, loss, batch_size)
        return logs, (trainable, non_trainable, metrics)

    def _tracked_logs(self, metrics, loss, batch_size):
        """`(logs, metrics)` with `loss` in the running mean `fit` logs,
        once for the batch, as `keras.Model` adds it."""
        model = self.model
        mapping = list(zip(model.metrics_variables, metrics, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            _compat.track_loss(model, loss, batch_size)
            logs = model.get_metrics_result()
        return logs, current_values(scope, model.metrics_variables)

    def predict_result(self, state, outputs):
        return outputs, state[1]

    # -- Keras's functions around the step ------------------------------------

    def unpack_call(self, kind, args):
        state, batches = args
        return state, iter(batches)

    def pack_call(self, kind, state, batches):
        return state, batches

    def step_result(self, result):
        return result

    def call_result(self, outputs, state):
        return outputs, state

    # -- Sizing, and redoing a batch ------------------------------------------

    def batch_rows(self, batch):
        # Each device splits its own rows (`split`).
        return super().batch_rows(batch) // self.shards

    def signature(self, batch):
        # Every shape of batch is compiled, and so sized, on its own.
        return tuple(
            (tuple(leaf.shape), str(leaf.dtype))
            for leaf in jax.tree_util.tree_leaves(batch)
        )

    def fresh(self, kind):
        # Keras jits the model's bound `<kind>_step`, and `jax.jit` keeps
        # traces by the function: a new jit of the same bound method would
        # reuse the trace made at the old size. Keras is handed a new
        # function for this one model's step instead (`jax.clear_caches()`
        # would drop every compiled function in the process).
        model = self.model
        name = f"{kind}_step"
        step = getattr(model, name)

        def sized(state, data):
            return step(state, data)

        model.__dict__[name] = sized
        try:
            return super().fresh(kind)
        finally:
            del model.__dict__[name]

    def is_out_of_memory(self, error):
        return isinstance(error, jax.errors.JaxRuntimeError) and (
            "RESOURCE_EXHAUSTED" in str(error)
        )

    def snapshot(self):
        # The state is the step's argument, and no step changes it.
        return None

    def restore(self, kept, state, error):
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

    def give_up(self, state):
        # Keras's `fit` keeps the state out of the variables while it runs
        # and would leave them empty on the error.
        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        optimizer = [*model.optimizer.variables, *model._window.variables]
        pairs = [
            *zip(model.trainable_variables, trainable, strict=True),
            *zip(model.non_trainable_variables, non_trainable, strict=True),
            *zip(optimizer, optimizer_and_window, strict=True),
            *zip(model.metrics_variables, metrics, strict=True),
        ]
        for variable, value in pairs:
            variable.assign(value)

    def sizing_method(self):
        return True, "XLA's compiled memory analysis"

    def device_memory(self):
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
                f"{self.setting!r} on {device}"
            )
        return available, "the host's available memory"

    @contextlib.contextmanager
    def probing(self, kind, batch, state):
        """`measure(size)`: the peak XLA assigns the step of `kind` on
        `batch` at that size: its arguments (the state, donated as Keras
        donates them, and the batch), outputs not aliased to them, and
        temporaries. Compiles; runs nothing."""
        step = getattr(self.model, f"{kind}_step")
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
                if self.is_out_of_memory(error):
                    return None
                raise
            return _sizing.compiled_peak(compiled.memory_analysis())

        with self.sizes_probed(kind) as set_size:
            yield measure

    # -- The whole-batch step -------------------------------------------------

    def rows_of(self, x):
        return _batch_ops.first_input(x).shape[0]

    def device_count(self):
        return self.shards

    def unsupported_devices(self):
        # The step sees global arrays: pieces take every device's rows in
        # place, and the loss the joined batch. Made exact and tested under
        # `DataParallel` in one process only.
        distribution = keras.distribution.distribution()
        if self.shards > 1 and not isinstance(
            distribution, keras.distribution.DataParallel
        ):
            return (
                f"under {type(distribution).__name__} ({self.shards} "
                "devices along the batch axis)"
            )
        if jax.process_count() > 1:
            return f"over {jax.process_count()} processes"
        return None

    def seeds_start(self, state):
        from keras_accum import _seeds

        indices = _seeds.seed_state_indices(self.model)
        return indices, _seeds.start_values(state[1], indices)

    def _entered(self, non_trainable, start, i):
        from keras_accum import _seeds

        indices, values = start
        return _seeds.entered_values(non_trainable, indices, values, i)

    def forward_piece(self, state, x, start, i):
        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        kwargs = {}
        if _compat.call_takes_training(model):
            kwargs["training"] = True
        y_pred, non_trainable = model.stateless_call(
            trainable, self._entered(non_trainable, start, i), x, **kwargs
        )
        y_pred = jax.lax.stop_gradient(y_pred)
        return (trainable, non_trainable, optimizer_and_window, metrics), y_pred

    def loss_scale(self, state):
        # Read from the step's optimizer values (its dynamic scale).
        optimizer = self.model.optimizer
        values = state[2][: len(optimizer.variables)]
        mapping = list(zip(optimizer.variables, values, strict=True))
        with keras.StatelessScope(state_mapping=mapping):
            return _batch_ops.scale_of(optimizer)

    def whole_loss(self, state, data, y_pred, scale=None):
        from keras_accum import _jax_output_grads

        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        found, (non_trainable, metrics) = (
            _jax_output_grads.stateless_loss_and_output_grads(
                model,
                (trainable, non_trainable, metrics),
                data,
                y_pred,
                _batch_ops.scaled_by(scale),
            )
        )
        x, y, sample_weight = data
        mapping = list(zip(model.metrics_variables, metrics, strict=True))
        with keras.StatelessScope(state_mapping=mapping) as scope:
            model.compute_metrics(x, y, y_pred, sample_weight)
        metrics = current_values(scope, model.metrics_variables)
        return (trainable, non_trainable, optimizer_and_window, metrics), found

    def vjp_piece(self, state, x, output_grads, draws, last, scale=None):
        from keras_accum import _jax_output_grads

        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        found, non_trainable = _jax_output_grads.stateless_piece_vjp(
            model,
            trainable,
            self._entered(non_trainable, *draws),
            x,
            output_grads,
            _batch_ops.model_losses(model, scale) if last else None,
        )
        state = (trainable, non_trainable, optimizer_and_window, metrics)
        return state, found.weights, found.extra

    def add_piece(self, state, grads, share, count, closes):
        from keras_accum import _window
        from keras_accum._jax_ops import iterations_index

        model = self.model
        trainable, non_trainable, optimizer_and_window, metrics = state
        n = len(model.optimizer.variables)
        optimizer_values = list(optimizer_and_window[:n])
        window_state = model._window_for_step()
        accumulators, counters = window_state.unpack(optimizer_and_window[n:])
        backend = _jax_devices.ops_class(window_state)(
            accumulators, model.optimizer, trainable, optimizer_values
        )
        if window_state.partial_sums:
            # Each device's partial sum (`_jax_devices`): the whole batch's
            # gradient, reduced already, counts on the first.
            slots = int(accumulators[0].shape[0]) if accumulators else 1
            grads = _jax_devices.in_first_slot(grads, slots)
        updates = optimizer_values[iterations_index(model.optimizer)]
        counters, complete = _window.accumulate(
            counters, backend, grads, share, model._plan(updates, count)
        )
        if closes:
            counters, applied = _window.close(
                counters,
                backend,
                complete,
                _jax_ops.close_policy(model, backend),
            )
            non_trainable = _jax_ops.run_close_hooks(
                model, non_trainable, applied, complete
            )
        window = window_state.pack(backend.accumulators, counters)
        return (
            backend.trainable,
            non_trainable,
            [*backend.optimizer_values, *window],
            metrics,
        )

    def seeds_finish(self, state, start, last_piece):
        from keras_accum import _seeds

        trainable, non_trainable, optimizer_and_window, metrics = state
        indices, values = start
        non_trainable = _seeds.finished_values(
            non_trainable, indices, values, last_piece
        )
        return (trainable, non_trainable, optimizer_and_window, metrics)

    def test_forward(self, state, x, keep_losses):
        model = self.model
        trainable, non_trainable, metrics = state
        kwargs = {}
        if _compat.call_takes_training(model):
            kwargs["training"] = False
        y_pred, non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, return_losses=True, **kwargs
        )
        if keep_losses:
            # The same trace as `whole_test`'s (never the loop's body).
            self.kept_losses = losses
        return (trainable, non_trainable, metrics), y_pred

    def whole_test(self, state, data, y_pred):
        model = self.model
        trainable, non_trainable, metrics = state
        x, y, sample_weight = data
        with _evaluation_scope(model, state, self.kept_losses) as scope:
            loss = _compat.compute_loss(
                model, x, y, y_pred, sample_weight, training=False
            )
            model.compute_metrics(x, y, y_pred, sample_weight)
        metrics = current_values(scope, model.metrics_variables)
        return (trainable, non_trainable, metrics), loss


@contextlib.contextmanager
def _evaluation_scope(model, state, losses):
    """A stateless scope over `state`'s values (trainable, non-trainable,
    metrics), `model.losses` reading `losses` (a forward pass's) inside."""
    trainable, non_trainable, metrics = state
    mapping = [
        *zip(model.trainable_variables, trainable, strict=True),
        *zip(model.non_trainable_variables, non_trainable, strict=True),
        *zip(model.metrics_variables, metrics, strict=True),
    ]
    if losses:
        _compat.override_losses(model, losses)
    try:
        with keras.StatelessScope(state_mapping=mapping) as scope:
            yield scope
    finally:
        if losses:
            _compat.override_losses(model, None)


def current_values(scope, variables):
    """The values `scope` holds for `variables` (their own where unset)."""
    values = []
    for variable in variables:
        value = scope.get_current_value(variable)
        values.append(variable.value if value is None else value)
    return values


def _piece(t, start, size, shards=1):
    """`size` rows from `start` (an int or a traced index) of array `t`;
    with `shards` > 1, of each shard's rows (the batch seen as `shards`
    blocks along its first axis), joined: what each device holds of the
    batch, sliced where it is."""
    if t is None:  # No sample weight (`train_on_batch(x, y)`).
        return None
    if isinstance(t, jax.experimental.sparse.BCOO):
        return _sparse_piece(t, start, size)
    if shards == 1:
        return jax.lax.dynamic_slice_in_dim(t, start, size)
    blocks = t.reshape((shards, t.shape[0] // shards, *t.shape[1:]))
    piece = jax.lax.dynamic_slice_in_dim(blocks, start, size, axis=1)
    return piece.reshape((shards * size, *t.shape[1:]))


def _sparse_piece(t, start, size):
    """`size` rows from `start` of a sparse batch (`BCOO`) on one device
    (`split` refuses a sharded one): its stored elements outside them
    dropped, as many kept (a shape XLA knows)."""
    starts = (start,) + (0,) * (t.ndim - 1)
    return jax.experimental.sparse.bcoo_dynamic_slice(
        t, starts, (size, *t.shape[1:])
    )


def _joined(stacked, last, shards):
    """The outputs of a split batch in its rows' order: `stacked`, the
    loop's (one row per piece, each `_piece`'s rows), then `last`."""
    if shards == 1:
        return jax.numpy.concatenate(
            [stacked.reshape((-1, *stacked.shape[2:])), last]
        )
    features = last.shape[1:]
    # (pieces, devices, rows) to (devices, pieces, rows).
    loop = stacked.reshape((stacked.shape[0], shards, -1, *features))
    loop = jax.numpy.swapaxes(loop, 0, 1).reshape((shards, -1, *features))
    tail = last.reshape((shards, -1, *features))
    joined = jax.numpy.concatenate([loop, tail], axis=1)
    return joined.reshape((-1, *features))


# -- XLA:CPU's convolutions in a loop ------------------------------------------


def cpu_convolutions(body):
    """`body` (a loop's) with every convolution in the one layout XLA:CPU
    runs fast (inputs and outputs NHWC, kernel HWIO), transposes around it.

    XLA:CPU puts convolutions in that layout in the program's top level
    only (`ConvCanonicalization`); in a loop's body, those autodiff writes
    for a gradient (kernel and batch axes swapped) ran as generic loop
    nests, and the split step of a small CNN at 6x the classic mode's
    time (the module's docstring). The values are the same: only axes
    move.
    """

    def rewritten(*args):
        closed, shape = jax.make_jaxpr(body, return_shape=True)(*args)
        flat = jax.tree_util.tree_leaves(args)
        if _needs_layout(closed.jaxpr):
            out = _evaluated(closed.jaxpr, closed.consts, *flat)
        else:  # Nothing to move: the trace is run, not traced again.
            out = jaxpr_core.jaxpr_as_fun(closed)(*flat)
        return jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(shape), out
        )

    return rewritten


def _needs_layout(jaxpr) -> bool:
    """Whether `jaxpr` (or one inside it) has a convolution in another
    layout."""
    for eqn in jaxpr.eqns:
        if eqn.primitive is jaxpr_core.primitives.conv_general_dilated_p:
            if not _is_fast_layout(eqn.params["dimension_numbers"]):
                return True
        elif any(
            _needs_layout(j) for j in jaxpr_core.jaxprs_in_params(eqn.params)
        ):
            return True
    return False


def _evaluated(jaxpr, consts, *args):
    """The outputs of `jaxpr` on `args`, its convolutions (and those of the
    closed jaxprs in its equations: loops, conditionals, calls) in the fast
    layout."""
    env = dict(zip(jaxpr.constvars, consts, strict=True))
    env.update(zip(jaxpr.invars, args, strict=True))

    def read(v):
        return v.val if isinstance(v, jaxpr_core.Literal) else env[v]

    for eqn in jaxpr.eqns:
        values = [read(v) for v in eqn.invars]
        if eqn.primitive is jaxpr_core.primitives.conv_general_dilated_p:
            out = [_fast_layout_convolution(*values, **eqn.params)]
        else:
            params = {k: _in_fast_layout(v) for k, v in eqn.params.items()}
            with eqn.ctx.manager:
                out = eqn.primitive.bind(
                    *values, **eqn.primitive.get_bind_params(params)
                )
            if not eqn.primitive.multiple_results:
                out = [out]
        for var, value in zip(eqn.outvars, out, strict=True):
            if not isinstance(var, jaxpr_core.DropVar):
                env[var] = value
    return [read(v) for v in jaxpr.outvars]


def _in_fast_layout(param):
    """An equation's parameter, its closed jaxprs' convolutions in the fast
    layout (an open jaxpr, as `jax.checkpoint`'s, is left as it is)."""
    if isinstance(param, tuple):
        # Rebuilt only where a jaxpr in it changed: a named tuple (a sparse
        # array's `spinfo`) stays one.
        items = tuple(_in_fast_layout(p) for p in param)
        changed = any(a is not b for a, b in zip(items, param, strict=True))
        return items if changed else param
    if isinstance(param, jaxpr_core.ClosedJaxpr) and _needs_layout(param.jaxpr):
        return jax.make_jaxpr(
            lambda *args: _evaluated(param.jaxpr, param.consts, *args)
        )(*param.in_avals)
    return param


def _fast_layout(dimensions: int):
    """The dimension numbers XLA:CPU runs fast: NHWC, HWIO, NHWC."""
    spatial = tuple(range(1, dimensions + 1))
    return jax.lax.ConvDimensionNumbers(
        (0, dimensions + 1, *spatial),
        (dimensions + 1, dimensions, *range(dimensions)),
        (0, dimensions + 1, *spatial),
    )


def _is_fast_layout(numbers) -> bool:
    return tuple(numbers) == tuple(_fast_layout(len(numbers.lhs_spec) - 2))


def _fast_layout_convolution(lhs, rhs, *, dimension_numbers, **params):
    """`conv_general_dilated` on `lhs`, `rhs` with `dimension_numbers`,
    computed in the fast layout (the same values)."""
    bind = jax.lax.conv_general_dilated_p.bind
    if _is_fast_layout(dimension_numbers):
        return bind(lhs, rhs, dimension_numbers=dimension_numbers, **params)
    # Each spec lists the positions of (batch or output feature, feature
    # or input feature, spatial...).
    lhs_spec, rhs_spec, out_spec = dimension_numbers
    dimensions = len(lhs_spec) - 2
    lhs = jax.lax.transpose(lhs, (lhs_spec[0], *lhs_spec[2:], lhs_spec[1]))
    rhs = jax.lax.transpose(rhs, (*rhs_spec[2:], rhs_spec[1], rhs_spec[0]))
    out = bind(lhs, rhs, dimension_numbers=_fast_layout(dimensions), **params)
    # `out` is (batch, spatial..., feature): back to `out_spec`'s order.
    order = [0] * (dimensions + 2)
    order[out_spec[0]] = 0
    order[out_spec[1]] = dimensions + 1
    for i, position in enumerate(out_spec[2:]):
        order[position] = i + 1
    return jax.lax.transpose(out, tuple(order))
