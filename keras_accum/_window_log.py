"""What a window publishes for `PseudoBatchLogger`, on every backend.

Each backend's window state keeps rings of the last closed windows (their
loss, samples, update, micro-batches and noise-scale estimates) and a count
of those published; the callback reads them between steps. Kept apart from
the backends' modules so that the callback imports no backend.
"""

import keras
import numpy as np

# Updates remembered for `PseudoBatchLogger` between two reads.
LOG_CAPACITY = 256


def read_array(variable) -> np.ndarray:
    """A window variable's value, on any backend, as a NumPy array.

    Not `keras.ops.convert_to_numpy`: its `np.array(...)` asks the
    TensorFlow and PyTorch tensors' `__array__` for a copy, which under
    NumPy 2 raises a `DeprecationWarning` at every read (plain Keras reads
    none of these variables, so it would be ours alone). Each backend's own
    conversion copies without it.
    """
    value = variable.value
    backend = keras.backend.backend()
    if backend == "tensorflow":
        # Also reads (and sums) a per-replica variable under a strategy.
        return np.asarray(value.numpy())
    if backend == "torch":
        return value.detach().cpu().numpy()
    return np.asarray(value)


def read_int(variable) -> int:
    """A window counter's value, on any backend, as a Python int."""
    return int(read_array(variable))


# `PseudoBatchLogger`'s epoch-log keys that training minimises; a monitor
# of one (`EarlyStopping`, `ModelCheckpoint`, `ReduceLROnPlateau`) in
# `mode="auto"` gets `mode="min"`.
MINIMIZED_LOG_KEYS = frozenset({"pseudo_batch_loss_mean"})
