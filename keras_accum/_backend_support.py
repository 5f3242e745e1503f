"""What `AccumModel` refuses on a backend, and the errors.

The three backends share the window rules (`_window.py`); what those
rules, or Keras under them, do not cover is refused with one error naming
the feature and the backend: today Flax NNX mode on JAX, whose trainer
calls the step another way. A `keras.distribution` on TensorFlow or
PyTorch, which Keras 3.15 accepts there but does not implement, is
warned about: plain Keras trains on one device, and so does `AccumModel`.
"""

from __future__ import annotations

import warnings

import keras

from keras_accum._compat import is_nnx_enabled


def unsupported(feature: str, received: str) -> NotImplementedError:
    """The error for a feature the current backend does not support yet."""
    return NotImplementedError(
        f"{feature} is not supported on the {keras.backend.backend()} "
        "backend yet. Use the TensorFlow backend for it (`export "
        "KERAS_BACKEND=tensorflow` before Python imports Keras). "
        f"Received: {received}"
    )


def check_model(model) -> None:
    """Refuses layers, optimizers and modes these steps do not handle."""
    backend = keras.backend.backend()
    if backend == "jax" and is_nnx_enabled():
        raise unsupported("Flax NNX mode", "nnx enabled in Keras config")
    distribution = keras.distribution.distribution()
    if backend != "jax" and distribution is not None:
        # Keras 3.15 accepts the distribution on these backends and then
        # ignores it: every weight stays whole on one device. A plain model
        # trains that way without a word; the same training here (equal
        # to it, so still a drop-in), but said aloud, since whoever set a
        # distribution expected less memory per device.
        warnings.warn(
            "`keras.distribution` (DataParallel, ModelParallel) is "
            "implemented only by Keras's JAX backend: on the "
            f"{backend} backend Keras leaves every weight whole on one "
            "device, and AccumModel's accumulators are whole too. "
            "For sharded weights and accumulators, use the JAX backend "
            "(`export KERAS_BACKEND=jax`); for data parallelism on "
            "TensorFlow, a `tf.distribute` strategy. Received: "
            f"distribution={distribution!r}",
            stacklevel=2,
        )
