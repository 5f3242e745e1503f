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

import warnings

import keras
import tensorflow as tf
from keras import ops

from keras_accum import _batch_ops, _compat, _tf_window, _window
from keras_accum._compat import optimizer_strategy
from keras_accum._tf_batch import TensorFlowBatchOps, multi_worker
from keras_accum._trainer import AccumTrainer


class TensorFlowAccumTrainer(AccumTrainer):
    """Accumulation for Keras's TensorFlow trainer; a base of `AccumModel`."""

    # What a split batch's steps (`_batch_ops.py`) work with.
    _batch_ops_class = TensorFlowBatchOps

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
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_train_step(
                self._batch_ops_class(self), (), data
            )
        return _batch_ops.train_step(self._batch_ops_class(self), (), data)

    def _micro_batch_step(self, data, track=True, closes=True, length=None):
        """Keras's step on `data`, its update replaced by the window's;
        `length`: the pieces of a split batch, which make its window
        (`closes`: whether this piece may close it), else None."""
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
                loss, y_pred, sample_weight, batch_size, length=length
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
        self._add_to_window(window, gradients, share, ready, closes, length)

        # Metrics.
        return self._logs_for_strategy(
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        )

    def _add_to_window(
        self, window, gradients, share, ready, closes=True, length=None
    ):
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
            self._plan(self.optimizer.iterations, length),
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
        if self._whole_batch_loss:
            return _batch_ops.whole_batch_test_step(
                self._batch_ops_class(self), (), data
            )
        return _batch_ops.test_step(self._batch_ops_class(self), (), data)

    def predict_step(self, data):
        if self._micro_batch_size is None:
            return super().predict_step(data)
        return _batch_ops.predict_step(self._batch_ops_class(self), (), data)

    def _logs_for_strategy(self, logs):
        """Works around Keras 3.15 reducing scalar logs with `axis=0`.

        Under MultiWorkerMirroredStrategy Keras averages each replica's logs
        with `strategy.reduce("MEAN", value, axis=0)`, which fails for the
        scalars every metric returns; one-element vectors average to the
        same scalar.
        """
        if not multi_worker(self.distribute_strategy):
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


def _dense_part(gradient):
    # `IndexedSlices` (embeddings) are no tensor; their values are.
    return getattr(gradient, "values", gradient)
