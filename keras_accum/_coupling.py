"""Layers that couple the samples of a batch in their training forward pass
(or cannot run it twice alike), which the whole-batch step refuses.

The whole-batch step computes the loss on the outputs of every piece of a
batch, each piece run forward on its own (`_seeds` says how the random
draws of both passes agree). That equals one forward pass of the batch
only where each sample's output depends on that sample alone. A layer
whose training forward pass mixes samples sees a piece where a plain
model's sees the batch, and no replay can fix it:

- `BatchNormalization` (and `AccumBatchNormalization`, a subclass), when
  it trains: it normalizes with the piece's mean and variance. In Keras 3
  a layer with `trainable=False` runs in inference mode even in `fit`
  (it normalizes with its moving statistics, per sample) and is accepted.
- `MixUp` and `CutMix`, which blend each image with another of its batch.

And one layer whose training forward pass cannot be run twice alike:
`SpectralNormalization` assigns its layer's kernel (normalized by a
power iteration it also advances) on every training call, so the second
pass would run on the kernel the first pass left, and a batch of k pieces
would normalize it 2k times where a plain model does once.

Per-sample layers are accepted, whatever they compute: `LayerNormalization`,
`GroupNormalization`, `UnitNormalization`, `RMSNormalization`, attention
(over the positions of one sample), and the random augmentation layers
(per-sample draws, replayed by `_seeds`).

Checked statically, on the layers the model holds: a trainable
`BatchNormalization` that a model always calls with `training=False`
(`base(x, training=False)` in the fine-tuning recipe) normalizes per
sample and is refused all the same; freezing it (`trainable = False`)
states what it does and is then accepted, but also stops its scale and
offset from training.
"""

from __future__ import annotations

import keras

from keras_accum import _compat


def _mixes_samples(layer) -> str | None:
    """Why `layer` mixes the samples of a batch when training, or None."""
    if isinstance(layer, keras.layers.BatchNormalization):
        if not layer.trainable:
            return None
        return "normalizes each piece with the piece's own mean and variance"
    if isinstance(layer, (keras.layers.MixUp, keras.layers.CutMix)):
        return "blends each sample with another sample of its batch"
    if isinstance(layer, keras.layers.SpectralNormalization):
        return (
            "rewrites its layer's kernel on every training forward pass, so "
            "that the second pass would not repeat the first"
        )
    return None


def coupling_layers(model) -> list[tuple[keras.layers.Layer, str]]:
    """The layers of `model` (nested ones included) whose training forward
    pass mixes samples or cannot be repeated, each with why, in the order
    of `model`'s layers.

    Args:
        model: `keras.Model`. A built model.

    Returns:
        A list of `(layer, reason)`; [] when the whole-batch step can run
        the model piece by piece exactly.
    """
    found = []
    for layer in _compat.sublayers(model, include_self=False):
        reason = _mixes_samples(layer)
        if reason is not None:
            found.append((layer, reason))
    return found


def coupling_error(model) -> ValueError | None:
    """The error refusing `model` for `whole_batch_loss=True`, naming every
    coupling layer and what to use instead; None when there is none."""
    found = coupling_layers(model)
    if not found:
        return None
    named = "; ".join(
        f"`{layer.name}` ({type(layer).__name__}): {reason}"
        for layer, reason in found
    )
    advice = []
    kinds = {type(layer) for layer, _ in found}
    if any(issubclass(kind, keras.layers.BatchNormalization) for kind in kinds):
        advice.append(
            "replace each batch normalization with a per-sample "
            "normalization (`keras.layers.LayerNormalization`, or "
            "`keras.layers.GroupNormalization` for images), or freeze it "
            "(`layer.trainable = False`: it then normalizes with its "
            "moving statistics, as in inference)"
        )
    if keras.layers.SpectralNormalization in kinds:
        advice.append(
            "train a model with `SpectralNormalization` without "
            "`whole_batch_loss`"
        )
    if kinds & {keras.layers.MixUp, keras.layers.CutMix}:
        advice.append(
            "apply `MixUp`/`CutMix` to the batches in the input pipeline "
            "(e.g. `dataset.map(layer)`) instead of inside the model"
        )
    advice = " and ".join(advice)
    return ValueError(
        "`whole_batch_loss=True` runs the model forward piece by piece and "
        "needs each sample's outputs to depend on that sample alone and "
        "each forward pass to be repeatable; these layers are not, when "
        f"training: {named}. "
        f"To train with a loss that sees the whole batch, {advice}. "
        f"Received: whole_batch_loss=True with {len(found)} such layer(s)"
    )


def check_no_coupling(model) -> None:
    """Raises `coupling_error(model)` where there is one."""
    error = coupling_error(model)
    if error is not None:
        raise error
