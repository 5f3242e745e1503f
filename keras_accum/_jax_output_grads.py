"""JAX's output-gradient primitives (`_output_grads`): `jax.grad` of the
stateless loss with respect to the outputs and the trainable values, and
`jax.vjp` of the stateless forward pass.

The stateless forms take and return the values lists of the jitted step;
the stateful ones read the variables and write back what the forward
pass or the loss changed (random generators' states, metrics), for eager
use.
"""

from __future__ import annotations

import jax
import jax.extend.core
import keras

from keras_accum import _output_grads


def read_weights(loss_of_weights, trainable) -> list[bool]:
    """Which of `trainable` (a list of values) the traced
    `loss_of_weights(trainable)` reads: its jaxpr's inputs that an
    equation or the result uses."""
    closed = jax.make_jaxpr(loss_of_weights)(trainable)
    used = set()
    for eqn in closed.jaxpr.eqns:
        used.update(
            id(v) for v in eqn.invars if isinstance(v, jax.extend.core.Var)
        )
    used.update(
        id(v)
        for v in closed.jaxpr.outvars
        if isinstance(v, jax.extend.core.Var)
    )
    return [id(v) in used for v in closed.jaxpr.invars]


def stateless_loss_and_output_grads(
    model, values, data, y_pred, scale_loss=None
) -> tuple[_output_grads.OutputGrads, tuple[list, list]]:
    """`loss_and_output_grads` on values.

    Args:
        model: `keras.Model`. Compiled, or with its own `compute_loss`.
        values: Tuple. `(trainable, non_trainable, metrics)`: the values of
            `model.trainable_variables`, `non_trainable_variables` and
            `metrics_variables`.
        data: Tuple. `(x, y, sample_weight)` of the whole batch.
        y_pred: The batch's outputs, any structure.
        scale_loss: Callable or None. Applied to the loss before it is
            differentiated. Defaults to None.

    Returns:
        `(OutputGrads, (non_trainable, metrics))`, the two lists as the
        loss left them (a `compute_loss` may update metrics).
    """
    trainable, non_trainable, metrics = values
    x, y, sample_weight = data

    def objective(y_pred, trainable):
        with _output_grads.model_losses_held_out(model):
            loss, (_, new_non_trainable, new_metrics) = (
                model.stateless_compute_loss(
                    trainable,
                    non_trainable,
                    metrics,
                    x=x,
                    y=y,
                    y_pred=y_pred,
                    sample_weight=sample_weight,
                    training=True,
                )
            )
        scaled = loss if scale_loss is None else scale_loss(loss)
        return scaled, (loss, new_non_trainable, new_metrics)

    grad = jax.grad(objective, argnums=(0, 1), has_aux=True)
    (y_grads, weight_grads), (loss, new_non_trainable, new_metrics) = grad(
        y_pred, trainable
    )
    reads = read_weights(lambda w: objective(y_pred, w)[0], trainable)
    weights = [
        g if r else None for g, r in zip(weight_grads, reads, strict=True)
    ]
    found = _output_grads.OutputGrads(loss, y_grads, weights)
    return found, (new_non_trainable, new_metrics)


def stateless_piece_vjp(
    model, trainable, non_trainable, x, output_grads, extra_loss=None
):
    """`piece_vjp` on values (`trainable`, `non_trainable`: the values of
    the model's variables). Returns `(PieceGrads, non_trainable)`, the
    latter as the forward pass left it (random generators moved)."""

    def forward(trainable):
        y_pred, new_non_trainable, losses = model.stateless_call(
            trainable, non_trainable, x, training=True, return_losses=True
        )
        extra = (
            keras.ops.zeros(())
            if extra_loss is None
            else extra_loss(y_pred, losses)
        )
        return (y_pred, extra), new_non_trainable

    (y_pred, extra), vjp, new_non_trainable = jax.vjp(
        forward, trainable, has_aux=True
    )
    cotangent = jax.tree.map(
        lambda t, g: g.astype(t.dtype), y_pred, output_grads
    )
    (grads,) = vjp((cotangent, keras.ops.ones_like(extra)))
    extra = None if extra_loss is None else extra
    found = _output_grads.PieceGrads(y_pred, extra, list(grads))
    return found, new_non_trainable


def _values(variables) -> list:
    return [v.value for v in variables]


def _assign(variables, values) -> None:
    for variable, value in zip(variables, values, strict=True):
        variable.assign(value)


def loss_and_output_grads(model, data, y_pred, scale_loss=None):
    """The stateful form (eager): reads the variables, writes back what the
    loss changed."""
    values = (
        _values(model.trainable_variables),
        _values(model.non_trainable_variables),
        _values(model.metrics_variables),
    )
    found, (non_trainable, metrics) = stateless_loss_and_output_grads(
        model, values, data, y_pred, scale_loss
    )
    _assign(model.non_trainable_variables, non_trainable)
    _assign(model.metrics_variables, metrics)
    return found


def piece_vjp(model, x, output_grads, extra_loss=None):
    """The stateful form (eager): reads the variables, writes back the
    forward pass's state."""
    found, non_trainable = stateless_piece_vjp(
        model,
        _values(model.trainable_variables),
        _values(model.non_trainable_variables),
        x,
        output_grads,
        extra_loss,
    )
    _assign(model.non_trainable_variables, non_trainable)
    return found
