"""How a micro-batch's loss was reduced: one rule for the step and the loader.

A window is the mean over its samples (or loss entries, or sample weights),
not a mean of micro-batch means: each micro-batch's gradient is weighted by
what its loss averaged over, its *normalizer*, and the window is divided by
their total. Which normalizer a loss has (`LossRule`) follows from its
reduction and the model's outputs; the step computes it for each
micro-batch (`normalizer`), and loading a saved window checks the saved
total against the same rule (`_window_saving.WindowRules`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import keras
from keras import ops

from keras_accum import _compat

SUM_REDUCTIONS = ("sum", "none", None)


class LossRule(NamedTuple):
    """What a loss's normalizer counts.

    Attributes:
        kind: `"zero"` (the losses sum: a micro-batch adds no normalizer),
            `"samples"` (one per sample: several outputs, mixed reductions,
            a custom `compute_loss`), `"weights"` (the sample-weight total,
            any sign: `"mean_with_sample_weight"`), `"entries"` (the loss
            entries per sample, `entries` of them, and no layer masks) or
            `"counted"` (the entries the loss averaged over: fewer where
            masked, or a number not known before the step).
        entries: Loss entries per sample, where static.
        maskable: Whether a layer can mask loss entries out.
    """

    kind: str
    entries: int | None = None
    maskable: bool = True


def reductions(model) -> list:
    """The reductions of `model`'s compiled losses, one per loss.

    From the built compiled loss where it is built, else from the `loss`
    given to `compile` (Keras resolves names and functions to losses with
    the default reduction).
    """
    flat = _compat.flat_losses(model)
    if flat is not None:
        losses = [entry.loss for entry in flat]
    else:
        given = getattr(model, "loss", None)
        losses = [] if given is None else keras.tree.flatten(given)
        losses = [loss for loss in losses if loss is not None]
    found = []
    for loss in losses:
        reduction = getattr(loss, "reduction", "sum_over_batch_size")
        found.append("sum_over_batch_size" if reduction is None else reduction)
    return found


def rule(found, outputs, entries=None, maskable=True) -> LossRule:
    """The `LossRule` of losses with the reductions `found`.

    Args:
        found: The losses' reductions (`reductions`).
        outputs: The model's number of outputs; None if not known.
        entries: Loss entries per sample, where static.
        maskable: Whether a layer can mask loss entries out.
    """
    if not found or len(set(found)) > 1:
        return LossRule("samples")
    if found[0] in SUM_REDUCTIONS:
        return LossRule("zero")
    if outputs is not None and (len(found) != 1 or outputs != 1):
        # Several outputs share the batch: samples are the common unit.
        return LossRule("samples")
    if found[0] == "mean_with_sample_weight":
        return LossRule("weights", entries, maskable)
    kind = "entries" if entries is not None and not maskable else "counted"
    return LossRule(kind, entries, maskable)


def normalizer(kind, y_pred, sample_weight, batch_size):
    """This micro-batch's normalizer, for a loss of the rule `kind`.

    Only proportionality across micro-batches matters: the window is
    divided by the total of these. None for `"zero"`. Dimensions are ints
    where known and scalar tensors where dynamic (TensorFlow).
    """
    if kind == "zero":
        return None
    if kind == "samples":
        return batch_size
    pred = keras.tree.flatten(y_pred)[0]
    mask = _compat.get_keras_mask(pred)
    # Loss functions reduce the last axis; the entries left are what
    # "sum_over_batch_size" divides by.
    rank = ops.ndim(pred)
    if rank is not None and rank > 1:
        entries = math.prod(ops.shape(pred)[:-1])
    else:
        entries = batch_size
    if kind == "weights":
        weight = _compat.apply_mask(
            _single(sample_weight), mask, "float32", "mean_with_sample_weight"
        )
        if weight is not None:
            return ops.sum(ops.cast(weight, "float32"))
        return entries
    if mask is not None:
        return ops.sum(ops.cast(mask, "float32"))
    return entries


def static_entries(model):
    """`(entries, maskable)` as `model`'s config tells, for the loader:
    loss entries per sample of its single output where its shape is
    static, and whether any layer can mask."""
    maskable = any(
        type(layer).compute_mask is not keras.layers.Layer.compute_mask
        for layer in _compat.sublayers(model)
        if not isinstance(layer, keras.Model)
    )
    outputs = getattr(model, "outputs", None)
    if not outputs:
        return None, maskable
    shape = tuple(outputs[0].shape)
    dims = shape[1:-1] if len(shape) > 1 else ()
    if all(isinstance(d, int) for d in dims):
        return math.prod(dims), maskable
    return None, maskable


def _single(sample_weight):
    if sample_weight is None:
        return None
    flat = keras.tree.flatten(sample_weight)
    return flat[0] if len(flat) == 1 else None
