"""Why a loss must see the whole batch (issue 52): split into micro-batches
today, a loss that compares samples trains another model than
`keras.Model` at the batch, for every case of `_contrastive`."""

import keras
import numpy as np
import pytest
from _contrastive import CASES
from _helpers import assert_same_weights, max_weight_diff

import keras_accum

B, N = 16, 32


def _trained(name, model_cls, **kwargs):
    build, data, loss = CASES[name]
    # No dropout: the split mode's pieces would draw other masks than the
    # batch, and the difference measured here is the loss's alone.
    model = build(model_cls, dropout=0.0, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    x, y = data(N)
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_split_batches_see_fewer_negatives_and_train_another_model(name):
    plain = _trained(name, keras.Model)
    whole = _trained(name, keras_accum.AccumModel, micro_batch_size=B)
    split = _trained(name, keras_accum.AccumModel, micro_batch_size=4)
    # One piece per batch: the loss sees the batch, as `keras.Model`'s.
    assert_same_weights(whole, plain)
    # Four pieces: each piece's loss compares 4 samples, not 16.
    gap = max_weight_diff(split, plain)
    moved = max_weight_diff(plain, _untrained(name))
    assert gap > 0.05 * moved, (gap, moved)


def _untrained(name):
    build, _, _ = CASES[name]
    return build(keras.Model, dropout=0.0)


def test_the_cases_losses_compare_samples():
    # Each loss of a sample changes when another sample of its batch does:
    # the reason the split mode cannot be exact for them.
    for name, (build, data, loss) in CASES.items():
        if loss is None:
            continue
        model = build(keras.Model, dropout=0.0)
        x, y = data(8)
        y_pred = model(x)
        moved = keras.tree.map_structure(lambda t: np.array(t), x)
        for value in keras.tree.flatten(moved):
            value[-1] += 1.0
        before = keras.ops.convert_to_numpy(loss(y, y_pred))
        after = keras.ops.convert_to_numpy(loss(y, model(moved)))
        assert before.shape == (8,), name
        # The other samples are unchanged; their losses are not.
        assert np.abs(after[:-1] - before[:-1]).max() > 1e-4, name
