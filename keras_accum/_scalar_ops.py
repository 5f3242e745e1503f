"""The `keras.ops` the window rules (`_window.py`) run on the window's values.

On TensorFlow and JAX these are `keras.ops` themselves: the step is traced
once, and what an op costs in Python is paid once. PyTorch's step is eager
and runs the rules on every micro-batch, on scalars, where `keras.ops`'
conversions and dtype checks cost several times the operation itself
(`benchmarks/bench_backends.py`: the bookkeeping was most of what the
window cost over Keras's own accumulation on the small MLP). There, each
function below calls `torch` directly where its arguments are tensors that
`keras.ops` would pass through as they are (one device; the dtypes it
would not convert) and falls back to `keras.ops` for anything else, so the
results are `keras.ops`' (`tests/test_scalar_ops.py`).
"""

from __future__ import annotations

import builtins

import keras
from keras import ops

all = ops.all  # The rules call `ops.all` and `ops.sum`, as in `keras.ops`.
arange = ops.arange
cast = ops.cast
convert_to_tensor = ops.convert_to_tensor
full_like = ops.full_like
isfinite = ops.isfinite
logical_and = ops.logical_and
logical_not = ops.logical_not
logical_or = ops.logical_or
maximum = ops.maximum
ones = ops.ones
ones_like = ops.ones_like
square = ops.square
stack = ops.stack
sum = ops.sum
unstack = ops.unstack
where = ops.where
zeros = ops.zeros
zeros_like = ops.zeros_like


if keras.backend.backend() == "torch":
    import torch

    _DTYPES = {
        "bool": torch.bool,
        "float32": torch.float32,
        "int32": torch.int32,
        "int64": torch.int64,
    }

    def _tensors(*values) -> bool:
        """Whether `values` are tensors on one device."""
        first = values[0]
        if not isinstance(first, torch.Tensor):
            return False
        return builtins.all(
            isinstance(v, torch.Tensor) and v.device == first.device
            for v in values[1:]
        )

    def cast(x, dtype):
        target = dtype
        if not isinstance(dtype, torch.dtype):
            target = _DTYPES.get(dtype) if isinstance(dtype, str) else None
        if target is None or not isinstance(x, torch.Tensor):
            return ops.cast(x, dtype)
        return x if x.dtype == target else x.to(target)

    def where(condition, x1, x2):
        if _tensors(condition, x1, x2) and condition.dtype == torch.bool:
            return torch.where(condition, x1, x2)
        return ops.where(condition, x1, x2)

    def _known(x1, x2):
        """`(flag, tensor)` where one of `x1`, `x2` is a Python bool (a
        condition known in the step, such as an eager close's) and the
        other a boolean tensor; None otherwise."""
        for flag, other in ((x1, x2), (x2, x1)):
            if (
                isinstance(flag, bool)
                and isinstance(other, torch.Tensor)
                and other.dtype == torch.bool
            ):
                return flag, other
        return None

    def _logical(direct, fallback, x1, x2, absorbing: bool):
        """`direct(x1, x2)` on two tensors; on a Python bool and a boolean
        tensor, `absorbing` everywhere if the bool is `absorbing` (False
        for "and", True for "or"), else the tensor."""
        if _tensors(x1, x2):
            return direct(x1, x2)
        known = _known(x1, x2)
        if known is None:
            return fallback(x1, x2)
        flag, other = known
        if flag is absorbing:
            return torch.full_like(other, absorbing)
        return other.clone()

    def logical_and(x1, x2):
        return _logical(torch.logical_and, ops.logical_and, x1, x2, False)

    def logical_or(x1, x2):
        return _logical(torch.logical_or, ops.logical_or, x1, x2, True)

    def logical_not(x):
        if isinstance(x, torch.Tensor):
            return torch.logical_not(x)
        return ops.logical_not(x)

    def zeros_like(x):
        if isinstance(x, torch.Tensor):
            return torch.zeros_like(x)
        return ops.zeros_like(x)

    def ones_like(x):
        if isinstance(x, torch.Tensor):
            return torch.ones_like(x)
        return ops.ones_like(x)

    def stack(values, axis=0):
        values = list(values)
        if values and _tensors(*values) and len({v.dtype for v in values}) == 1:
            return torch.stack(values, dim=axis)
        return ops.stack(values, axis=axis)

    def isfinite(x):
        if isinstance(x, torch.Tensor):
            return torch.isfinite(x)
        return ops.isfinite(x)

    def unstack(x, axis=0):
        if isinstance(x, torch.Tensor):
            return list(torch.unbind(x, dim=axis))
        return ops.unstack(x, axis=axis)
