"""What `AccumModel` does not support yet on JAX and PyTorch, and the errors.

The JAX and PyTorch steps share the window rules (`_window.py`) and
refuse, with one error naming the feature and the backend, what those
rules do not cover yet: today only Flax NNX mode on JAX, whose trainer
calls the step another way. (PyTorch has no `keras.distribution` in Keras
3.15: Keras itself refuses it.)
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
    if keras.backend.backend() == "jax" and is_nnx_enabled():
        raise unsupported("Flax NNX mode", "nnx enabled in Keras config")
