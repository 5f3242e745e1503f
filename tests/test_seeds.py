"""`_seeds`: a piece's random draws replayed, on every backend."""

import keras
import numpy as np
import pytest

from keras_accum import _seeds

BACKEND = keras.backend.backend()


def noisy_model(dropout_seed=7):
    """Dropout (seeded, or unseeded where `dropout_seed` is None), noise
    inside a nested model, and a dense layer: every draw reaches the
    outputs."""
    keras.utils.set_random_seed(1)
    inner = keras.Sequential(
        [keras.layers.Dense(8), keras.layers.GaussianNoise(0.3, seed=11)]
    )
    inputs = keras.Input((5,))
    x = keras.layers.Dropout(0.5, seed=dropout_seed)(inputs)
    x = inner(x)
    outputs = keras.layers.Dense(3)(keras.layers.Dropout(0.3, seed=5)(x))
    return keras.Model(inputs, outputs)


def data(n=12):
    return np.random.default_rng(0).normal(size=(n, 5)).astype("float32")


def states(model):
    return [
        keras.ops.convert_to_numpy(g.state.value)
        for g in _seeds.seed_generators(model)
    ]


def set_states(model, values):
    for g, value in zip(_seeds.seed_generators(model), values, strict=True):
        g.state.assign(value)


def two_passes(model, pieces):
    replay = _seeds.SeedReplay(model)
    start = replay.start()
    first = []
    for i, piece in enumerate(pieces):
        replay.enter(start, i)
        first.append(keras.ops.convert_to_numpy(model(piece, training=True)))
    second = []
    for i, piece in enumerate(pieces):
        replay.enter(start, i)
        second.append(keras.ops.convert_to_numpy(model(piece, training=True)))
    replay.finish(start, len(pieces) - 1)
    return first, second


def test_finds_every_generator_once_nested_included():
    model = noisy_model()
    generators = _seeds.seed_generators(model)
    # Two dropouts and the nested model's noise.
    assert len(generators) == 3
    indices = _seeds.seed_state_indices(model)
    assert len(indices) == 3
    states_ids = {id(g.state) for g in generators}
    assert {id(model.non_trainable_variables[i]) for i in indices} == (
        states_ids
    )


def test_pass_two_draws_what_pass_one_drew():
    model = noisy_model()
    x = data()
    pieces = [x[:4], x[4:8], x[8:]]
    first, second = two_passes(model, pieces)
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)
    # The draws are random: without the replay, pass 2 draws new masks.
    again = keras.ops.convert_to_numpy(model(pieces[0], training=True))
    assert np.abs(again - first[0]).max() > 1e-3
    # And each piece draws from its own stream: the same rows in two
    # pieces get different masks.
    same = [x[:4], x[:4]]
    first, _ = two_passes(model, same)
    assert np.abs(first[0] - first[1]).max() > 1e-3


def test_generators_end_where_one_forward_of_the_batch_leaves_them():
    model = noisy_model()
    x = data()
    start = states(model)
    model(x, training=True)
    one_forward = states(model)
    assert any((a != b).any() for a, b in zip(start, one_forward, strict=True))
    set_states(model, start)
    two_passes(model, [x[:4], x[4:8], x[8:]])
    for a, b in zip(states(model), one_forward, strict=True):
        np.testing.assert_array_equal(a, b)


