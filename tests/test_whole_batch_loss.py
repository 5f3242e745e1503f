"""`whole_batch_loss=True`: the loss sees the whole batch, its gradient
carried back piece by piece (issue 52), equal to `keras.Model` at the
batch for every case of `_contrastive`, on every backend."""

import functools

import keras
import numpy as np
import pytest
from _contrastive import CASES, supcon_loss
from _helpers import (
    assert_equivalent,
    assert_same_weights,
    build_optimizer,
    float64,
    max_weight_diff,
    overflow_prone,
)
from test_output_grads import one_pass

import keras_accum

BACKEND = keras.backend.backend()

B = 8
UPDATES = 3


def _optimizer(kind):
    if kind == "adam":
        return keras.optimizers.Adam(0.05)
    if kind == "sgd":
        return keras.optimizers.SGD(0.3)
    return keras.optimizers.SGD(0.3, momentum=0.9)


def _build(
    name, model_cls, dropout, optimizer="momentum", jit_compile="auto", **kwargs
):
    build, data, loss = CASES[name]
    model = build(model_cls, dropout=dropout, **kwargs)
    model.compile(
        optimizer=_optimizer(optimizer), loss=loss, jit_compile=jit_compile
    )
    build_optimizer(model)
    return model


def _batches(name, weighted=False):
    _, data, _ = CASES[name]
    x, y = data(B * UPDATES)
    weights = np.linspace(0.5, 1.5, B * UPDATES).astype("float32")
    found = []
    for i in range(UPDATES):
        rows = slice(i * B, (i + 1) * B)
        batch = [
            keras.tree.map_structure(lambda t, r=rows: t[r], x),
            None if y is None else y[rows],
        ]
        if weighted:
            batch.append(weights[rows])
        found.append(batch)
    return found


def _train_side_by_side(
    name, dropout, optimizer, weighted=False, jit_compile="auto", **kwargs
):
    """Trains `keras.Model` and the whole-batch `AccumModel` on the same
    batches, comparing the weights after every update; returns both, each
    update's largest weight difference and the losses each logged."""
    plain = _build(name, keras.Model, dropout, optimizer, jit_compile)
    accum = _build(
        name,
        keras_accum.AccumModel,
        dropout,
        optimizer,
        jit_compile,
        whole_batch_loss=True,
        **kwargs,
    )
    diffs, losses = [], []
    initial = plain.get_weights()
    batches = _batches(name, weighted)
    for n, batch in enumerate(batches, start=1):
        plain_loss = plain.train_on_batch(*batch)
        accum_loss = accum.train_on_batch(*batch)
        # Where the float32 runs differ beyond the tolerance (a CPU's
        # rounding), the float64 run decides, as the suite's rule says;
        # with dropout the float64 masks would be other draws.
        exact = None
        if not dropout:
            exact = functools.partial(
                _float64_weights,
                name,
                optimizer,
                jit_compile,
                initial,
                batches[:n],
            )
        assert_equivalent(accum, plain.get_weights(), exact=exact)
        diffs.append(max_weight_diff(accum, plain))
        losses.append((float(accum_loss), float(plain_loss)))
    return accum, plain, diffs, losses


def _float64_weights(name, optimizer, jit_compile, initial, batches):
    """`keras.Model`'s weights at the batch, in float64, from `initial`
    and after `batches` (no dropout)."""
    with float64():
        model = _build(name, keras.Model, 0.0, optimizer, jit_compile)
        model.set_weights([w.astype("float64") for w in initial])
        for batch in batches:
            model.train_on_batch(*keras.tree.map_structure(_float64, batch))
        return model.get_weights()


def _float64(value):
    if isinstance(value, np.ndarray) and value.dtype == np.float32:
        return value.astype("float64")
    return value


# -- One piece: exactly `keras.Model`, dropout active -------------------------


# Each case and each optimizer once: the draws replayed do not depend on
# the optimizer, which applies the window's gradient as in every mode.
@pytest.mark.parametrize(
    "name, optimizer", [("clip", "momentum"), ("dual_encoder", "adam")]
)
def test_one_piece_with_dropout_equals_keras_model(name, optimizer):
    # The pieces' forward passes twice each, their draws replayed: with
    # one piece, the same masks as `keras.Model`'s single forward pass,
    # and the generators left where it leaves them (the next update
    # draws alike too).
    accum, plain, diffs, losses = _train_side_by_side(
        name, 0.3, optimizer, micro_batch_size=B
    )
    for accum_loss, plain_loss in losses:
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=1e-5)
    # The models trained: the comparison is not between two still models.
    assert max_weight_diff(plain, _build(name, keras.Model, 0.3)) > 1e-3


