"""`_output_grads`: the loss's gradient with respect to the batch's outputs,
carried back through each piece (with `_seeds` replaying its draws),
equals the one-pass gradient of the loss through the pieces' forward
passes, on every backend and for every case of `_contrastive`."""

import keras
import numpy as np
import pytest
from _contrastive import CASES

from keras_accum import _compat, _output_grads, _seeds

if keras.backend.backend() == "tensorflow":
    from keras_accum import _tf_output_grads as backend_grads
elif keras.backend.backend() == "jax":
    from keras_accum import _jax_output_grads as backend_grads
else:
    from keras_accum import _torch_output_grads as backend_grads

BACKEND = keras.backend.backend()
B = 16
ONE = [(0, B)]
EVEN = [(0, 4), (4, 8), (8, 12), (12, 16)]
UNEVEN = [(0, 5), (5, 10), (10, 16)]


def _case(name, dropout=0.3):
    build, data, loss = CASES[name]
    model = build(keras.Model, dropout=dropout)
    model.compile(optimizer="sgd", loss=loss)
    x, y = data(B)
    weights = np.linspace(0.5, 1.5, B).astype("float32")
    return model, x, y, weights


def _numpy(grads):
    return [None if g is None else keras.ops.convert_to_numpy(g) for g in grads]


def _no_grad():
    if BACKEND == "torch":
        import torch

        return torch.no_grad()
    import contextlib

    return contextlib.nullcontext()


def _rewind(model):
    """Sets the random generators back to where they are now, when called:
    `one_pass` and `two_pass` each move them as one forward pass."""
    generators = _seeds.seed_generators(model)
    kept = [keras.ops.convert_to_numpy(g.state.value) for g in generators]

    def rewind():
        for generator, value in zip(generators, kept, strict=True):
            generator.state.assign(value)

    return rewind


def two_pass(model, x, y, sample_weight, bounds, extra_loss=None):
    """The whole-batch step's gradient, from the stateful primitives."""
    replay = _seeds.SeedReplay(model)
    start = replay.start()
    outputs = []
    with _no_grad():  # pass 1
        for i, (a, b) in enumerate(bounds):
            replay.enter(start, i)
            outputs.append(model(_output_grads.rows(x, a, b), training=True))
    y_pred = _output_grads.join(outputs)
    found = backend_grads.loss_and_output_grads(
        model, (x, y, sample_weight), y_pred
    )
    total = _numpy(found.weights)
    through_pieces = [None] * len(total)
    for i, (a, b) in enumerate(bounds):  # pass 2
        replay.enter(start, i)
        piece = backend_grads.piece_vjp(
            model,
            _output_grads.rows(x, a, b),
            _output_grads.rows(found.y_pred, a, b),
            extra_loss,
        )
        through_pieces = _add(through_pieces, _numpy(piece.weights))
    replay.finish(start, len(bounds) - 1)
    return found, _add(total, through_pieces), through_pieces


def _add(a, b):
    return [
        v if u is None else u if v is None else u + v
        for u, v in zip(a, b, strict=True)
    ]


def one_pass(model, x, y, sample_weight, bounds):
    """The gradient of Keras's own `compute_loss` through the pieces'
    forward passes, in one backward pass (the same draws: `_seeds`)."""
    replay = _seeds.SeedReplay(model)
    start = replay.start()
    if BACKEND == "jax":
        return _one_pass_jax(model, x, y, sample_weight, bounds, start)

    def loss():
        outputs = []
        for i, (a, b) in enumerate(bounds):
            replay.enter(start, i)
            outputs.append(model(_output_grads.rows(x, a, b), training=True))
        y_pred = _output_grads.join(outputs)
        return _compat.compute_loss(model, x, y, y_pred, sample_weight)

    if BACKEND == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            value = loss()
        grads = tape.gradient(value, model.trainable_variables)
    else:
        import torch

        params = [_compat.backing_value(v) for v in model.trainable_variables]
        value = loss()
        grads = torch.autograd.grad(value, params, allow_unused=True)
    replay.finish(start, len(bounds) - 1)
    return keras.ops.convert_to_numpy(value), _numpy(grads)


