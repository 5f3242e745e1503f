"""TensorFlow's output-gradient primitives (`_output_grads`): a tape watching
the outputs, and `tape.gradient(..., output_gradients=)`."""

from __future__ import annotations

import keras
import tensorflow as tf

from keras_accum import _output_grads


def loss_and_output_grads(
    model, data, y_pred, scale_loss=None
) -> _output_grads.OutputGrads:
    """The whole batch's loss and its gradients (`_output_grads.OutputGrads`).

    Args:
        model: `keras.Model`. Compiled, or with its own `compute_loss`.
        data: Tuple. `(x, y, sample_weight)` of the whole batch.
        y_pred: The batch's outputs, any structure (`_output_grads.join`
            of the pieces'), computed without recording gradients.
        scale_loss: Callable or None. Applied to the loss before it is
            differentiated (`optimizer.scale_loss`). Defaults to None.
    """
    flat = [tf.convert_to_tensor(t) for t in keras.tree.flatten(y_pred)]
    leaves = keras.tree.pack_sequence_as(y_pred, flat)
    weights = list(model.trainable_variables)
    with tf.GradientTape() as tape:
        # The outputs are the tape's sources, not what made them: pass 1
        # ran outside any tape.
        tape.watch(flat)
        loss = _output_grads.compute_loss_held_out(model, data, leaves)
        scaled = loss if scale_loss is None else scale_loss(loss)
    grads = tape.gradient(scaled, [*flat, *weights])
    y_grads = [
        tf.zeros_like(t) if g is None else g
        for t, g in zip(flat, grads[: len(flat)], strict=True)
    ]
    return _output_grads.OutputGrads(
        loss,
        keras.tree.pack_sequence_as(y_pred, y_grads),
        list(grads[len(flat) :]),
    )


def piece_vjp(
    model, x, output_grads, extra_loss=None
) -> _output_grads.PieceGrads:
    """One piece's forward pass (training mode) and its vector-Jacobian
    product (`_output_grads.PieceGrads`).

    Args:
        model: `keras.Model`.
        x: The piece's inputs.
        output_grads: The piece's rows of the batch's output gradient
            (`_output_grads.rows`), in the structure of the outputs.
        extra_loss: Callable or None. `extra_loss(y_pred, losses)`: a
            scalar of the forward pass whose gradient is added (the
            piece's share of the model's own losses, `losses` those of
            this forward pass). Defaults to None.
    """
    weights = list(model.trainable_variables)
    with tf.GradientTape() as tape:
        y_pred = model(x, training=True)
        extra = None if extra_loss is None else extra_loss(y_pred, model.losses)
    targets = keras.tree.flatten(y_pred)
    cotangents = [
        tf.cast(g, t.dtype)
        for t, g in zip(targets, keras.tree.flatten(output_grads), strict=True)
    ]
    if extra is not None:
        targets.append(extra)
        cotangents.append(tf.ones_like(extra))
    grads = tape.gradient(targets, weights, output_gradients=cotangents)
    return _output_grads.PieceGrads(y_pred, extra, list(grads))
