"""Gradient accumulation for Keras 3 that equals large-batch training."""

from keras_accum.callbacks import PseudoBatch, PseudoBatchLogger
from keras_accum.layers import AccumBatchNormalization
from keras_accum.model import AccumModel

__version__ = "0.1.0"

__all__ = [
    "AccumBatchNormalization",
    "AccumModel",
    "PseudoBatch",
    "PseudoBatchLogger",
]