# -- Several pieces, an uneven last one ---------------------------------------


@pytest.mark.parametrize("name", sorted(CASES))
def test_pieces_without_dropout_equal_keras_model(name):
    # 8 rows in pieces of 3, 3 and 2: every loss sees the batch's 8
    # samples, where the split mode's pieces see 3 (test_in_batch_negatives).
    _, _, _, losses = _train_side_by_side(
        name, 0.0, "momentum", micro_batch_size=3
    )
    for accum_loss, plain_loss in losses:
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=1e-5)


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="XLA is TensorFlow's option (JAX's steps are always compiled)",
)
@pytest.mark.parametrize("name", ["clip", "dual_encoder"])
def test_pieces_under_xla_equal_keras_model(name):
    _, _, _, losses = _train_side_by_side(
        name, 0.0, "momentum", jit_compile=True, micro_batch_size=3
    )
    for accum_loss, plain_loss in losses:
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=1e-5)


@pytest.mark.parametrize("name", ["clip", "two_tower"])
def test_pieces_with_sample_weights_equal_keras_model(name):
    _train_side_by_side(name, 0.0, "adam", weighted=True, micro_batch_size=3)


def test_pieces_with_dropout_equal_the_one_pass_gradient():
    # With dropout and 3 pieces each piece draws from its own stream
    # (`_seeds`): the update is the one-pass gradient of the loss through
    # the same pieces' forward passes with those draws.
    bounds = [(0, 3), (3, 6), (6, 8)]
    reference = _build("clip", keras.Model, 0.3, "sgd")
    x, y = _batches("clip")[0]
    _, grads = one_pass(reference, x, y, None, bounds)
    before = reference.get_weights()
    expected = [w - 0.3 * g for w, g in zip(before, grads, strict=True)]
    accum = _build(
        "clip",
        keras_accum.AccumModel,
        0.3,
        "sgd",
        micro_batch_size=3,
        whole_batch_loss=True,
    )
    accum.train_on_batch(x, y)
    assert_same_weights(accum, expected)
    # The draws matter: without them replayed, or with the batch's
    # masks, the update would be another.
    assert max_weight_diff(accum, before) > 1e-3


# -- Refused, loudly ----------------------------------------------------------


def test_batch_normalization_is_refused_naming_the_layer():
    inputs = keras.Input((4,))
    hidden = keras.layers.BatchNormalization(name="bn")(
        keras.layers.Dense(3)(inputs)
    )
    model = keras_accum.AccumModel(
        inputs, hidden, micro_batch_size=2, whole_batch_loss=True
    )
    model.compile(optimizer="sgd", loss="mse")
    x = np.ones((4, 4), "float32")
    with pytest.raises(ValueError, match=r"`bn` \(BatchNormalization\)"):
        model.fit(x, x[:, :3], batch_size=4, verbose=0)


def test_whole_batch_loss_must_be_a_bool():
    inputs = keras.Input((4,))
    with pytest.raises(TypeError, match="whole_batch_loss=1"):
        keras_accum.AccumModel(
            inputs, inputs, micro_batch_size=2, whole_batch_loss=1
        )


def test_the_setting_round_trips_through_the_config():
    model = _build(
        "supcon",
        keras_accum.AccumModel,
        0.0,
        micro_batch_size=3,
        whole_batch_loss=True,
    )
    copy = keras_accum.AccumModel.from_config(model.get_config())
    assert copy.whole_batch_loss is True
    assert copy.micro_batch_size == 3
    model.whole_batch_loss = False
    assert model.whole_batch_loss is False


def test_auto_sizes_round_trip_through_config_clone_and_saving(tmp_path):
    model = CASES["supcon"][0](
        keras_accum.AccumModel,
        dropout=0.0,
        micro_batch_size="auto",
        whole_batch_loss=True,
    )
    auto = keras_accum.AutoMicroBatch()
    path = tmp_path / "whole_auto.keras"
    model.save(path)
    for copy in (
        keras_accum.AccumModel.from_config(model.get_config()),
        keras.models.clone_model(model),
        keras.saving.load_model(path),
    ):
        assert copy.micro_batch_size == auto
        assert copy.whole_batch_loss is True


