"""The split mode's steps, written once over a backend's `BatchOps`.

With `micro_batch_size=m`, `fit`, `evaluate` and `predict` split each
batch into pieces of `m` rows inside one step: all pieces but the last in
the backend's loop (one traced piece, whose activations do not outlive an
iteration), the last (maybe shorter) after it. `train_step`, `test_step`
and `predict_step` below are those steps, for every backend; what differs
between backends is behind `BatchOps`, the way the window's rules
(`_window.py`) see the accumulators through `WindowOps`:

- the batch: its sizes (`split`), a piece of any tree of arrays (`piece`:
  every device's rows, sliced where they are), the loop over pieces
  (`loop`, which carries a value and may collect one output per piece),
  the order after it (`after`) and the outputs joined (`join`);
- one piece through the model, in the backend's step signature
  (`train_piece`, `evaluate_piece`, `predict_piece`), and the step's
  result (`train_result`, `test_result`, `predict_result`);
- Keras's functions around the step (`unpack_call`, `pack_call`,
  `step_result`, `call_result`, `train_call`) and what
  `_sizing.SplitFunction` needs to size the pieces and redo a batch that
  ran out of memory (`snapshot`, `restore`, `give_up`, `is_out_of_memory`,
  `probing`, `device_memory`, `sizing_method`, `fresh`).

`BaseBatchOps` holds what backends share; `EagerStateOps` the pieces of the
backends whose step changes the variables in place (TensorFlow, PyTorch);
`_tf_batch.py`, `_jax_batch.py` and `_torch_batch.py` the rest.

A new kind of split step is written once here against the same seam: its
loop carries what it needs (outputs being collected, a cotangent being
sliced with `piece`), as the three steps below do.
`whole_batch_train_step` and `whole_batch_test_step` are such steps
(`whole_batch_loss=True`): two passes over the pieces around one loss on
the whole batch's outputs (`_output_grads`, `_seeds`, `_coupling`).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import keras
from keras import ops

from keras_accum import _compat, _window
from keras_accum import _normalizer as normalizers
from keras_accum._window_log import LOG_CAPACITY


class Split(NamedTuple):
    """How a batch splits into pieces.

    Attributes:
        batch_size: The batch's samples, every device's (an int, or a
            scalar tensor where it is known only when the step runs).
        rows: The rows each device splits (the batch's under one device).
        count: How many pieces (at least 1).
        size: The micro-batch size: the rows of every piece but the last.
        full: The rows of a piece in the loop, never above `rows` (XLA
            compiles the loop's slice even where it never runs).
    """

    batch_size: Any
    rows: Any
    count: Any
    size: int
    full: Any

    @property
    def last_start(self):
        """The first row of the last piece."""
        return (self.count - 1) * self.size

    @property
    def last_rows(self):
        """The rows of the last piece (maybe fewer than `size`)."""
        return self.rows - self.last_start


class Looped(NamedTuple):
    """What `BatchOps.loop` returns.

    Attributes:
        carry: The carried value after the last iteration.
        collected: With `collect`, the outputs of every iteration, stacked
            (for `BatchOps.join`); else None.
        done: What work after the loop waits for (`BatchOps.after`).
    """

    carry: Any
    collected: Any
    done: Any


class EvaluatedPiece(NamedTuple):
    """An evaluated piece's part of the batch's loss (float32).

    Attributes:
        term: Its loss times what it averaged over; where the losses sum,
            its loss less the regularization (which the batch counts
            once).
        normalizer: What it averaged over (zero where the losses sum).
        regularization: The model's regularization losses.
    """

    term: Any
    normalizer: Any
    regularization: Any


class BatchOps(Protocol):
    """What a backend does with a batch that its step splits.

    `state` is the backend's step state: JAX's values (its step is a
    function of them), an empty tuple where the step changes the variables
    in place.
    """

    # -- The batch ------------------------------------------------------------

    def split(self, data, size: int) -> Split:
        """How `data` (a step's batch) splits into pieces of `size`."""
        ...

    def piece(self, tree, start, size):
        """Rows `start` to `start + size` (ints, or scalar tensors in the
        step) of every array in `tree` (None passes); on several devices,
        of each device's rows, which stay where they are."""
        ...

    def loop(self, count, body: Callable, carry, collect=None) -> Looped:
        """Runs `body(i, carry)` for `i` in `[0, count)`, one iteration at
        a time, in the backend's loop (`count` may be zero, and a tensor).
        `body` returns the new carry; where `collect` is given (an output
        of one piece, for its structure and dtypes), `(carry, output)`,
        the outputs stacked for `join`."""
        ...

    def after(self, done, tree):
        """`tree`, its pieces read only after `done` (a loop's, or any
        tree of arrays); for `piece` only."""
        ...

    def join(self, collected, last, split: Split):
        """The outputs of a split batch in its rows' order: `collected`
        (from `loop`) then `last`'s."""
        ...

    # -- One piece, in the backend's step signature ---------------------------

    def train_piece(self, state, piece, count, closes: bool):
        """Adds `piece` to the window (of `count` pieces), and applies the
        window where `closes` and it is complete. Returns the state."""
        ...

    def evaluate_piece(self, state, piece) -> tuple[Any, EvaluatedPiece]:
        """Evaluates `piece` (metrics updated): `(state, its loss part)`."""
        ...

    def predict_piece(self, state, x) -> tuple[Any, Any]:
        """`(state, outputs)` of inputs `x`."""
        ...

    def train_result(self, state, batch_size):
        """The train step's return, its batch's loss tracked once."""
        ...

    def test_result(self, state, loss, batch_size):
        """The test step's return, with the batch's `loss` tracked."""
        ...

    def predict_result(self, state, outputs):
        """The predict step's return."""
        ...

    # -- The whole-batch step (`whole_batch_loss=True`) ----------------------

    def seeds_start(self, state):
        """The random generators' states as the batch's step starts
        (`_seeds`), for `forward_piece`, `vjp_piece`, `seeds_finish`."""
        ...

    def forward_piece(self, state, x, start, i):
        """`(state, outputs)` of piece `i`'s inputs `x` in training mode,
        its draws those piece `i` starts at, no gradients recorded."""
        ...

    def loss_scale(self, state):
        """The factor the optimizer's `scale_loss` puts on a loss in this
        step (a float32 scalar: a `LossScaleOptimizer`'s dynamic scale, or
        `loss_scale_factor`); None where it scales nothing."""
        ...

    def whole_loss(self, state, data, y_pred, scale=None):
        """`(state, _output_grads.OutputGrads)` of the whole batch's
        `data = (x, y, sample_weight)` and outputs, its gradients those of
        the loss times `scale` (`loss_scale`; None: unscaled); the
        compiled metrics updated with them."""
        ...

    def vjp_piece(self, state, x, output_grads, draws, last: bool, scale=None):
        """`(state, gradients, extra)`: piece `i` forward again (`draws`:
        `(start, i)`, its draws as `forward_piece`'s), and the
        vector-Jacobian product of its outputs with `output_grads`; on
        the `last` piece plus the gradient of the model's own losses times
        `scale` (`loss_scale`), `extra` their value so scaled (None
        elsewhere)."""
        ...

    def add_piece(self, state, grads, share, count, closes: bool):
        """Adds a piece's `grads` (weighted already) and `_window.Share`
        to the window of `count` pieces; applies it where `closes`."""
        ...

    def seeds_finish(self, state, start, last_piece):
        """The generators put where one forward pass of the batch leaves
        them."""
        ...

    def test_forward(self, state, x, keep_losses: bool):
        """`(state, outputs)` of inputs `x`, not training; `keep_losses`
        on the one piece whose forward pass's own losses `whole_test`
        adds (never in the loop)."""
        ...

    def whole_test(self, state, data, y_pred):
        """`(state, loss)`: the whole batch's loss as `keras.Model`
        evaluates it; the compiled metrics updated."""
        ...

    def device_count(self) -> int:
        """The devices the step's batch is split over."""
        ...

    def unsupported_devices(self) -> str | None:
        """Where the devices are laid out in a way the whole-batch step
        does not make exact: what they are, for the error (e.g. "under
        MultiWorkerMirroredStrategy over 2 workers"); None where it
        does."""
        ...

    def global_rows(self, rows):
        """The rows of the batch over every device, from `rows` (a split's
        `batch_size`): the batch the whole-batch loss sees and its logs
        are weighted by."""
        ...

    # -- Keras's functions around the step (`_sizing.SplitFunction`) ----------

    def unpack_call(self, kind: str, args) -> tuple[Any, Iterator]:
        """`(state, batches)` of a call to Keras's function of `kind`."""
        ...

    def pack_call(self, kind: str, state, batches) -> tuple:
        """The arguments of Keras's function of `kind`."""
        ...

    def step_result(self, result) -> tuple[Any, Any]:
        """`(outputs, state)` of a train function's call."""
        ...

    def call_result(self, outputs, state):
        """A train function's return, from its last step's."""
        ...

    def train_call(self, function, args):
        """A call of the train function `function` (a
        `_sizing.SplitFunction`) with Keras's `args`: up to
        `steps_per_execution` steps, a step that ran out of memory redone
        on its own batch (`BaseBatchOps`: `function.train_each`, the
        batches taken in Python)."""
        ...

    # -- Sizing the pieces, and redoing a batch --------------------------------

    def size(self, kind: str) -> int:
        """The micro-batch size the step of `kind` splits its batch into
        (`BaseBatchOps` has it)."""
        ...

    def batch_rows(self, batch) -> int:
        """The rows each device splits of `batch`, before its step runs."""
        ...

    def signature(self, batch):
        """What a micro-batch size is chosen for (None: every batch)."""
        ...

    def fresh(self, kind: str):
        """Keras's function of `kind` traced anew (the size changed), this
        model's only; the model's own function left in place."""
        ...

    def probing(self, kind: str, batch, state):
        """A context that yields `measure(size)`: the step's peak bytes
        at that size (None where it ran out of memory)."""
        ...

    def sizing_method(self) -> tuple[bool, str]:
        """`(exact, described)`: whether a probe runs nothing (a compiled
        analysis), and what measures."""
        ...

    def device_memory(self) -> tuple[int, str]:
        """`(bytes, where they come from)` of the device."""
        ...

    def snapshot(self):
        """What a train step writes before its window closes, kept."""
        ...

    def restore(self, kept, state, error):
        """Undoes a failed train step (`kept` from `snapshot`); returns
        the state to redo it from."""
        ...

    def give_up(self, state) -> None:
        """Before an out-of-memory error no smaller size helps is raised:
        puts `state` where the model's variables read it."""
        ...

    def is_out_of_memory(self, error) -> bool:
        """Whether `error` is the backend's out-of-memory error."""
        ...

    def can_redo(self) -> bool:
        """Whether a batch that ran out of memory may be redone."""
        ...


# -- The split steps, written once --------------------------------------------


def train_step(batch_ops: BatchOps, state, data):
    """The split train step: every piece into one window, which the last
    closes: one update for the batch."""
    split = batch_ops.split(data, batch_ops.size("train"))

    def one(i, state):
        # Never the window's last: no close in the loop's body (one
        # conditional update, and one exchange between replicas, which a
        # loop's body cannot hold on TensorFlow).
        piece = batch_ops.piece(data, i * split.size, split.full)
        return batch_ops.train_piece(state, piece, split.count, closes=False)

    looped = batch_ops.loop(split.count - 1, one, state)
    # After the loop: beside it, the last piece's activations would add
    # to an iteration's at the peak.
    rest = batch_ops.after(looped.done, data)
    last = batch_ops.piece(rest, split.last_start, split.last_rows)
    state = batch_ops.train_piece(looped.carry, last, split.count, closes=True)
    return batch_ops.train_result(state, split.batch_size)


def test_step(batch_ops: BatchOps, state, data):
    """The split test step: the batch's loss as `keras.Model` computes it,
    tracked once; the metrics add every piece up."""
    split = batch_ops.split(data, batch_ops.size("test"))
    zero = ops.zeros((), "float32")

    def one(i, carried):
        state, term, normalizer = carried
        piece = batch_ops.piece(data, i * split.size, split.full)
        state, part = batch_ops.evaluate_piece(state, piece)
        return state, term + part.term, normalizer + part.normalizer

    looped = batch_ops.loop(split.count - 1, one, (state, zero, zero))
    state, term, normalizer = looped.carry
    rest = batch_ops.after(looped.done, data)
    last = batch_ops.piece(rest, split.last_start, split.last_rows)
    state, part = batch_ops.evaluate_piece(state, last)
    total = EvaluatedPiece(
        term + part.term, normalizer + part.normalizer, part.regularization
    )
    loss = evaluated_loss(batch_ops.model, total)
    return batch_ops.test_result(state, loss, split.batch_size)


def predict_step(batch_ops: BatchOps, state, data):
    """The split predict step: every piece's outputs, joined in the
    batch's order."""
    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    split = batch_ops.split(data, batch_ops.size("predict"))
    # The last piece first: its outputs give the loop's their structure
    # and dtypes.
    last = batch_ops.piece(x, split.last_start, split.last_rows)
    state, outputs = batch_ops.predict_piece(state, last)
    # After it, not beside it.
    rest = batch_ops.after(outputs, x)

    def one(i, state):
        return batch_ops.predict_piece(
            state, batch_ops.piece(rest, i * split.size, split.full)
        )

    looped = batch_ops.loop(split.count - 1, one, state, collect=outputs)
    outputs = batch_ops.join(looped.collected, outputs, split)
    return batch_ops.predict_result(looped.carry, outputs)


def whole_batch_train_step(batch_ops: BatchOps, state, data):
    """The whole-batch train step (`whole_batch_loss=True`): the loss sees
    the whole batch, its gradient carried back piece by piece.

    Pass 1 runs every piece forward in training mode without gradients
    and keeps only its outputs; the loss (and the compiled metrics) see
    the batch's outputs at once, and the loss is differentiated once, with
    respect to them (`_output_grads`); pass 2 runs every piece forward
    again, its random draws replayed (`_seeds`), and adds the
    vector-Jacobian product of its outputs with its rows of that output
    gradient to the window; the last piece closes it. The loss is the
    batch's mean already: the pieces' gradients add up to the batch's, so
    every piece enters the window with a normalizer of zero (a summed
    window, divided by one), the batch's loss carried by the last."""
    model = batch_ops.model
    check_whole_batch(model, batch_ops)
    split = batch_ops.split(data, batch_ops.size("train"))
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    start = batch_ops.seeds_start(state)

    # Pass 1: the batch's outputs, without gradients.
    state, y_pred = _whole_batch_outputs(batch_ops, state, x, split, start)

    # The loss on the whole batch, and its gradient with respect to the
    # outputs; the metrics see the whole batch once. Under loss scaling
    # the loss is scaled before it is differentiated, as `keras.Model`
    # scales it: the output gradient of float16 outputs would underflow
    # otherwise. The window holds scaled gradients, which the optimizer
    # unscales (or skips, lowering its scale) at the close, as for the
    # split mode's windows.
    scale = batch_ops.loss_scale(state)
    state, found = batch_ops.whole_loss(
        state, (x, y, sample_weight), y_pred, scale
    )
    output_grads = found.y_pred
    zero = ops.zeros((), "float32")

    # Pass 2: each piece's vector-Jacobian product into the window.
    def backward(i, state):
        start_row = i * split.size
        piece_x = batch_ops.piece(x, start_row, split.full)
        piece_grads = batch_ops.piece(output_grads, start_row, split.full)
        state, grads, _ = batch_ops.vjp_piece(
            state, piece_x, piece_grads, (start, i), last=False
        )
        # A weight only the loss reads gets its gradient on the last
        # piece: zeros before, so that every piece writes the same
        # accumulators (the window's first piece overwrites them).
        grads = [
            ops.zeros_like(w) if g is None and w is not None else g
            for g, w in zip(grads, found.weights, strict=True)
        ]
        share = _window.Share(None, 0.0, zero, batch_ops.rows_of(piece_x))
        return batch_ops.add_piece(
            state, grads, share, split.count, closes=False
        )

    looped = batch_ops.loop(split.count - 1, backward, state)
    # `after` gives what only `piece` reads: one for each tree.
    rest = batch_ops.after(looped.done, x)
    output_grads = batch_ops.after(looped.done, output_grads)
    last_x = batch_ops.piece(rest, split.last_start, split.last_rows)
    last_grads = batch_ops.piece(
        output_grads, split.last_start, split.last_rows
    )
    # The last piece adds the model's own losses (counted once, as the
    # batch counts its weights' regularization) and the gradient of the
    # weights the loss reads itself.
    state, grads, extra = batch_ops.vjp_piece(
        looped.carry,
        last_x,
        last_grads,
        (start, split.count - 1),
        last=True,
        scale=scale,
    )
    grads = [
        g if w is None else (w if g is None else g + ops.cast(w, g.dtype))
        for g, w in zip(grads, found.weights, strict=True)
    ]
    extra = ops.cast(extra, "float32")
    if scale is not None:
        extra = extra / scale
    loss = ops.cast(found.loss, "float32") + extra
    share = _window.Share(None, 0.0, loss, batch_ops.rows_of(last_x))
    state = batch_ops.add_piece(state, grads, share, split.count, closes=True)
    state = batch_ops.seeds_finish(state, start, split.count - 1)
    return batch_ops.train_result(
        state, batch_ops.global_rows(split.batch_size)
    )


def _whole_batch_outputs(batch_ops: BatchOps, state, x, split, start):
    """Pass 1 of `whole_batch_train_step`: `(state, the batch's outputs)`,
    every piece forward in training mode without gradients. The last
    piece first: its outputs give the loop's their structure and dtypes."""
    last_x = batch_ops.piece(x, split.last_start, split.last_rows)
    state, last_pred = batch_ops.forward_piece(
        state, last_x, start, split.count - 1
    )
    rest = batch_ops.after(last_pred, x)

    def forward(i, state):
        piece_x = batch_ops.piece(rest, i * split.size, split.full)
        return batch_ops.forward_piece(state, piece_x, start, i)

    looped = batch_ops.loop(split.count - 1, forward, state, collect=last_pred)
    return looped.carry, batch_ops.join(looped.collected, last_pred, split)


def whole_batch_test_step(batch_ops: BatchOps, state, data):
    """The test step with `whole_batch_loss=True`: the pieces' outputs
    (inference mode) joined, and the loss and the compiled metrics on the
    whole batch at once, as `keras.Model` evaluates the batch."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    split = batch_ops.split(data, batch_ops.size("test"))
    # The last piece first: its outputs give the loop's their structure
    # and dtypes; its forward pass's own losses are the batch's (weight
    # regularization).
    last = batch_ops.piece(x, split.last_start, split.last_rows)
    state, outputs = batch_ops.test_forward(state, last, keep_losses=True)
    rest = batch_ops.after(outputs, x)

    def one(i, state):
        piece_x = batch_ops.piece(rest, i * split.size, split.full)
        return batch_ops.test_forward(state, piece_x, keep_losses=False)

    looped = batch_ops.loop(split.count - 1, one, state, collect=outputs)
    y_pred = batch_ops.join(looped.collected, outputs, split)
    state, loss = batch_ops.whole_test(
        looped.carry, (x, y, sample_weight), y_pred
    )
    return batch_ops.test_result(
        state, loss, batch_ops.global_rows(split.batch_size)
    )


def check_whole_batch(model, batch_ops) -> None:
    """Refuses, loudly, what the whole-batch step cannot make exact (or
    was not built for yet), once per traced step."""
    from keras_accum import _coupling

    _coupling.check_no_coupling(model)
    regularized = [
        layer.name
        for layer in _compat.sublayers(model, include_self=False)
        if getattr(layer, "activity_regularizer", None) is not None
    ]
    if regularized:
        raise NotImplementedError(
            "`whole_batch_loss=True` does not yet count activity "
            "regularization as the batch does (each piece's forward pass "
            "adds its own): remove the `activity_regularizer` of "
            f"{regularized}, or train without `whole_batch_loss`. "
            "Received: whole_batch_loss=True"
        )
    if model._noise_every():
        # Its estimate reads each piece's gradient as that piece's mean
        # gradient; here the pieces' gradients are parts of one.
        raise NotImplementedError(
            "`whole_batch_loss=True` does not estimate the gradient noise "
            "scale: give `PseudoBatchLogger` `noise_scale=False`, or train "
            "without `whole_batch_loss`. Received: whole_batch_loss=True"
        )
    refused = batch_ops.unsupported_devices()
    if refused is not None:
        raise NotImplementedError(
            "`whole_batch_loss=True` runs on one device, under JAX's "
            "`keras.distribution.DataParallel` and under TensorFlow's "
            "`MirroredStrategy` (one worker), where the loss sees the global "
            "batch; not yet elsewhere. Train on one of these, or without "
            f"`whole_batch_loss`. Received: whole_batch_loss=True {refused}"
        )


# -- What backends share ------------------------------------------------------


class BaseBatchOps:
    """The parts of `BatchOps` every backend shares.

    Args:
        model: The `AccumModel`.
    """

    def __init__(self, model) -> None:
        self.model = model

    @property
    def sizes(self):
        """The `_sizing.SplitSizes` in force since `compile`."""
        return self.model._life.split

    @property
    def setting(self):
        """The `micro_batch_size` setting."""
        return self.model._micro_batch_size

    def size(self, kind: str) -> int:
        """The micro-batch size a step of `kind` (`"train"`, `"test"`,
        `"predict"`) splits its batch into: the one its function chose
        (`_sizing.SplitFunction`), else an int setting."""
        size = self.sizes.active.get(kind)
        if size is None:
            size = self.setting
        if not isinstance(size, int):
            raise RuntimeError(
                f'`micro_batch_size="auto"` chooses the size for the {kind} '
                "step when `fit`, `evaluate` or `predict` (or "
                "`train_on_batch`, `test_on_batch`, `predict_on_batch`) "
                "first runs it; this step was called directly before. Run "
                "one of them first, or give an int. Received: "
                f"micro_batch_size={self.setting!r}"
            )
        return size

    def batch_rows(self, batch) -> int:
        return int(first_input(batch).shape[0])

    def signature(self, batch):
        # One size for every batch unless a backend compiles each shape on
        # its own.
        return None

    def fresh(self, kind: str):
        model = self.model
        kept = getattr(model, f"{kind}_function")
        try:
            return model._keras_function(kind)
        finally:
            setattr(model, f"{kind}_function", kept)

    @contextlib.contextmanager
    def sizes_probed(self, kind: str):
        """Yields `set_size(size)`, which makes the step of `kind` trace at
        `size`; the size in force before comes back after."""
        active = self.sizes.active
        before = active.get(kind)

        def set_size(size):
            active[kind] = size

        try:
            yield set_size
        finally:
            if before is None:
                active.pop(kind, None)
            else:
                active[kind] = before

    def written_variables(self) -> list:
        """The variables a split train step writes before its window
        closes: the metrics', the model's state (normalization statistics,
        seed generators; not frozen weights) and the window's counters.
        The accumulators need no copy: restoring the counters reopens the
        window at its start, whose first piece overwrites them."""
        model = self.model
        frozen = _compat.created_trainable_ids(model)
        state = [
            v for v in model.non_trainable_variables if id(v) not in frozen
        ]
        # None before a model that builds only on real data first runs.
        window = model._window
        counters = [] if window is None else window.counters.flat()
        return [*model.metrics_variables, *state, *counters]

    def give_up(self, state) -> None:
        return None

    def can_redo(self) -> bool:
        return True

    def unsupported_devices(self) -> str | None:
        return None

    def global_rows(self, rows):
        return rows

    def train_call(self, function, args):
        return function.train_each(args)


class EagerStateOps(BaseBatchOps):
    """The pieces of a step that changes the model's variables in place
    (TensorFlow's, PyTorch's): the state is an empty tuple."""

    def train_piece(self, state, piece, count, closes):
        self.model._micro_batch_step(
            piece, track=False, closes=closes, length=count
        )
        return state

    def evaluate_piece(self, state, piece):
        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(piece)
        y_pred = predicted(model, x)
        loss = _compat.compute_loss(
            model, x, y, y_pred, sample_weight, training=False
        )
        part = evaluated_piece(
            model, loss, y_pred, sample_weight, self.rows_of(x)
        )
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return state, part

    def predict_piece(self, state, x):
        return state, predicted(self.model, x)

    def rows_of(self, x):
        """The rows of inputs `x`, as the step's loss weights count them."""
        return first_input(x).shape[0]

    def train_result(self, state, batch_size):
        model = self.model
        _compat.track_loss(model, batch_loss(model._window.read()), batch_size)
        return model.get_metrics_result()

    def test_result(self, state, loss, batch_size):
        _compat.track_loss(self.model, loss, batch_size)
        return self.model.get_metrics_result()

    def predict_result(self, state, outputs):
        return outputs

    def step_result(self, result):
        return result, ()

    def call_result(self, outputs, state):
        return outputs

    # -- The whole-batch step (`whole_batch_train_step`) ----------------------

    # The backend's `_output_grads` primitives (`loss_and_output_grads`,
    # `piece_vjp`), set by the subclass.
    primitives: Any = None

    def without_gradients(self):
        """A context in which a forward pass records no gradients."""
        return contextlib.nullcontext()

    def seeds_start(self, state):
        from keras_accum import _seeds

        replay = _seeds.SeedReplay(self.model)
        return replay, replay.start()

    def forward_piece(self, state, x, start, i):
        replay, values = start
        replay.enter(values, i)
        with self.without_gradients():
            return state, self.model(x, training=True)

    def loss_scale(self, state):
        return scale_of(self.model.optimizer)

    def whole_loss(self, state, data, y_pred, scale=None):
        model = self.model
        found = self.primitives.loss_and_output_grads(
            model, data, y_pred, scaled_by(scale)
        )
        x, y, sample_weight = data
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return state, found

    def vjp_piece(self, state, x, output_grads, draws, last, scale=None):
        (replay, values), i = draws
        replay.enter(values, i)
        extra_loss = model_losses(self.model, scale) if last else None
        found = self.primitives.piece_vjp(
            self.model, x, output_grads, extra_loss
        )
        return state, found.weights, found.extra

    def seeds_finish(self, state, start, last_piece):
        replay, values = start
        replay.finish(values, last_piece)
        return state

    def device_count(self) -> int:
        return 1

    def test_forward(self, state, x, keep_losses):
        return state, predicted(self.model, x)

    def whole_test(self, state, data, y_pred):
        model = self.model
        x, y, sample_weight = data
        loss = _compat.compute_loss(
            model, x, y, y_pred, sample_weight, training=False
        )
        model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        return state, _compat.unscale_loss_for_distribution(loss)


def scale_of(optimizer):
    """The factor `optimizer.scale_loss` puts on a loss (a float32 scalar,
    read now: a `LossScaleOptimizer`'s dynamic scale, or
    `loss_scale_factor`); None where it scales nothing."""
    if optimizer is None:
        return None
    if not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and (
        getattr(optimizer, "loss_scale_factor", None) is None
    ):
        return None
    return ops.cast(optimizer.scale_loss(ops.ones((), "float32")), "float32")


def scaled_by(scale) -> Callable | None:
    """The `scale_loss` of `_output_grads`' primitives: times `scale`
    (`scale_of`), or None where `scale` is None."""
    if scale is None:
        return None
    return lambda loss: loss * ops.cast(scale, loss.dtype)


def model_losses(model, scale=None) -> Callable:
    """`extra_loss(y_pred, losses)` of the last piece's forward pass: the
    model's own losses, added as `keras.Model` adds them to its loss, times
    `scale` where given (the loss scale, `scale_of`).

    Weight regularization is the batch's whatever the piece. A loss that
    `call` adds from the data (`add_loss`) would be the last piece's only:
    refused, as activity regularizers are (`check_whole_batch`)."""
    regularized = sum(
        1 for v in model.trainable_weights if getattr(v, "regularizer", None)
    )

    def extra_loss(y_pred, losses):
        if len(losses) > regularized:
            raise NotImplementedError(
                "`whole_batch_loss=True` does not yet count losses that the "
                "model's forward pass adds from its data (`add_loss` in "
                f"`call`: {len(losses) - regularized} of them), which each "
                "piece would add for its own rows only: compute them in "
                "`compute_loss` from the batch's outputs, or train without "
                "`whole_batch_loss`. Received: whole_batch_loss=True"
            )
        total = _model_losses(y_pred, losses)
        return total if scale is None else total * scale

    return extra_loss


def _model_losses(y_pred, losses):
    """The model's own losses of a forward pass, added as `keras.Model`
    adds them to its loss (a float32 zero where there are none): under
    `tf.distribute`, divided by the replica count, as Keras divides them
    on each replica (every replica's last piece adds them; the window sums
    the replicas)."""
    total = ops.zeros((), "float32")
    for value in losses:
        total = total + ops.cast(value, "float32")
    return _compat.scale_loss_for_distribution(total)


# -- Helpers ------------------------------------------------------------------


def first_input(data):
    """The first array of a batch's inputs."""
    x = keras.utils.unpack_x_y_sample_weight(data)[0]
    return next(i for i in keras.tree.flatten(x) if i is not None)


def piece_count(rows, size):
    """How many pieces of at most `size` `rows` split into (at least 1)."""
    if isinstance(rows, int):  # A static shape.
        return max(-(-rows // size), 1)
    return ops.maximum((rows + size - 1) // size, 1)


def predicted(model, x):
    """The model's outputs on `x`, not training."""
    if _compat.call_takes_training(model):
        return model(x, training=False)
    return model(x)


def batch_loss(counters):
    """The loss of the batch a split train step just closed, as
    `keras.Model` computes it: the window's published pseudo-batch loss."""
    log = counters.log
    slot = (log.count - 1) % LOG_CAPACITY
    return ops.take(log.loss, slot)


def evaluated_piece(
    model, loss, y_pred, sample_weight, batch_size
) -> EvaluatedPiece:
    """An evaluated piece's part of its batch's loss (`EvaluatedPiece`);
    the batch's is `evaluated_loss` of their sums."""
    reg = ops.cast(model._regularization_loss("float32"), "float32")
    found = normalizers.reductions(model)
    rule = normalizers.rule(found, len(keras.tree.flatten(y_pred)))
    loss = ops.cast(_compat.unscale_loss_for_distribution(loss), "float32")
    normalizer = normalizers.normalizer(
        rule.kind, y_pred, sample_weight, batch_size
    )
    if normalizer is None:
        return EvaluatedPiece(loss - reg, ops.zeros((), "float32"), reg)
    normalizer = ops.cast(normalizer, "float32")
    return EvaluatedPiece(loss * normalizer, normalizer, reg)


def evaluated_loss(model, total: EvaluatedPiece):
    """The evaluated batch's loss from its pieces' summed parts, as
    `keras.Model` computes it."""
    found = normalizers.reductions(model)
    if normalizers.rule(found, None).kind == "zero":  # The losses sum.
        return total.term + total.regularization
    return total.term / _window.window_divisor(total.normalizer)


def warn_of_batch_metrics(model, y, y_pred) -> None:
    """Warns of each compiled metric function whose value has no batch
    dimension: split, it is averaged over pieces, each counted once, where
    `keras.Model` averages it over batches. Its values are computed once,
    on the first piece after `compile` (unused: a compiled step drops
    them)."""
    found = _compat.metric_function_values(model, y, y_pred)
    # Built by the update before; unbuilt, nothing is compiled.
    model._life.batch_metrics_checked = True
    for metric, values in found:
        if len(ops.shape(values)) > 0:
            continue
        warnings.warn(
            f"The metric `{metric.name}` returns one value per batch "
            "(a scalar), not one per sample: with `micro_batch_size` "
            "it is computed on each micro-batch and averaged over "
            "them, so its logs differ from `keras.Model`'s at the "
            "batch. Return one value per sample (e.g. "
            "`ops.mean(..., axis=-1)` rather than `ops.mean(...)`), "
            "which the split adds up exactly, or train unsplit. "
            f"Received: micro_batch_size={model._micro_batch_size!r}",
            stacklevel=3,
        )
