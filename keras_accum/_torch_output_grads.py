"""PyTorch's output-gradient primitives (`_output_grads`): the outputs as
leaves requiring gradients, and `torch.autograd.grad(grad_outputs=)`,
which returns the gradients without writing any `.grad`."""

from __future__ import annotations

import keras
import torch

from keras_accum import _compat, _output_grads


def _parameters(model) -> list:
    # The backing parameters: `Variable.value` may return an autocast copy.
    return [_compat.backing_value(v) for v in model.trainable_variables]


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
    flat = [
        t.detach().requires_grad_(t.is_floating_point())
        for t in keras.tree.flatten(y_pred)
    ]
    leaves = keras.tree.pack_sequence_as(y_pred, flat)
    params = _parameters(model)
    with torch.enable_grad():
        loss = _output_grads.compute_loss_held_out(model, data, leaves)
        scaled = loss if scale_loss is None else scale_loss(loss)
    sources = [t for t in flat if t.requires_grad] + [
        p for p in params if p.requires_grad
    ]
    found = dict(
        zip(
            map(id, sources),
            torch.autograd.grad(scaled, sources, allow_unused=True),
            strict=True,
        )
    )
    y_grads = [
        torch.zeros_like(t) if found.get(id(t)) is None else found[id(t)]
        for t in flat
    ]
    return _output_grads.OutputGrads(
        loss.detach(),
        keras.tree.pack_sequence_as(y_pred, y_grads),
        [found.get(id(p)) for p in params],
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
    params = _parameters(model)
    with torch.enable_grad():
        y_pred = model(x, training=True)
        extra = None if extra_loss is None else extra_loss(y_pred, model.losses)
    targets, cotangents = [], []
    for t, g in zip(
        keras.tree.flatten(y_pred),
        keras.tree.flatten(output_grads),
        strict=True,
    ):
        # An output no weight reaches (an input passed through) has no
        # graph to go back through.
        if t.requires_grad:
            targets.append(t)
            cotangents.append(
                torch.as_tensor(g, dtype=t.dtype, device=t.device)
            )
    if extra is not None and extra.requires_grad:
        targets.append(extra)
        cotangents.append(torch.ones_like(extra))
    sources = [p for p in params if p.requires_grad]
    grads = {}
    if targets and sources:
        grads = dict(
            zip(
                map(id, sources),
                torch.autograd.grad(
                    targets, sources, cotangents, allow_unused=True
                ),
                strict=True,
            )
        )
    y_pred = keras.tree.map_structure(lambda t: t.detach(), y_pred)
    extra = None if extra is None else extra.detach()
    return _output_grads.PieceGrads(
        y_pred, extra, [grads.get(id(p)) for p in params]
    )
