"""What a window publishes for `PseudoBatchLogger`, on every backend.

Each backend's window state keeps rings of the last closed windows (their
loss, samples, update, micro-batches and noise-scale estimates) and a count
of those published; the callback reads them between steps. Kept apart from
the backends' modules so that the callback imports no backend.
"""

from __future__ import annotations

import keras
import ml_dtypes
import numpy as np

# Updates remembered for `PseudoBatchLogger` between two reads.
LOG_CAPACITY = 256


def read_array(variable) -> np.ndarray:
    """A window variable's value, on any backend, as a NumPy array.

    Not `keras.ops.convert_to_numpy`: its `np.array(...)` asks the
    TensorFlow and PyTorch tensors' `__array__` for a copy, which under
    NumPy 2 raises a `DeprecationWarning` at every read (plain Keras reads
    none of these variables, so it would be ours alone). Each backend's own
    conversion copies without it. A bfloat16 variable (an accumulator
    under `accumulator_dtype="bfloat16"`, a weight under a bfloat16
    policy) reads as `ml_dtypes.bfloat16` on every backend.
    """
    value = variable.value
    backend = keras.backend.backend()
    if backend == "tensorflow":
        # Also reads (and sums) a per-replica variable under a strategy.
        return np.asarray(value.numpy())
    if backend == "torch":
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            # PyTorch's `numpy()` has no bfloat16 ("Got unsupported
            # ScalarType BFloat16"): the same bits, read as NumPy's.
            return value.view(_torch_int16()).numpy().view(ml_dtypes.bfloat16)
        return value.numpy()
    return np.asarray(value)


def _torch_int16():
    # Imported here: this module is the callbacks', which import no
    # backend.
    import torch

    return torch.int16


def read_int(variable) -> int:
    """A window counter's value, on any backend, as a Python int."""
    return int(read_array(variable))


# `PseudoBatchLogger`'s epoch-log keys that training minimises; a monitor
# of one (`EarlyStopping`, `ModelCheckpoint`, `ReduceLROnPlateau`) in
# `mode="auto"` gets `mode="min"`.
MINIMIZED_LOG_KEYS = frozenset({"pseudo_batch_loss_mean"})


# -- Readers: what `PseudoBatchLogger` reads of a model's window -------------
# The window is written by `_window.close` (the rings) and the trainer;
# callbacks read it only through these.

# The rings, in `PseudoBatch`'s field order.
_RINGS = (
    "update",
    "loss",
    "samples",
    "micro",
    "trace",
    "grad_sq",
    "lr_scale",
)
_INT_RINGS = ("update", "samples", "micro")


def published_count(model) -> int:
    """Windows `model` has published so far; 0 before its window state
    exists (and again after `compile()` rebuilt it)."""
    window = model._window
    return 0 if window is None else read_int(window.counters.log.count)


def read_published(model, first: int, count: int) -> list[tuple]:
    """The windows published from the `first`-th to before the `count`-th,
    each a tuple in `PseudoBatch`'s order (update, loss, samples,
    micro-batches, trace, grad_sq, lr_scale). The ring keeps the last
    `LOG_CAPACITY`: `first` must be within them."""
    log = model._window.counters.log
    rings = {name: read_array(getattr(log, name)) for name in _RINGS}
    found = []
    for i in range(first, count):
        slot = i % LOG_CAPACITY
        found.append(
            tuple(
                int(rings[name][slot])
                if name in _INT_RINGS
                else float(rings[name][slot])
                for name in _RINGS
            )
        )
    return found


def next_length(model) -> int:
    """The length of the windows `model` starts from now."""
    window = model._window
    if window is None:
        return model.window_length
    return read_int(window.counters.target_length)


def controller_averages(model) -> tuple[float, float] | None:
    """`accum_steps="auto"`'s moving averages of tr(Σ) and |G|², or None
    without a controller (or a window state)."""
    window = model._window
    if window is None or model._auto() is None:
        return None
    controller = window.counters.auto
    return (
        float(read_array(controller.trace)),
        float(read_array(controller.grad_sq)),
    )
