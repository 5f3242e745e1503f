"""Gradient accumulation for Keras 3 that equals large-batch training."""

# First: it warns when this Keras is outside the tested range.
from keras_accum import _compat  # noqa: F401
from keras_accum.auto import AutoAccumSteps, AutoMicroBatch
from keras_accum.callbacks import PseudoBatch, PseudoBatchLogger
from keras_accum.layers import AccumBatchNormalization
from keras_accum.model import AccumModel

__version__ = "0.1.0"

__all__ = [
    "AccumBatchNormalization",
    "AccumModel",
    "AutoAccumSteps",
    "AutoMicroBatch",
    "PseudoBatch",
    "PseudoBatchLogger",
]
