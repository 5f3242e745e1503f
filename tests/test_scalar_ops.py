"""The window rules' ops (`keras_accum._scalar_ops`) give `keras.ops`' results.

On PyTorch they call `torch` directly where `keras.ops` would only pass
tensors through; elsewhere they are `keras.ops`. Every case compares value
and dtype with `keras.ops` on the same arguments, on every backend:
tensors of each dtype the window holds, a condition known in the step (a
Python bool), and the Python numbers that take the fallback.
"""

import keras
import numpy as np
import pytest
from keras import ops

from keras_accum import _scalar_ops


def _t(value, dtype):
    return ops.convert_to_tensor(value, dtype)


def _same(got, expected):
    if isinstance(expected, (list, tuple)):  # `unstack`
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _same(g, e)
        return
    assert keras.backend.standardize_dtype(got.dtype) == (
        keras.backend.standardize_dtype(expected.dtype)
    )
    np.testing.assert_array_equal(
        ops.convert_to_numpy(got), ops.convert_to_numpy(expected)
    )


RING = [0.5, float("nan"), -2.0, 7.0]
CASES = [
    ("cast", (_t(3, "int32"), "float32")),
    ("cast", (_t(2.5, "float32"), "int32")),
    ("cast", (_t(True, "bool"), "int32")),
    ("cast", (_t(4.0, "float32"), "float32")),
    ("cast", (5, "float32")),
    ("where", (_t(True, "bool"), _t(1, "int32"), _t(2, "int32"))),
    ("where", (_t(False, "bool"), _t(1.5, "float32"), _t(2.5, "float32"))),
    (
        "where",
        (_t([True, False, True, False], "bool"), _t(9.0, "float32"), RING),
    ),
    ("where", (_t(True, "bool"), _t(1, "int32"), _t(2.0, "float32"))),
    ("logical_and", (_t(True, "bool"), _t(False, "bool"))),
    ("logical_and", (True, _t(True, "bool"))),
    ("logical_and", (_t(True, "bool"), False)),
    ("logical_or", (_t(False, "bool"), _t(False, "bool"))),
    ("logical_or", (True, _t(False, "bool"))),
    ("logical_or", (_t(False, "bool"), False)),
    ("logical_not", (_t(True, "bool"),)),
    ("zeros_like", (_t(7, "int32"),)),
    ("ones_like", (_t(7.5, "float32"),)),
    ("isfinite", (_t(RING, "float32"),)),
    ("stack", ([_t(1.0, "float32"), _t(2.0, "float32")],)),
    ("stack", ([_t(1, "int32"), _t(2.0, "float32")],)),
    ("unstack", (_t([1.0, 2.0, 3.0, 0.0], "float32"),)),
]


@pytest.mark.parametrize(
    ("name", "args"), CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(CASES)]
)
def test_each_op_gives_keras_ops_result(name, args):
    args = tuple(
        _t(a, "float32")
        if isinstance(a, list) and not ops.is_tensor(a[0])
        else a
        for a in args
    )
    _same(getattr(_scalar_ops, name)(*args), getattr(ops, name)(*args))


def test_the_rules_call_torch_directly_on_pytorch_only():
    direct = _scalar_ops.where is not ops.where
    assert direct == (keras.backend.backend() == "torch")
