"""What `AccumModel` does not support yet on JAX and PyTorch, and the errors.

The TensorFlow step supports everything; the JAX and PyTorch steps share
the window rules (`_window_rules.py`) and refuse, with one error naming the
feature and the backend, what those rules do not cover yet.
"""

from __future__ import annotations

import keras
from keras.src.backend.config import is_nnx_enabled

from keras_accum.layers import AccumBatchNormalization


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
    batch_norms = [
        layer.name
        for layer in model._flatten_layers()
        if isinstance(layer, AccumBatchNormalization)
    ]
    if batch_norms:
        raise unsupported(
            "`AccumBatchNormalization`",
            f"layers {batch_norms} in model {model.name!r}. "
            f"`keras.layers.BatchNormalization` works on {backend} (moving "
            "statistics updated per micro-batch)",
        )
    if keras.distribution.distribution() is not None:
        raise unsupported(
            "`keras.distribution`",
            f"distribution={keras.distribution.distribution()!r}",
        )
    if backend == "jax" and is_nnx_enabled():
        raise unsupported("Flax NNX mode", "nnx enabled in Keras config")
