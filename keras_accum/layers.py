"""`AccumBatchNormalization`: moving statistics once per window."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


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
        mean, variance = self._moments(inputs, mask)
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
            for axis in self._reduction_axes:
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