def _one_pass_jax(model, x, y, sample_weight, bounds, start):
    import jax

    indices = _seeds.seed_state_indices(model)
    starts, _ = start
    non_trainable = [v.value for v in model.non_trainable_variables]
    metrics = [v.value for v in model.metrics_variables]

    def loss(trainable):
        values = non_trainable
        outputs, losses = [], []
        for i, (a, b) in enumerate(bounds):
            values = _seeds.entered_values(values, indices, starts, i)
            out, values, own = model.stateless_call(
                trainable,
                values,
                _output_grads.rows(x, a, b),
                training=True,
                return_losses=True,
            )
            outputs.append(out)
            losses.extend(own)
        y_pred = _output_grads.join(outputs)
        # As Keras's JAX step hands the forward pass's losses to the loss.
        _compat.override_losses(model, losses or None)
        try:
            value, _ = model.stateless_compute_loss(
                trainable, values, metrics, x, y, y_pred, sample_weight
            )
        finally:
            _compat.override_losses(model, None)
        return value

    trainable = [v.value for v in model.trainable_variables]
    value, grads = jax.value_and_grad(loss)(trainable)
    return np.asarray(value), _numpy(grads)


def _assert_close(ours, reference):
    for i, (u, v) in enumerate(zip(ours, reference, strict=True)):
        if v is None:
            assert u is None or not np.any(u), i
            continue
        assert u is not None, i
        scale = max(1.0, float(np.abs(v).max()))
        np.testing.assert_allclose(u, v, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("bounds", [ONE, EVEN, UNEVEN], ids=len)
@pytest.mark.parametrize("name", sorted(CASES))
def test_two_passes_equal_one(name, bounds):
    model, x, y, weights = _case(name)
    rewind = _rewind(model)
    value, reference = one_pass(model, x, y, weights, bounds)
    rewind()
    found, ours, _ = two_pass(model, x, y, weights, bounds)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(found.loss), value, rtol=1e-6
    )
    _assert_close(ours, reference)
    # The gradient is not trivially small.
    assert max(np.abs(g).max() for g in reference if g is not None) > 1e-3


def _index(model, name):
    (found,) = [
        i
        for i, v in enumerate(model.trainable_variables)
        if v.path.endswith(name)
    ]
    return found


def test_a_weight_the_loss_reads_gets_its_gradient_once():
    # The dual encoder's `compute_loss` reads `self.logit_scale`: it gets
    # its gradient from the loss, once, and none through the pieces (the
    # error OpenCLIP's accumulation makes, k times over).
    model, x, y, weights = _case("dual_encoder")
    scale = _index(model, "logit_scale")
    rewind = _rewind(model)
    found, ours, through_pieces = two_pass(model, x, y, weights, EVEN)
    assert found.weights[scale] is not None
    assert through_pieces[scale] is None or not np.any(through_pieces[scale])
    # No other weight is read by the loss.
    assert [i for i, g in enumerate(found.weights) if g is not None] == [scale]
    rewind()
    _, reference = one_pass(model, x, y, weights, EVEN)
    assert abs(float(reference[scale])) > 1e-3
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(found.weights[scale]),
        reference[scale],
        rtol=1e-5,
    )


def test_a_weight_in_the_outputs_gets_its_gradient_through_the_pieces():
    # CLIP's `LogitScale` layer: the loss reads the outputs only.
    model, x, y, weights = _case("clip")
    scale = _index(model, "logit_scale")
    found, _, through_pieces = two_pass(model, x, y, weights, EVEN)
    assert all(g is None for g in found.weights)
    assert abs(float(through_pieces[scale])) > 1e-3


def _regularized(model_cls=keras.Model):
    keras.utils.set_random_seed(4)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(0.1),
        activity_regularizer=keras.regularizers.L1(0.05),
    )(inputs)
    outputs = keras.layers.Dense(4)(keras.layers.Dropout(0.3, seed=3)(hidden))
    model = model_cls(inputs, keras.layers.UnitNormalization()(outputs))
    model.compile(optimizer="sgd", loss=CASES["supcon"][2])
    return model


