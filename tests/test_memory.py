"""Memory `AccumModel` adds to plain Keras `fit`.

Peak memory itself is measured by `benchmarks/bench_memory.py` (resident
set growth, each variant in a fresh process); tests here check what can be
checked deterministically.
"""

import keras
import numpy as np
import pytest
from keras.src.trainers.data_adapters import array_data_adapter

import keras_accum

pytestmark = pytest.mark.tensorflow_only(
    reason="counts the tf.data pipelines Keras's TensorFlow trainer builds"
)


@pytest.fixture
def pipelines_built(monkeypatch):
    """Counts the `tf.data` pipelines Keras builds from in-memory arrays.

    Each one serialises the arrays into its graph: a transient copy of the
    whole training data (measured: `AccumModel` +392 MiB over plain Keras
    for 192 MiB of images before the fix, in `bench_memory.py`'s sweep).
    The count wraps Keras's own method, which still runs.
    """
    calls = []
    original = array_data_adapter.ArrayDataAdapter.get_tf_dataset

    def counted(self):
        calls.append(self)
        return original(self)

    monkeypatch.setattr(
        array_data_adapter.ArrayDataAdapter, "get_tf_dataset", counted
    )
    return calls


def _fit(model):
    rng = np.random.default_rng(0)
    x = rng.random((256, 16), dtype=np.float32)
    y = rng.random((256, 4), dtype=np.float32)
    model.compile(optimizer="sgd", loss="mse")
    model.fit(x, y, batch_size=8, epochs=2, verbose=0)


def _linear(model_cls, **kwargs):
    inputs = keras.Input((16,))
    return model_cls(inputs, keras.layers.Dense(4)(inputs), **kwargs)


def test_fit_on_arrays_builds_no_second_pipeline(pipelines_built):
    """Before: the window was built from the spec of a second pipeline of
    the arrays (2 per `fit` where plain Keras builds 1)."""
    _fit(_linear(keras.Model))
    plain = len(pipelines_built)
    _fit(_linear(keras_accum.AccumModel, accum_steps=4))
    assert len(pipelines_built) - plain == plain == 1
