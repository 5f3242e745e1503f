"""The equivalence rule itself (`_helpers.assert_equivalent`).

Every equivalence test compares `AccumModel` with the plain large-batch
model; where the two differ by more than float32 rounding on this
platform, a float64 replay of the plain model's training decides. These
cases make the plain model's float32 path less accurate on purpose, the
way some CPUs' kernels are (`_Float32Rounding`), and check that the rule
still accepts the window, and still rejects a window with a weighting
error, whichever branch decides.
"""

import keras
import numpy as np
import pytest
from _helpers import (
    FLOAT64_VERDICTS,
    LargeBatch,
    assert_equivalent,
    float64,
    mlp,
    numpy_weights,
    regression_data,
    train_pair,
)
from keras import ops

import keras_accum
from keras_accum._trainer import AccumTrainer

B, K = 8, 4


@keras.saving.register_keras_serializable(package="keras_accum_tests")
class _Float32Rounding(keras.layers.Layer):
    """The identity, but in float32 it multiplies by 1 ± 3e-5.

    Stands for a platform whose float32 kernels round more coarsely than
    others (PyTorch on some AVX-512/AMX CPUs): float32 results move, the
    float64 computation of the same model does not.
    """

    def call(self, x):
        if self.compute_dtype != "float32":
            return x
        signs = ops.cast(ops.arange(ops.shape(x)[-1]) % 2, x.dtype) * 2 - 1
        return x * (1 + 3e-5 * signs)


def _models(rounding):
    """A plain MLP (with `_Float32Rounding` after its hidden layer where
    `rounding`) and an `AccumModel` one, same weights, SGD."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if rounding:
        hidden = _Float32Rounding()(hidden)
    plain = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    accum = mlp(keras_accum.AccumModel, accum_steps=K)
    for model in (plain, accum):
        numpy_weights(model)
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return plain, accum


def test_the_float64_replay_computes_in_float64():
    x, y = regression_data(n=64)
    plain, _ = _models(rounding=False)
    reference = LargeBatch(plain)
    reference.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    weights, updates, logs = reference.float64()
    assert {w.dtype for w in weights} == {np.dtype("float64")}
    assert [i for i, _ in updates] == [1, 2]
    assert len(logs["loss"]) == 1
    # On any platform, float32 training stays near the exact run here.
    distance = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(plain.get_weights(), weights, strict=True)
    )
    assert 0 < distance < 1e-5
    # Keras's settings are back to float32 afterwards.
    assert keras.config.floatx() == "float32"
    with float64():
        assert mlp().get_weights()[0].dtype == np.float64
    assert mlp().get_weights()[0].dtype == np.float32


def test_a_plain_model_that_rounds_coarsely_is_judged_by_float64(report_diff):
    x, y = regression_data(n=76)  # Windows of 32, 32 and 12 (8 + 4).
    plain, accum = _models(rounding=True)
    before = len(FLOAT64_VERDICTS)
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff, "plain model rounding 3e-5 coarser in float32")
    # The two float32 models end further apart than the tolerance: the
    # float64 replay decided (for the final weights and the later updates).
    assert diff > 1e-6
    assert len(FLOAT64_VERDICTS) > before
    assert "at update" not in FLOAT64_VERDICTS[-1]


def _weighting_error(monkeypatch):
    """A window that weights every micro-batch as a full one (8 samples):
    a mean of micro-batch means, wrong only for the short micro-batch."""
    averaged = AccumTrainer._averaged_objective

    def mean_of_means(self, loss, normalizer, batch_size, *args):
        objective, share = averaged(self, loss, normalizer, batch_size, *args)
        full = ops.cast(B, objective.dtype) / ops.cast(
            normalizer, objective.dtype
        )
        return objective * full, share

    monkeypatch.setattr(AccumTrainer, "_averaged_objective", mean_of_means)


@pytest.mark.parametrize("rounding", [False, True], ids=["direct", "float64"])
def test_a_weighting_error_still_fails(rounding, monkeypatch):
    x, y = regression_data(n=76)
    plain, accum = _models(rounding)
    _weighting_error(monkeypatch)
    with pytest.raises(AssertionError, match="AccumModel is"):
        train_pair(plain, accum, x, y, B, K)


def test_without_a_replay_a_difference_fails():
    weights = [np.zeros(3, "float32")]
    assert assert_equivalent(weights, [w + 5e-7 for w in weights]) < 1e-6
    with pytest.raises(AssertionError, match="no float64 replay"):
        assert_equivalent(weights, [w + 1e-5 for w in weights])