def _regularized(model_cls, activity=False, **kwargs):
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        5,
        activation="tanh",
        kernel_regularizer=keras.regularizers.L2(0.05),
        activity_regularizer=(
            keras.regularizers.L2(0.01) if activity else None
        ),
    )(inputs)
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(4)(hidden))
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(optimizer=_optimizer("momentum"), loss=CASES["supcon"][2])
    return model


def test_weight_regularization_is_counted_once_per_batch():
    plain = _regularized(keras.Model)
    accum = _regularized(
        keras_accum.AccumModel, micro_batch_size=3, whole_batch_loss=True
    )
    for x, y in _batches("supcon"):
        plain_loss = plain.train_on_batch(x, y)
        accum_loss = accum.train_on_batch(x, y)
        assert_same_weights(accum, plain.get_weights())
        # The logged loss carries the regularization, once.
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=1e-5)


def test_activity_regularization_is_refused():
    model = _regularized(
        keras_accum.AccumModel,
        activity=True,
        micro_batch_size=3,
        whole_batch_loss=True,
    )
    x, y = _batches("supcon")[0]
    with pytest.raises(NotImplementedError, match="activity_regularizer"):
        model.train_on_batch(x, y)


class _AddsLoss(keras.layers.Layer):
    """Adds a loss of its inputs in `call`: each piece's would be its own."""

    def call(self, x):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(x)))
        return x


def test_a_loss_added_from_the_data_is_refused():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((6,))
    hidden = _AddsLoss()(keras.layers.Dense(5, activation="tanh")(inputs))
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(4)(hidden))
    model = keras_accum.AccumModel(
        inputs, outputs, micro_batch_size=3, whole_batch_loss=True
    )
    model.compile(optimizer=_optimizer("momentum"), loss=CASES["supcon"][2])
    x, y = _batches("supcon")[0]
    with pytest.raises(NotImplementedError, match=r"`add_loss` in `call`: 1"):
        model.train_on_batch(x, y)


# -- Loss scaling -------------------------------------------------------------


@pytest.fixture
def mixed_float16():
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    yield
    keras.mixed_precision.set_dtype_policy("float32")


def _scaled_side_by_side(name, optimizer=None, jit_compile="auto"):
    """`_train_side_by_side` under loss scaling, float16's tolerance;
    `optimizer()` makes each model's."""
    models = []
    for model_cls, kwargs in (
        (keras.Model, {}),
        (
            keras_accum.AccumModel,
            {"micro_batch_size": 3, "whole_batch_loss": True},
        ),
    ):
        build, _, loss = CASES[name]
        model = build(model_cls, dropout=0.0, **kwargs)
        made = _optimizer("momentum") if optimizer is None else optimizer()
        model.compile(optimizer=made, loss=loss, jit_compile=jit_compile)
        models.append(model)
    plain, accum = models
    for batch in _batches(name):
        plain_loss = plain.train_on_batch(*batch)
        accum_loss = accum.train_on_batch(*batch)
        # float16 forward passes: the pieces' sums round otherwise than
        # the batch's (test_micro_batch's mixed-precision tolerance).
        assert_same_weights(accum, plain.get_weights(), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=2e-3)
    assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    # Updates applied or skipped (an overflow: TensorFlow's first siglip
    # batch at 2^15) as the batch's, the scale the batch's.
    applied = int(plain.optimizer.iterations)
    assert int(accum.optimizer.iterations) == applied > 0
    assert accum.skipped_windows == UPDATES - applied
    assert float(accum.optimizer.dynamic_scale.numpy()) == float(
        plain.optimizer.dynamic_scale.numpy()
    )
    return accum, plain


@pytest.mark.parametrize("name", ["siglip", "two_tower"])
def test_mixed_float16_with_loss_scaling_equals_keras_model(
    name, mixed_float16
):
    """Keras wraps the optimizer in a `LossScaleOptimizer`. Before: refused
    (and without the scale the window's gradients would be 2^15 times too
    small). The outputs are float16: their gradient is the scaled loss's."""
    accum, plain = _scaled_side_by_side(name)
    first = keras.tree.flatten(accum(_batches(name)[0][0]))[0]
    assert keras.backend.standardize_dtype(first.dtype) == "float16"
    assert max_weight_diff(plain, _build(name, keras.Model, 0.0)) > 1e-2


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="XLA is TensorFlow's option (JAX's steps are always compiled)",
)
def test_loss_scaling_under_xla_equals_keras_model(mixed_float16):
    _scaled_side_by_side("two_tower", jit_compile=True)