def test_the_model_losses_are_held_out_and_added_by_the_pieces():
    model = _regularized()
    x, y = CASES["supcon"][1](B)
    # One piece: the batch's forward pass, whose losses are the batch's.
    rewind = _rewind(model)
    value, reference = one_pass(model, x, y, None, ONE)
    rewind()
    found, ours, _ = two_pass(
        model,
        x,
        y,
        None,
        ONE,
        extra_loss=lambda y_pred, losses: keras.ops.sum(
            keras.ops.stack([keras.ops.sum(v) for v in losses])
        ),
    )
    # The loss returned is the outputs' alone: Keras's less the model's.
    rewind()
    model(x, training=True)
    own = float(sum(keras.ops.convert_to_numpy(v) for v in model.losses))
    assert own > 1e-2
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(found.loss), value - own, rtol=1e-5
    )
    # With the model's losses added by the piece, the gradient is Keras's.
    _assert_close(ours, reference)
    # And without them, it is not.
    rewind()
    _, without, _ = two_pass(model, x, y, None, ONE)
    kernel = _index(model, "dense/kernel")
    assert np.abs(without[kernel] - reference[kernel]).max() > 1e-3


def test_scale_loss_scales_the_output_gradient():
    model, x, y, weights = _case("clip", dropout=0.0)
    y_pred = model(x, training=True)
    data = (x, y, weights)
    plain = backend_grads.loss_and_output_grads(model, data, y_pred)
    scaled = backend_grads.loss_and_output_grads(
        model, data, y_pred, scale_loss=lambda v: v * 128.0
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(scaled.loss),
        keras.ops.convert_to_numpy(plain.loss),
    )
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(scaled.y_pred),
        128.0 * keras.ops.convert_to_numpy(plain.y_pred),
        rtol=1e-6,
    )


@pytest.mark.skipif(BACKEND != "jax", reason="JAX's jitted stateless form")
@pytest.mark.parametrize("name", ["dual_encoder", "two_tower"])
def test_the_stateless_forms_inside_jit(name):
    import jax

    from keras_accum import _jax_output_grads

    model, x, y, weights = _case(name)
    indices = _seeds.seed_state_indices(model)
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    metrics = [v.value for v in model.metrics_variables]

    @jax.jit
    def step(trainable, non_trainable, metrics):
        start = _seeds.start_values(non_trainable, indices)
        values, outputs = non_trainable, []
        for i, (a, b) in enumerate(UNEVEN):
            values = _seeds.entered_values(values, indices, start, i)
            out, values = model.stateless_call(
                trainable, values, _output_grads.rows(x, a, b), training=True
            )
            outputs.append(jax.lax.stop_gradient(out))
        found, (values, metrics) = (
            _jax_output_grads.stateless_loss_and_output_grads(
                model,
                (trainable, values, metrics),
                (x, y, weights),
                _output_grads.join(outputs),
            )
        )
        total = [jax.numpy.zeros_like(t) for t in trainable]
        total = [
            t if g is None else t + g
            for t, g in zip(total, found.weights, strict=True)
        ]
        for i, (a, b) in enumerate(UNEVEN):
            values = _seeds.entered_values(values, indices, start, i)
            piece, values = _jax_output_grads.stateless_piece_vjp(
                model,
                trainable,
                values,
                _output_grads.rows(x, a, b),
                _output_grads.rows(found.y_pred, a, b),
            )
            total = [t + g for t, g in zip(total, piece.weights, strict=True)]
        values = _seeds.finished_values(values, indices, start, len(UNEVEN) - 1)
        return found.loss, total, values

    loss, total, values = step(trainable, non_trainable, metrics)
    rewind = _rewind(model)
    value, reference = one_pass(model, x, y, weights, UNEVEN)
    rewind()
    np.testing.assert_allclose(np.asarray(loss), value, rtol=1e-5)
    _assert_close(_numpy(total), reference)
    # The generators end where one forward pass of the batch leaves them.
    model(x, training=True)
    for i in indices:
        np.testing.assert_array_equal(
            np.asarray(values[i]),
            keras.ops.convert_to_numpy(model.non_trainable_variables[i]),
        )


