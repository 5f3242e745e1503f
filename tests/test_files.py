"""Files `AccumModel` writes are whole or absent (`keras_accum/_files.py`).

The kill of a process during a backup is in test_robustness.py; here a
save that fails with an exception, and the paths that are written as Keras
writes them.
"""

import keras
import numpy as np
import pytest
from _helpers import accum_mlp, regression_data

import keras_accum


class _FailingSave(keras.layers.Layer):
    """The identity; its save fails when `fail` is set."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.fail = False

    def call(self, x):
        return x

    def save_own_variables(self, store):
        if self.fail:
            raise RuntimeError("disk full")


def _trained():
    inputs = keras.Input((5,))
    tripwire = _FailingSave()
    hidden = tripwire(keras.layers.Dense(8)(inputs))
    outputs = keras.layers.Dense(3)(hidden)
    model = keras_accum.AccumModel(inputs, outputs, accum_steps=2)
    model.compile(optimizer="sgd", loss="mse")
    x, y = regression_data(n=16)
    model.fit(x, y, batch_size=4, verbose=0)
    return model, tripwire, (x, y)


@pytest.mark.parametrize(
    "name, save",
    [
        ("m.weights.h5", lambda m, p: m.save_weights(p)),
        ("m.keras", lambda m, p: m.save(p)),
    ],
)
def test_a_failed_save_leaves_the_previous_file(tmp_path, name, save):
    model, tripwire, (x, y) = _trained()
    path = tmp_path / name
    save(model, path)  # A pathlib.Path, as users pass them.
    saved = model.get_weights()
    model.fit(x, y, batch_size=4, verbose=0)
    tripwire.fail = True
    with pytest.raises(RuntimeError, match="disk full"):
        save(model, path)
    # The previous file, whole; nothing else left beside it.
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]
    tripwire.fail = False
    fresh, _, _ = _trained()
    if name.endswith(".keras"):
        fresh = keras.saving.load_model(
            path, custom_objects={"_FailingSave": _FailingSave}
        )
    else:
        fresh.load_weights(path)
    for a, b in zip(fresh.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)


def test_not_overwriting_an_existing_file_is_keras_s_prompt(tmp_path):
    model = accum_mlp(2)
    model.compile(optimizer="sgd", loss="mse")
    path = tmp_path / "m.weights.h5"
    model.save_weights(path)
    saved = model.get_weights()
    model.set_weights([w + 1.0 for w in saved])
    # Keras asks on stdin; answering no keeps the file as it was.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("builtins.input", lambda *_: "n")
        model.save_weights(path, overwrite=False)
    model.load_weights(path)
    for a, b in zip(model.get_weights(), saved, strict=True):
        np.testing.assert_array_equal(a, b)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.weights.h5"]