def test_an_explicit_loss_scale_optimizer_equals_keras_model(mixed_float16):
    # The temperature that `compute_loss` reads itself gets the scaled
    # loss's gradient too. (At the default scale of 2^15 this batch's
    # float16 kernel gradient, a sum over its 8 rows, overflows where
    # the pieces' sums over 3 do not: the robustness guide's known
    # difference, the same for every mode.)
    def optimizer():
        return keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.3, momentum=0.9), initial_scale=2.0**12
        )

    accum, _ = _scaled_side_by_side("dual_encoder", optimizer)
    assert accum.optimizer.dynamic_scale.numpy() == 2.0**12


def test_regularization_under_loss_scaling_equals_keras_model(mixed_float16):
    # The model's own losses are scaled with the rest on the last piece;
    # the logged loss is unscaled.
    plain = _regularized(keras.Model)
    accum = _regularized(
        keras_accum.AccumModel, micro_batch_size=3, whole_batch_loss=True
    )
    for x, y in _batches("supcon"):
        plain_loss = plain.train_on_batch(x, y)
        accum_loss = accum.train_on_batch(x, y)
        assert_same_weights(accum, plain.get_weights(), atol=2e-3, rtol=2e-3)
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=2e-3)


@pytest.mark.parametrize(
    "optimizer",
    [
        lambda: keras.optimizers.LossScaleOptimizer(
            keras.optimizers.SGD(0.3, momentum=0.9)
        ),
        lambda: keras.optimizers.SGD(0.3, momentum=0.9, loss_scale_factor=64.0),
    ],
    ids=["loss_scale_optimizer", "loss_scale_factor"],
)
def test_a_scaling_optimizer_in_float32_equals_keras_model(optimizer):
    """Before: a `loss_scale_factor` optimizer divided unscaled gradients
    by its factor (updates 64 times too small), silently."""
    models = {}
    for key, model_cls, kwargs in (
        ("plain", keras.Model, {}),
        (
            "accum",
            keras_accum.AccumModel,
            {"micro_batch_size": 3, "whole_batch_loss": True},
        ),
    ):
        model = CASES["dual_encoder"][0](model_cls, dropout=0.0, **kwargs)
        model.compile(optimizer=optimizer())
        models[key] = model
    for batch in _batches("dual_encoder"):
        plain_loss = models["plain"].train_on_batch(*batch)
        accum_loss = models["accum"].train_on_batch(*batch)
        assert_same_weights(models["accum"], models["plain"].get_weights())
        np.testing.assert_allclose(accum_loss, plain_loss, rtol=1e-5)


@pytest.mark.parametrize("log2_scale", [16, 18])
def test_loss_scale_overflows_where_the_batch_does(mixed_float16, log2_scale):
    # At 2^16 the batch applies its update; at 2^18 its scaled gradient
    # overflows: the update is skipped and the scale halves, as Keras's
    # `LossScaleOptimizer` does for the batch.
    runs = {}
    for name, cls, kwargs in (
        ("plain", keras.Model, {}),
        (
            "accum",
            keras_accum.AccumModel,
            {"micro_batch_size": 8, "whole_batch_loss": True},
        ),
    ):
        model, x, y = overflow_prone(cls, **kwargs)
        model.compile(
            optimizer=keras.optimizers.LossScaleOptimizer(
                keras.optimizers.SGD(0.01),
                initial_scale=2.0**log2_scale,
                dynamic_growth_steps=1000,
            ),
            loss="mse",
        )
        model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
        runs[name] = model
    plain, accum = runs["plain"], runs["accum"]
    applied = int(plain.optimizer.iterations)
    assert applied == (1 if log2_scale == 16 else 0)
    assert int(accum.optimizer.iterations) == applied
    assert float(accum.optimizer.dynamic_scale.numpy()) == float(
        plain.optimizer.dynamic_scale.numpy()
    )
    assert accum.skipped_windows == 1 - applied
    assert_same_weights(plain, accum, atol=1e-3)