@pytest.mark.tensorflow_only(reason="TensorFlow's graph and XLA")
@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "xla"])
def test_the_primitives_in_a_traced_step(jit_compile):
    import tensorflow as tf

    model, x, y, weights = _case("two_tower")
    rewind = _rewind(model)

    # Traced alike: XLA's random kernels draw other masks than eager's
    # for the same seed, as they do in a plain model's XLA step.
    @tf.function(jit_compile=jit_compile)
    def reference_step(x, weights):
        replay = _seeds.SeedReplay(model)
        start = replay.start()
        with tf.GradientTape() as tape:
            outputs = []
            for i, (a, b) in enumerate(UNEVEN):
                replay.enter(start, i)
                piece = _output_grads.rows(x, a, b)
                outputs.append(model(piece, training=True))
            y_pred = _output_grads.join(outputs)
            value = _compat.compute_loss(model, x, None, y_pred, weights)
        grads = tape.gradient(value, model.trainable_variables)
        replay.finish(start, len(UNEVEN) - 1)
        return value, grads

    @tf.function(jit_compile=jit_compile)
    def step(x, weights):
        found, total, _ = _traced_two_pass(model, x, weights)
        return found.loss, total

    value, reference = reference_step(x, tf.constant(weights))
    rewind()
    loss, total = step(x, tf.constant(weights))
    np.testing.assert_allclose(loss.numpy(), value.numpy(), rtol=1e-5)
    _assert_close(_numpy(total), _numpy(reference))
    # The generators end where one forward pass of the batch leaves them.
    traced_end = [g.state.numpy() for g in _seeds.seed_generators(model)]
    rewind()
    model(x, training=True)
    for a, g in zip(traced_end, _seeds.seed_generators(model), strict=True):
        np.testing.assert_array_equal(a, g.state.numpy())


def _traced_two_pass(model, x, weights):
    # `two_pass` less its conversions to numpy, which a graph cannot make.
    replay = _seeds.SeedReplay(model)
    start = replay.start()
    outputs = []
    for i, (a, b) in enumerate(UNEVEN):
        replay.enter(start, i)
        outputs.append(model(_output_grads.rows(x, a, b), training=True))
    found = backend_grads.loss_and_output_grads(
        model, (x, None, weights), _output_grads.join(outputs)
    )
    total = list(found.weights)
    for i, (a, b) in enumerate(UNEVEN):
        replay.enter(start, i)
        piece = backend_grads.piece_vjp(
            model,
            _output_grads.rows(x, a, b),
            _output_grads.rows(found.y_pred, a, b),
        )
        total = [
            g if t is None else t if g is None else t + g
            for t, g in zip(total, piece.weights, strict=True)
        ]
    replay.finish(start, len(UNEVEN) - 1)
    return found, total, outputs


def test_mixed_precision_with_a_scaled_loss():
    # float16 outputs: the output gradient is the scaled loss's, cast to
    # each output's dtype on the way back; float32 weights' gradients.
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model, x, y, weights = _case("dual_encoder", dropout=0.0)
        y_pred = model(x, training=True)
        first = keras.tree.flatten(y_pred)[0]
        assert keras.backend.standardize_dtype(first.dtype) == "float16"
        found = backend_grads.loss_and_output_grads(
            model, (x, y, weights), y_pred, scale_loss=lambda v: v * 1024.0
        )
        assert keras.backend.standardize_dtype(found.y_pred["image"].dtype) == (
            "float16"
        )
        total = _numpy(found.weights)
        piece = backend_grads.piece_vjp(model, x, found.y_pred)
        total = [
            g / 1024.0 if g is not None else None
            for g in _add(total, _numpy(piece.weights))
        ]
        _, reference = one_pass(model, x, y, weights, ONE)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")
    for u, v in zip(total, reference, strict=True):
        assert keras.backend.standardize_dtype(u.dtype) == "float32"
        # float16 forward passes: a float16 tolerance.
        np.testing.assert_allclose(u, v, rtol=2e-2, atol=2e-3)
