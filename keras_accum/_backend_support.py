"""What `AccumModel` refuses on a backend, and the errors.

The three backends share the window rules (`_window.py`); what those
rules, or Keras under them, do not cover is refused with one error naming
the feature and the backend: today Flax NNX mode on JAX, whose trainer
calls the step another way, and a `keras.distribution` on TensorFlow or
PyTorch, which Keras 3.15 accepts there but does not implement.
"""

from __future__ import annotations

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
        # ignores it: every weight stays whole on one device. Training
        # would run, unsharded, with none of what the user asked for.
        raise ValueError(
            "`keras.distribution` (DataParallel, ModelParallel) is "
            "implemented only by Keras's JAX backend: on the "
            f"{backend} backend Keras leaves every weight whole on one "
            "device, and AccumModel's accumulators would be whole too. "
            "For sharded weights and accumulators, use the JAX backend "
            "(`export KERAS_BACKEND=jax`); for data parallelism on "
            "TensorFlow, a `tf.distribute` strategy. Or call "
            "`keras.distribution.set_distribution(None)`. Received: "
            f"distribution={distribution!r}"
        )