@pytest.mark.parametrize("name", ["clip", "two_tower", "regularized"])
def test_evaluate_computes_the_loss_on_the_whole_batch(name):
    if name == "regularized":
        plain = _regularized(keras.Model)
        accum = _regularized(
            keras_accum.AccumModel, micro_batch_size=3, whole_batch_loss=True
        )
        x, y = CASES["supcon"][1](B * UPDATES)
    else:
        plain = _build(name, keras.Model, 0.1)
        accum = _build(
            name,
            keras_accum.AccumModel,
            0.1,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
        x, y = CASES[name][1](B * UPDATES)
    expected = plain.evaluate(x, y, batch_size=B, verbose=0)
    found = accum.evaluate(x, y, batch_size=B, verbose=0)
    np.testing.assert_allclose(found, expected, rtol=1e-5)
    # The split mode's pieces would see 3 samples each: another loss.
    accum.whole_batch_loss = False
    split = accum.evaluate(x, y, batch_size=B, verbose=0)
    assert abs(split - expected) > 1e-3 * abs(expected)


def _unseeded(model_cls, **kwargs):
    # A `Dropout` without a seed: on PyTorch it draws from torch's global
    # generator, which no Keras `SeedGenerator` holds (`_seeds`).
    keras.utils.set_random_seed(5)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    hidden = keras.layers.Dropout(0.3)(hidden)
    outputs = keras.layers.UnitNormalization()(keras.layers.Dense(4)(hidden))
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(optimizer=_optimizer("sgd"), loss=CASES["supcon"][2])
    return model


def test_one_piece_with_unseeded_dropout_equals_keras_model():
    plain = _unseeded(keras.Model)
    accum = _unseeded(
        keras_accum.AccumModel, micro_batch_size=B, whole_batch_loss=True
    )
    for i, (x, y) in enumerate(_batches("supcon")):
        # The same global state before each model's step.
        keras.utils.set_random_seed(100 + i)
        plain.train_on_batch(x, y)
        keras.utils.set_random_seed(100 + i)
        accum.train_on_batch(x, y)
        assert_same_weights(accum, plain.get_weights())


@pytest.mark.skipif(
    keras.backend.backend() != "torch",
    reason="torch's global generator is PyTorch's (elsewhere a Keras "
    "SeedGenerator draws, as test_pieces_with_dropout_equal_the_one_pass"
    "_gradient tests)",
)
def test_pieces_with_torch_global_draws_equal_the_one_pass_gradient():
    # Pass 1 runs the last piece first (its outputs give the loop's their
    # structure), then the others in order; pass 2 enters each piece at
    # the global state pass 1 entered it at. The reference draws in pass
    # 1's order, and its loss (a mean over anchors, each against the
    # whole batch) does not depend on the rows' order.
    bounds = [(6, 8), (0, 3), (3, 6)]
    order = np.concatenate([np.arange(a, b) for a, b in bounds])
    x, y = _batches("supcon")[0]
    reference = _unseeded(keras.Model)
    keras.utils.set_random_seed(7)
    _, grads = one_pass(
        reference, x[order], y[order], None, [(0, 2), (2, 5), (5, 8)]
    )
    expected = [
        w - 0.3 * g for w, g in zip(reference.get_weights(), grads, strict=True)
    ]
    accum = _unseeded(
        keras_accum.AccumModel, micro_batch_size=3, whole_batch_loss=True
    )
    keras.utils.set_random_seed(7)
    accum.train_on_batch(x, y)
    assert_same_weights(accum, expected)


class _GraphProbe(keras.layers.Layer):
    """Scales its inputs by a weight, and records at each call whether its
    outputs carry an autograd graph (PyTorch's `grad_fn`)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.graphs = []

    def build(self, input_shape):
        self.scale = self.add_weight(
            shape=(input_shape[-1],), initializer="ones"
        )

    def call(self, inputs):
        outputs = inputs * self.scale
        self.graphs.append(outputs.grad_fn is not None)
        return outputs


@pytest.mark.skipif(
    BACKEND != "torch",
    reason="an autograd graph recorded outside a gradient call is "
    "PyTorch's: TensorFlow records on a tape, JAX traces a function",
)
def test_pass_one_records_no_graph_and_each_piece_runs_twice():
    # Pass 1 only needs the outputs: a graph recorded there would hold
    # every piece's activations until the loss (the memory the pieces
    # save) and cost its bookkeeping. Pass 2 needs one per piece.
    inputs = keras.Input((6,))
    probe = _GraphProbe()
    hidden = probe(keras.layers.Dense(4)(inputs))
    outputs = keras.layers.UnitNormalization()(hidden)
    model = keras_accum.AccumModel(
        inputs, outputs, micro_batch_size=3, whole_batch_loss=True
    )
    model.compile(optimizer=_optimizer("sgd"), loss=CASES["supcon"][2])
    x, y = _batches("supcon")[0]
    # The first call runs Keras's symbolic build, a forward pass of its
    # own, before the step.
    model.train_on_batch(x, y)
    probe.graphs.clear()
    model.train_on_batch(x, y)
    # 8 rows in pieces of 3: each of the 3 pieces once in pass 1, without
    # a graph, then once in pass 2, with one; no forward pass more.
    assert list(probe.graphs) == [False] * 3 + [True] * 3


def test_the_noise_scale_is_refused():
    model = _build(
        "supcon",
        keras_accum.AccumModel,
        0.0,
        micro_batch_size=3,
        whole_batch_loss=True,
    )
    x, y = _batches("supcon")[0]
    logger = keras_accum.PseudoBatchLogger(noise_scale=True)
    with pytest.raises(NotImplementedError, match="noise scale"):
        model.fit(x, y, batch_size=B, callbacks=[logger], verbose=0)


# -- "auto" sizes: the search measures the whole-batch step -------------------
#
# Wide outputs (8192 floats a sample, normalized embeddings for a SupCon
# loss) behind wider activations (64K floats a sample): the whole-batch
# step holds the batch's outputs and their gradient (and the loss's
# temporaries over them) while each piece runs, which the split step's
# pieces do not.

B_AUTO = 32


def _wide_outputs(model_cls, **kwargs):
    keras.utils.set_random_seed(0)
    inputs = keras.Input((64,))
    hidden = keras.layers.Dense(128, activation="relu")(inputs)
    hidden = keras.layers.Reshape((1, 128))(hidden)
    hidden = keras.layers.UpSampling1D(512)(hidden)
    hidden = keras.layers.Flatten()(keras.layers.Dense(16)(hidden))
    outputs = keras.layers.UnitNormalization()(hidden)
    model = model_cls(inputs, outputs, **kwargs)
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=supcon_loss)
    return model


def _probing(model, data):
    """The library's `measure(size)` of the model's train step on `data`:
    JAX's compiled figures, TensorFlow's allocator figures of a probe step
    (`BatchOps.probing`), the model's variables restored after."""
    ops = model._batch_ops_class(model)
    state = ()
    if BACKEND == "jax":
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
    return ops.probing("train", data, state)


@pytest.mark.skipif(
    BACKEND == "torch",
    reason="PyTorch on a CPU has no allocator figures: 'auto' is refused "
    "there (test_auto_micro_batch)",
)
def test_auto_counts_the_cached_outputs_and_trains_as_keras_model():
    rng = np.random.default_rng(0)
    x = rng.random((2 * B_AUTO, 64), dtype=np.float32)
    y = rng.integers(0, 4, 2 * B_AUTO).astype("float32")
    batches = [(x[:B_AUTO], y[:B_AUTO]), (x[B_AUTO:], y[B_AUTO:])]
    plain = _wide_outputs(keras.Model)
    model = _wide_outputs(
        keras_accum.AccumModel, micro_batch_size=8, whole_batch_loss=True
    )
    common = {"batch_size": B_AUTO, "shuffle": False, "verbose": 0}
    # The limit: the whole-batch step's peak at 8, measured.
    model.fit(*batches[0], **common)
    with _probing(model, batches[1]) as measure:
        limit = measure(8)
    model.micro_batch_size = keras_accum.AutoMicroBatch(
        memory_limit=limit, margin=0.0
    )
    model.fit(*batches[1], **common)
    (whole,) = model.micro_batch_choices
    assert whole["step"] == "train" and whole["budget"] == limit
    assert whole["predicted_peak"] <= limit
    chosen = whole["micro_batch_size"]
    for batch in batches:
        plain.train_on_batch(*batch)
    assert_same_weights(model, plain.get_weights())
    # The split step's pieces hold no batch's outputs: under the same
    # limit it takes larger pieces (a piece one larger fits, measured on
    # the same figures).
    assert chosen < B_AUTO
    model.whole_batch_loss = False
    with _probing(model, batches[1]) as measure:
        assert measure(chosen + 1) <= limit