def test_one_piece_draws_what_a_plain_forward_draws():
    model = noisy_model()
    x = data()
    start = states(model)
    plain = keras.ops.convert_to_numpy(model(x, training=True))
    set_states(model, start)
    first, second = two_passes(model, [x])
    np.testing.assert_array_equal(first[0], plain)
    np.testing.assert_array_equal(second[0], plain)


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's stateless step")
def test_stateless_form_equals_the_stateful_one():
    import jax

    model = noisy_model()
    x = data()
    pieces = [x[:6], x[6:]]
    indices = _seeds.seed_state_indices(model)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    @jax.jit
    def step(trainable, non_trainable):
        start = _seeds.start_values(non_trainable, indices)
        outs = []
        for _ in range(2):  # both passes
            values = non_trainable
            for i, piece in enumerate(pieces):
                values = _seeds.entered_values(values, indices, start, i)
                y, values = model.stateless_call(
                    trainable, values, piece, training=True
                )
                outs.append(y)
        values = _seeds.finished_values(values, indices, start, len(pieces) - 1)
        return outs, values

    outs, values = step(trainable, non_trainable)
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])
    first, _ = two_passes(model, pieces)
    # Compiled against eager: the same draws, rounded by another fusion.
    np.testing.assert_allclose(outs[0], first[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(outs[1], first[1], rtol=1e-5, atol=1e-6)
    # The stateful run left the generators where the stateless one does.
    for i, state in zip(indices, states(model), strict=True):
        np.testing.assert_array_equal(np.asarray(values[i]), state)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="a traced TF loop")
def test_replay_inside_a_traced_loop():
    import tensorflow as tf

    model = noisy_model()
    x = data()
    replay = _seeds.SeedReplay(model)

    @tf.function
    def passes(x):
        start = replay.start()
        outs = []
        for _ in range(2):
            for i in range(2):
                # The piece index as a traced loop would hold it.
                replay.enter(start, tf.constant(i))
                outs.append(model(x[i * 6 : (i + 1) * 6], training=True))
        replay.finish(start, tf.constant(1))
        return outs

    start = states(model)
    outs = [o.numpy() for o in passes(tf.constant(x))]
    np.testing.assert_array_equal(outs[0], outs[2])
    np.testing.assert_array_equal(outs[1], outs[3])
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
    traced_end = states(model)
    set_states(model, start)
    model(x, training=True)
    for a, b in zip(traced_end, states(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_torch_global_draws_named_and_replayed():
    model = noisy_model(dropout_seed=None)
    found = _seeds.torch_global_draws(model)
    if BACKEND != "torch":
        assert found == []
        return
    assert [type(layer) for layer in found] == [keras.layers.Dropout]
    # A rate of 0 draws nothing (and Keras gives it no generator).
    quiet = keras.Sequential([keras.Input((5,)), keras.layers.Dropout(0.0)])
    assert _seeds.torch_global_draws(quiet) == []
    x = data()
    first, second = two_passes(model, [x[:6], x[6:]])
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(BACKEND != "jax", reason="a JAX loop over the pieces")
def test_stateless_form_with_a_traced_piece_index():
    import jax

    model = noisy_model()
    x = data()
    pieces = jax.numpy.asarray(x.reshape(3, 4, 5))
    indices = _seeds.seed_state_indices(model)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]

    def run(non_trainable, unrolled):
        start = _seeds.start_values(non_trainable, indices)

        def body(i, values):
            values = _seeds.entered_values(values, indices, start, i)
            y, values = model.stateless_call(
                trainable, values, pieces[i], training=True
            )
            return values, y

        if unrolled:
            outs, values = [], non_trainable
            for i in range(3):
                values, y = body(i, values)
                outs.append(y)
            return jax.numpy.stack(outs), values

        def step(values, i):
            return body(i, values)

        values, outs = jax.lax.scan(step, non_trainable, jax.numpy.arange(3))
        return outs, values

    scanned, values = jax.jit(lambda v: run(v, False))(non_trainable)
    unrolled, _ = jax.jit(lambda v: run(v, True))(non_trainable)
    np.testing.assert_allclose(scanned, unrolled, rtol=1e-5, atol=1e-6)
    assert np.abs(np.asarray(scanned[0] - scanned[1])).max() > 1e-3
    start = _seeds.start_values(non_trainable, indices)
    end = _seeds.finished_values(values, indices, start, 2)
    model(x, training=True)
    for i, state in zip(indices, states(model), strict=True):
        np.testing.assert_array_equal(np.asarray(end[i]), state)
