"""`AccumBatchNormalization`: moving statistics once per window."""

from __future__ import annotations

import warnings
from typing import Any

import keras
from keras import ops

from keras_accum import _compat
from keras_accum._compat import Functional, functional_like_constructor


@keras.saving.register_keras_serializable(package="keras_accum")
class AccumBatchNormalization(keras.layers.BatchNormalization):
    """Batch normalization whose moving statistics follow the window.

    A `keras.layers.BatchNormalization` inside an `AccumModel` updates its
    moving mean and variance once per micro-batch, from the micro-batch's
    statistics: `accum_steps` small-batch updates where a large batch makes
    one. This layer, inside an `AccumModel`, instead pools the statistics of
    every micro-batch of the window (counts, means and variances merged
    exactly, as if computed over the window's samples at once) and updates
    the moving mean and variance once, when the window is applied, with the
    same momentum rule as `BatchNormalization`. Given the same inputs, the
    moving statistics then equal those of a plain model training on the
    large batches, to float32 rounding: exactly so for a layer on the
    model's inputs; deeper layers see activations that drift apart as the
    weights do (see below).

    What stays different: during training each micro-batch is still
    normalized with its own mean and variance, which is what makes its
    memory small. The outputs, and so the gradients, of layers after a
    batch-normalization layer therefore differ from a large batch's; use
    micro-batches of a reasonable size (e.g. 16 or more per replica), or a
    batch-independent normalization (`LayerNormalization`,
    `GroupNormalization`) where that matters.

    To use it in an existing (e.g. pretrained) `Sequential` or functional
    model, `AccumBatchNormalization.convert(model)` returns a copy of the
    model with every `BatchNormalization` replaced and every weight,
    moving statistics included, copied.

    A window whose gradient is not finite (skipped by `AccumModel`) does
    not update the moving statistics. In inference, and in any model that
    is not an `AccumModel`, the layer is exactly `BatchNormalization`.
    Its extra state (the open window's count, mean and sum of squared
    deviations) is saved with the model's weights, so a window open at a
    save resumes exactly. Under a distribution strategy each replica pools
    its own micro-batches, as `BatchNormalization` uses each replica's
    batch. `renorm=True` is not supported.

    Args:
        *args: Passed to `keras.layers.BatchNormalization`.
        **kwargs: Passed to `keras.layers.BatchNormalization`, e.g. `axis`,
            `momentum`, `epsilon`.

    Raises:
        ValueError: If `renorm=True`.

    Example:

    ```python
    inputs = keras.Input((32, 32, 3))
    x = keras.layers.Conv2D(16, 3)(inputs)
    x = keras_accum.AccumBatchNormalization()(x)
    x = keras.layers.ReLU()(x)
    outputs = keras.layers.Dense(10)(keras.layers.Flatten()(x))
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=8)
    ```
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Keras 3.10's `BatchNormalization` has no `renorm` (it refuses the
        # argument itself).
        if getattr(self, "renorm", False):
            raise ValueError(
                "`AccumBatchNormalization` does not support batch "
                "renormalization. Received: renorm=True"
            )
        # Set by the `AccumModel` that closes this layer's windows.
        self._window_owned = False

    @classmethod
    def convert(cls, model: keras.Model) -> keras.Model:
        """Returns a copy of `model` with `AccumBatchNormalization` layers.

        `model` is rebuilt from its graph, as `keras.models.clone_model`
        rebuilds it, with nested `Sequential` and functional models rebuilt
        the same way: every layer whose type is exactly
        `keras.layers.BatchNormalization` becomes an instance of this class
        made from the layer's config, and every other layer a new layer
        made from its own config. Then every weight is copied by value,
        the batch normalizations' `gamma`, `beta`, `moving_mean` and
        `moving_variance` included; the new layers' window weights start
        at zero. The copy shares no variable or array with `model`, which
        is left as it is, so either model can train on without affecting
        the other (on JAX, Keras frees a model's arrays when it trains).
        Layer and model names and `trainable` flags are kept, frozen
        batch normalizations (`trainable = False`) included, and the copy
        predicts what `model` predicts.

        The copy is of `model`'s class: a `Sequential` model gives a
        `Sequential` model and a functional model a functional model of
        the same class, compiled with `model`'s compile arguments if
        `model` was compiled (a new optimizer, as `clone_model` gives). A
        functional `AccumModel` gives an `AccumModel` with the same
        `accum_steps` and `partial_window` and an empty window. A nested
        functional model whose class builds its own graph (a KerasHub
        backbone, say) comes back as a plain functional model, as
        `clone_model` rebuilds it.

        Batch normalizations that the graph does not reach are left as
        they are, with a `UserWarning` naming them: subclasses of
        `BatchNormalization`, and those inside a custom layer or a nested
        subclassed model (copied from their configs, with their weights).
        In an `AccumModel` they update their moving statistics once per
        micro-batch.

        Args:
            model: A built `keras.Sequential` or functional `keras.Model`
                (an `AccumModel` built functionally included). The model
                to convert.

        Returns:
            A new model of `model`'s class, with `AccumBatchNormalization`
                (this class) in place of each `BatchNormalization` layer
                and all of `model`'s weights.

        Raises:
            TypeError: If `model` is not a `keras.Model`; if it cannot be
                rebuilt from its graph, being a subclassed model (or an
                `AccumModel` made by `AccumModel.from_model` around one)
                or a functional model whose class builds its graph in its
                constructor (construct it again with
                `AccumBatchNormalization` in place of `BatchNormalization`
                and copy the weights, or convert its functional parts, or
                for the latter `keras.Model(model.input, model.output)`);
                or if one of its layers cannot be made from its config.
            ValueError: If `model` is not built, or a batch normalization
                in it uses `renorm=True`, which this layer does not
                support.

        Example:

        ```python
        base = keras.Sequential(
            [
                keras.Input((32, 32, 3)),
                keras.layers.Conv2D(16, 3),
                keras.layers.BatchNormalization(),
                keras.layers.ReLU(),
                keras.layers.GlobalAveragePooling2D(),
                keras.layers.Dense(10),
            ]
        )
        converted = keras_accum.AccumBatchNormalization.convert(base)
        model = keras_accum.AccumModel.from_model(converted, accum_steps=8)
        ```
        """
        _check_convertible(model)
        clones = {}
        converted = _rebuild(cls, model, clones)
        _copy_trainable(model, converted, clones)
        for old, new in clones.values():
            # Operations (`x + y` in a graph, say) hold no weights.
            if isinstance(old, keras.layers.Layer) and not (
                _is_graph_model(old)
            ):
                _copy_weights(old, new)
        _warn_unconverted(converted)
        return converted

    def build(self, input_shape):
        super().build(input_shape)
        shape = tuple(self.moving_mean.shape)
        self.window_count = self._window_weight("window_count", ())
        self.window_mean = self._window_weight("window_mean", shape)
        self.window_m2 = self._window_weight("window_m2", shape)

    def _window_weight(self, name, shape):
        return self.add_weight(
            shape=shape,
            name=name,
            initializer="zeros",
            trainable=False,
            autocast=False,
            aggregation="only_first_replica",
        )

    def call(self, inputs, training=None, mask=None):
        if not (self._window_owned and training and self.trainable):
            return super().call(inputs, training=training, mask=mask)
        # `BatchNormalization`'s training branch, with the moving update
        # replaced by adding the micro-batch to the window.
        compute_dtype = keras.backend.result_type(inputs.dtype, "float32")
        inputs = ops.cast(inputs, compute_dtype)
        gamma = ops.cast(self.gamma, inputs.dtype) if self.scale else None
        beta = ops.cast(self.beta, inputs.dtype) if self.center else None
        mean, variance = _compat.batch_moments(self, inputs, mask)
        self._add_to_window(inputs, mask, mean, variance)
        outputs = ops.batch_normalization(
            x=inputs,
            mean=mean,
            variance=variance,
            axis=self.axis,
            offset=beta,
            scale=gamma,
            epsilon=self.epsilon,
        )
        return ops.cast(outputs, self.compute_dtype)

    def _add_to_window(self, inputs, mask, mean, variance):
        """Merges the micro-batch's moments into the window's (Chan et al.).

        With n samples per channel, mean m and variance v merged into a
        window of N, mean M and sum of squared deviations S:
        M' = M + (m - M) n / (N + n), S' = S + n v + (m - M)² N n / (N + n),
        exact in real arithmetic and without the cancellation of summing
        squares.
        """
        mean = ops.stop_gradient(ops.cast(mean, "float32"))
        variance = ops.stop_gradient(ops.cast(variance, "float32"))
        if mask is None:
            shape = ops.shape(inputs)
            count = 1.0
            for axis in _compat.reduction_axes(self):
                count = count * ops.cast(shape[axis], "float32")
        else:
            count = ops.sum(ops.cast(mask, "float32"))
        count = ops.stop_gradient(ops.cast(count, "float32"))
        before = self.window_count.value
        total = before + count
        share = ops.where(total > 0, count / ops.maximum(total, 1e-30), 0.0)
        delta = mean - self.window_mean.value
        self.window_mean.assign(self.window_mean.value + delta * share)
        self.window_m2.assign(
            self.window_m2.value
            + variance * count
            + ops.square(delta) * before * share
        )
        self.window_count.assign(total)

    def _follow_window(self):
        """Makes this layer follow its `AccumModel`'s windows; returns the
        close hook. The model calls it on each layer that has it, when it
        creates its window state, instead of knowing this class."""
        self._window_owned = True
        return self._close_window

    def _close_window(self, applied, closing):
        """Updates the moving statistics from the window; then clears it.

        The window's close hook (`_window.WindowState.close_hooks`): the
        backends call it after the update decision of any step that may
        close a window, with boolean scalars `applied` and `closing`
        (`applied` implies it); JAX's step calls it every micro-batch.
        Selected with `where`, not assigned inside a conditional: JAX's
        stateless step cannot assign inside `jax.lax.cond`.
        """
        count = self.window_count.value
        update = ops.logical_and(applied, count > 0)
        mean = self.window_mean.value
        variance = self.window_m2.value / ops.maximum(count, 1e-30)
        # The momentum rule of `BatchNormalization`, in its dtypes.
        for moving, window in (
            (self.moving_mean, mean),
            (self.moving_variance, variance),
        ):
            value = ops.cast(moving, "float32")
            new = value * self.momentum + window * (1.0 - self.momentum)
            moving.assign(ops.where(update, new, value))
        for variable in (self.window_count, self.window_mean, self.window_m2):
            value = variable.value
            variable.assign(ops.where(closing, ops.zeros_like(value), value))


# -- `AccumBatchNormalization.convert` ---------------------------------------


def _is_graph_model(layer) -> bool:
    return isinstance(layer, (keras.Sequential, Functional))


def _check_convertible(model) -> None:
    if not isinstance(model, keras.Model):
        raise TypeError(
            "`model` must be a built `keras.Model`: a `Sequential` or "
            f"functional model. Received: model={model!r} (of type "
            f"{type(model).__name__})"
        )
    name = type(model).__name__
    if not _is_graph_model(model):
        # Told by the attribute `AccumModel` declares, not by importing
        # `model.py`, which imports this module.
        if getattr(type(model), "_accumulates_gradients", False):
            raise TypeError(
                "`AccumBatchNormalization.convert` rebuilds a `Sequential` "
                "or functional model from its graph; `model` is an "
                f"`AccumModel` ({model.name!r}) made by "
                "`AccumModel.from_model` around a model that is neither. "
                "Convert the model before `AccumModel.from_model`: "
                "`AccumModel.from_model(AccumBatchNormalization.convert("
                "base), accum_steps=...)`, with `base` a `Sequential` or "
                f"functional model. Received: model={model!r}"
            )
        raise TypeError(
            "`AccumBatchNormalization.convert` rebuilds a `Sequential` or "
            f"functional model from its graph; `model` is a subclassed "
            f"model (`{name}`, {model.name!r}), whose layers are made by "
            "its own code. Construct it again with "
            "`keras_accum.AccumBatchNormalization` in place of "
            "`keras.layers.BatchNormalization` and copy the weights "
            "(`set_weights` on each layer; the new layer has three more "
            "weights, its window, which start at zero), or convert its "
            f"functional parts. Received: model={model!r}"
        )
    if not isinstance(model, keras.Sequential) and (
        not functional_like_constructor(type(model))
    ):
        raise TypeError(
            f"`model` is a `{name}` ({model.name!r}), a functional model "
            "whose class builds its graph in its own constructor (a "
            "KerasHub model, say), so it cannot be rebuilt as a "
            f"`{name}` from its graph. Convert a plain functional model "
            "of the same graph, `keras.Model(model.input, "
            "model.output)` (which has the computation and the weights, "
            f"but not the methods of `{name}`), or construct the model "
            "again with `keras_accum.AccumBatchNormalization` in place of "
            "`keras.layers.BatchNormalization` and copy the weights. "
            f"Received: model={model!r}"
        )
    if not model.built:
        raise ValueError(
            "`model` must be a built `keras.Model`: give it an input "
            "shape (a `keras.Input` first) or call it on a batch of data "
            f"before converting it. Received: model={model!r}, which is "
            "not built."
        )


def _rebuild(cls, model, clones):
    """`model` rebuilt by `clone_model`, with new layers; `clones` maps
    the id of each layer of `model` (nested ones included) to the pair
    (layer, its copy). A layer used twice gets one copy."""

    def clone_layer(layer):
        key = id(layer)
        if key not in clones:
            if _is_graph_model(layer):
                new = _rebuild(cls, layer, clones)
            elif type(layer) is keras.layers.BatchNormalization:
                if getattr(layer, "renorm", False):
                    raise ValueError(
                        f"The layer {layer.name!r} of `model` uses batch "
                        "renormalization, which `AccumBatchNormalization` "
                        "does not support; it cannot be converted. "
                        "Received: renorm=True"
                    )
                new = cls.from_config(layer.get_config())
            else:
                new = _from_own_config(layer)
            clones[key] = (layer, new)
        return clones[key][1]

    if isinstance(model, keras.Sequential):
        return keras.models.clone_model(model, clone_function=clone_layer)
    return keras.models.clone_model(
        model,
        input_tensors=keras.tree.map_structure(_new_input, model.input),
        clone_function=clone_layer,
    )


def _new_input(tensor):
    """A new input like the functional model's input `tensor`, named as its
    `InputLayer` (`clone_model` names it after the tensor: an input made
    without a name would become "keras_tensor_12")."""
    layer = _compat.input_layer(tensor)
    kwargs = {"name": tensor.name}
    if isinstance(layer, keras.layers.InputLayer):
        kwargs["name"] = layer.name
        if getattr(layer, "optional", False):
            kwargs["optional"] = True
    return keras.Input(
        batch_shape=tensor.shape,
        dtype=tensor.dtype,
        sparse=tensor.sparse,
        **kwargs,
    )


def _from_own_config(layer):
    try:
        return type(layer).from_config(layer.get_config())
    except Exception as error:
        # Re-raised with the layer's name: Keras's message names its class
        # at most.
        raise TypeError(
            "`AccumBatchNormalization.convert` makes every layer of "
            f"`model` again from its config; the layer {layer.name!r} (a "
            f"`{type(layer).__name__}`) cannot be made from its config: "
            f"{type(error).__name__}: {error} Give its class a "
            "`get_config()` that returns its constructor's arguments, or "
            "convert the model's functional parts."
        ) from error


def _copy_trainable(old, new, clones):
    """Sets the `trainable` flags of `new` and its layers as in `old`.

    Parents first: setting a layer's flag sets its sublayers' flags too.
    """
    if not isinstance(old, keras.layers.Layer):
        return  # An operation (`x + y` in a graph, say).
    new.trainable = old.trainable
    if _is_graph_model(old):
        for layer in old.layers:
            if id(layer) in clones:  # Not an `InputLayer`.
                _copy_trainable(layer, clones[id(layer)][1], clones)
        return
    # A layer made from its config has the same sublayers, listed in the
    # same order, parents before their sublayers.
    olds = _compat.sublayers(old, include_self=False)
    news = _compat.sublayers(new, include_self=False)
    if [type(x) for x in olds] == [type(x) for x in news]:
        for source, target in zip(olds, news, strict=True):
            target.trainable = source.trainable


def _window_weights(layer):
    """The ids of the window weights of the `AccumBatchNormalization`
    layers in `layer`: not copied, a new window starts empty."""
    return {
        id(variable)
        for sublayer in _compat.sublayers(layer)
        if isinstance(sublayer, AccumBatchNormalization) and sublayer.built
        for variable in (
            sublayer.window_count,
            sublayer.window_mean,
            sublayer.window_m2,
        )
    }


def _copy_weights(old, new):
    skip_old, skip_new = _window_weights(old), _window_weights(new)
    sources = [v for v in old.weights if id(v) not in skip_old]
    targets = [v for v in new.weights if id(v) not in skip_new]
    shapes = [tuple(v.shape) for v in sources]
    if shapes != [tuple(v.shape) for v in targets]:
        raise ValueError(
            f"The weights of the layer {old.name!r} of `model` (a "
            f"`{type(old).__name__}`) cannot be copied: the layer made "
            "again from its config has weights of other shapes, so its "
            "`get_config()` does not describe it. Received: weights of "
            f"shapes {shapes}, and "
            f"{[tuple(v.shape) for v in targets]} in the new layer."
        )
    for source, target in zip(sources, targets, strict=True):
        # A new array: on JAX `assign` keeps the array it is given, which
        # `model`'s training would free.
        target.assign(ops.copy(source.value))
        target.trainable = source.trainable


def _warn_unconverted(model):
    left = [
        f"{layer.name!r} ({type(layer).__name__})"
        for layer in _compat.sublayers(model, include_self=False)
        if isinstance(layer, keras.layers.BatchNormalization)
        and not isinstance(layer, AccumBatchNormalization)
    ]
    if left:
        warnings.warn(
            "`AccumBatchNormalization.convert` left "
            f"{len(left)} batch-normalization layer(s) as they are: "
            f"{', '.join(left)}. It replaces layers of type "
            "`keras.layers.BatchNormalization` in the model's graph "
            "(nested `Sequential` and functional models included), not a "
            "subclass of it, nor a layer inside a custom layer or a "
            "subclassed model. In an `AccumModel` these update their "
            "moving statistics once per micro-batch; replace them with "
            "`AccumBatchNormalization` in their code to pool the window.",
            UserWarning,
            stacklevel=3,
        )
