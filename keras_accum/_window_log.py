"""What a window publishes for `PseudoBatchLogger`, on every backend.

Each backend's window state keeps rings of the last closed windows (their
loss, samples, update, micro-batches and noise-scale estimates) and a count
of those published; the callback reads them between steps. Kept apart from
the backends' modules so that the callback imports no backend.
"""

import keras

# Updates remembered for `PseudoBatchLogger` between two reads.
LOG_CAPACITY = 256


def read_int(variable) -> int:
    """A window counter's value, on any backend, as a Python int."""
    return int(keras.ops.convert_to_numpy(variable.value))
