"""The whole-batch step's two gradient primitives, per backend.

The whole-batch step (`whole_batch_loss=True`) differentiates the loss
once, with respect to the batch's outputs, and carries that output
gradient back through each piece's forward pass as a vector-Jacobian
product (the "gradient cache", Gao et al. 2021). Its two primitives:

- `loss_and_output_grads(model, data, y_pred)`: the loss
  `Model.compute_loss` computes on the whole batch's `y_pred` (any
  structure), its gradient with respect to `y_pred`, and its gradient
  with respect to the trainable weights the loss reads itself (a
  temperature that `compute_loss` reads as `self.logit_scale`): those get
  their gradient here, exactly once, and not through the pieces.
- `piece_vjp(model, x, output_grads)`: one piece's forward pass in
  training mode and the vector-Jacobian product of its outputs with
  `output_grads` (its slice of the batch's output gradient) with respect
  to the trainable weights, plus the gradient of an optional scalar
  `extra_loss(y_pred, losses)` of the same forward pass.

The model's own losses (`model.losses`: weight regularization, activity
regularization, `add_loss`) are held out of the first: `compute_loss`
runs with `model.losses` reading a single zero, so a default or a
user's `compute_loss` that adds `self.losses` adds nothing. They belong
to the pieces' forward passes, where the step adds them through
`extra_loss` with the weighting the batch gives them (weight
regularization once per batch; the split mode's `_regularization_loss`
rule). A `compute_loss` that weights `self.losses` otherwise than by
adding them is not reproduced.

Gradients are lists aligned with `model.trainable_variables`: None for a
weight the loss (first primitive) or the piece's outputs (second) do not
reach on TensorFlow and PyTorch; on JAX the first is None where the loss's
traced computation does not read the weight and the second is always a
tensor (zeros where unreached).

Mixed precision: `scale_loss` (e.g. `optimizer.scale_loss`) scales the
loss before it is differentiated, so the output gradient is the scaled
one (float16 outputs keep their small gradients); `loss` is returned
unscaled. The step passes the scaled output gradient on to `piece_vjp`
and scales its `extra_loss` itself.

This module holds what the backends share (the results' types, the
held-out loss, joining and slicing outputs); each backend's primitives
are in its own module, which its trainer imports:

- `_tf_output_grads`, `_torch_output_grads`: `loss_and_output_grads(model,
  data, y_pred, scale_loss=None)` and `piece_vjp(model, x, output_grads,
  extra_loss=None)`, stateful: they read the variables and let a forward
  pass assign its state, as Keras's own step does.
- `_jax_output_grads`: `stateless_loss_and_output_grads(model, values,
  data, y_pred, scale_loss=None)` and `stateless_piece_vjp(model,
  trainable, non_trainable, x, output_grads, extra_loss=None)` (values in,
  values out, for the jitted step), and the two stateful ones above for
  eager use and tests.

`data` is `(x, y, sample_weight)`, the batch as
`keras.utils.unpack_x_y_sample_weight` gives it (`y` and
`sample_weight` may be None). `_seeds` makes both passes draw alike;
`_coupling` refuses what no replay can make exact.
"""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import keras

from keras_accum import _compat


class OutputGrads(NamedTuple):
    """What `loss_and_output_grads` returns.

    Attributes:
        loss: Scalar tensor. The loss as `compute_loss` computes it, less
            the model's own losses; unscaled.
        y_pred: The gradient of the (scaled) loss with respect to
            `y_pred`, in `y_pred`'s structure, each leaf in its dtype.
        weights: List aligned with `model.trainable_variables`: the
            gradient of the (scaled) loss with respect to each weight the
            loss reads itself, None for the others.
    """

    loss: Any
    y_pred: Any
    weights: list


class PieceGrads(NamedTuple):
    """What `piece_vjp` returns.

    Attributes:
        y_pred: The piece's outputs (training mode).
        extra: The value of `extra_loss` on the piece, or None.
        weights: List aligned with `model.trainable_variables`: the
            vector-Jacobian product of the outputs with `output_grads`,
            plus `extra`'s gradient.
    """

    y_pred: Any
    extra: Any
    weights: list


@contextlib.contextmanager
def model_losses_held_out(model):
    """`model.losses` reads one zero inside: `compute_loss` then computes
    the loss of the outputs alone (see the module's docstring)."""
    _compat.override_losses(model, [keras.ops.zeros(())])
    try:
        yield
    finally:
        _compat.override_losses(model, None)


def compute_loss_held_out(model, data, y_pred):
    """`Model.compute_loss` in training mode on `data = (x, y,
    sample_weight)` and `y_pred`, the model's losses held out."""
    x, y, sample_weight = data
    with model_losses_held_out(model):
        return _compat.compute_loss(
            model, x, y, y_pred, sample_weight, training=True
        )


def join(pieces: list) -> Any:
    """The batch's `y_pred` from its pieces', leaf by leaf along rows."""
    return keras.tree.map_structure(
        lambda *leaves: keras.ops.concatenate(leaves, axis=0), *pieces
    )


def rows(structure, start, stop) -> Any:
    """Rows `[start, stop)` of every leaf of `structure` (a piece's slice of
    the batch's output gradient)."""
    return keras.tree.map_structure(lambda t: t[start:stop], structure)
