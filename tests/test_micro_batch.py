"""`micro_batch_size`: each batch `fit` is given is one update, split
inside the step; equal to `keras.Model` trained at that batch."""

import os
from pathlib import Path

import keras
import numpy as np
import pytest
from _helpers import (
    KillAt,
    Killed,
    LargeBatch,
    UpdateRecorder,
    assert_equivalent,
    batch_norm_data,
    batch_norm_model,
    build_optimizer,
    eager_batches,
    mlp,
    moving_statistics,
    regression_data,
    run_in_fresh_process,
)

import keras_accum

# 70 samples in batches of 32: two batches of 32 (4 micro-batches of 7
# and one of 4) and one of 6 (one micro-batch, shorter than 7).
B, M, N = 32, 7, 70


def _compiled(model, optimizer="adam", **kwargs):
    optimizer = {
        "adam": lambda: keras.optimizers.Adam(0.01),
        "sgd": lambda: keras.optimizers.SGD(0.1, momentum=0.9),
    }[optimizer]()
    model.compile(optimizer=optimizer, loss=kwargs.pop("loss", "mse"), **kwargs)
    build_optimizer(model)
    return model


def _fit_both(
    accum, plain, x, y, batch_size=B, epochs=2, skip_logs=(), **kwargs
):
    """Fits both at `batch_size`; asserts one update per batch, equal after
    each, and equal logs (but `skip_logs`). Returns the largest weight
    difference."""
    reference = LargeBatch(plain)
    recorder = UpdateRecorder()
    common = {"epochs": epochs, "shuffle": False, "verbose": 0, **kwargs}
    plain_history = reference.fit(x, y, batch_size=batch_size, **common)
    accum_history = accum.fit(
        x, y, batch_size=batch_size, callbacks=[recorder], **common
    )
    batches = -(-len(keras.tree.flatten(x)[0]) // batch_size) * epochs
    assert int(accum.optimizer.iterations) == batches
    assert [i for i, _ in recorder.updates] == [
        i for i, _ in reference.updates.updates
    ]
    for index, (_, weights) in enumerate(recorder.updates):
        assert_equivalent(weights, reference, update=index)
    # The epoch logs: the loss and metrics `Model(B)` logs.
    assert set(accum_history.history) == set(plain_history.history)
    for key, values in accum_history.history.items():
        if key not in skip_logs:
            assert_equivalent(values, reference, key=key)
    return assert_equivalent(accum, reference)


@pytest.mark.parametrize(
    "micro_batch_size,batch_size",
    [(M, B), (8, B), (1, 5), (64, B)],
    ids=["uneven", "divides", "one_sample", "larger_than_batch"],
)
def test_a_split_batch_equals_the_large_batch(
    micro_batch_size, batch_size, report_diff
):
    x, y = regression_data(n=N)
    plain = _compiled(mlp(), metrics=["mae"])
    accum = _compiled(
        mlp(keras_accum.AccumModel, micro_batch_size=micro_batch_size),
        metrics=["mae"],
    )
    diff = _fit_both(accum, plain, x, y, batch_size=batch_size)
    report_diff(diff, f"micro_batch_size={micro_batch_size}, B={batch_size}")
    assert accum.mini_step == 0  # Every batch closed its window.


# The modes that run another step: without `jit_compile` JAX runs the
# step unjitted, as `run_eagerly` does, and PyTorch eagerly, as
# `run_eagerly` does; PyTorch runs one step per execution.
COMPILE_MODES = {
    "tensorflow": ["jit", "no_jit", "eager", "spe"],
    "jax": ["jit", "eager", "spe"],
    "torch": ["jit", "no_jit"],
}[keras.backend.backend()]


@pytest.mark.parametrize("mode", COMPILE_MODES)
def test_every_compile_mode(mode, report_diff):
    kwargs = {
        "jit": {"jit_compile": True},
        "no_jit": {"jit_compile": False},
        "eager": {"run_eagerly": True},
        "spe": {"steps_per_execution": 2},
    }[mode]
    # `torch.compile` compiles again for each new batch shape (minutes
    # on a CPU): one epoch of two batches of 32, its pieces 7, 7, 7, 7, 4.
    torch_compile = mode == "jit" and keras.backend.backend() == "torch"
    n, epochs = (64, 1) if torch_compile else (N, 2)
    x, y = regression_data(n=n)
    # The reference of the `torch.compile` case trains eagerly, sparing
    # its compile: the compiled split step is held to PyTorch's own ops.
    plain = _compiled(mlp(), **({} if torch_compile else kwargs))
    accum = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M), **kwargs)
    diff = _fit_both(accum, plain, x, y, epochs=epochs)
    report_diff(diff, f"micro_batch_size, {mode}")


def test_a_dataset_of_batches_splits_each_one(report_diff):
    x, y = regression_data(n=N)
    rng = np.random.default_rng(3)
    weights = rng.uniform(0.1, 2.0, size=N).astype("float32")
    plain = LargeBatch(_compiled(mlp(), metrics=["mae"]))
    accum = _compiled(
        mlp(keras_accum.AccumModel, micro_batch_size=M), metrics=["mae"]
    )
    # A `tf.data` pipeline (whose batches have no static size in the
    # traced step) where TensorFlow runs; arrays elsewhere.
    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        data = tf.data.Dataset.from_tensor_slices((x, y, weights)).batch(B)
        plain.fit(data, epochs=2, verbose=0)
        history = accum.fit(data, epochs=2, verbose=0)
    else:
        common = {"batch_size": B, "epochs": 2, "shuffle": False}
        plain.fit(x, y, sample_weight=weights, verbose=0, **common)
        history = accum.fit(x, y, sample_weight=weights, verbose=0, **common)
    assert int(accum.optimizer.iterations) == 6
    assert_equivalent(history.history["loss"], plain, key="loss")
    report_diff(assert_equivalent(accum, plain), "micro_batch_size, weighted")


@pytest.mark.skipif(
    keras.backend.backend() != "tensorflow",
    reason="the other backends' Keras functions take their batches in "
    "Python, classic mode included",
)
@pytest.mark.parametrize("steps_per_execution", [3])
def test_a_tf_data_pipeline_s_batches_stay_in_the_graph(steps_per_execution):
    """The split train function takes its batches out of the iterator
    inside the graph, as `keras.Model`'s does: none passes through Python
    (each once did, to be redone after an out-of-memory error), and the
    training is `Model(B)`'s."""
    import tensorflow as tf

    x, y = regression_data(n=N)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
    kwargs = {"steps_per_execution": steps_per_execution}
    plain = LargeBatch(_compiled(mlp(), **kwargs))
    accum = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M), **kwargs)
    expected = eager_batches(plain, data)
    assert eager_batches(accum, data) == expected
    assert int(accum.optimizer.iterations) == 3
    assert_equivalent(accum, plain)


class _ShapeSeen(keras.layers.Layer):
    """Passes its input on; keeps the static shape of each it is given."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []

    def call(self, inputs):
        self.seen.append(tuple(inputs.shape))
        return inputs


@pytest.mark.parametrize(
    "whole_batch_loss", [False, True], ids=["split", "whole"]
)
def test_a_piece_keeps_the_batch_s_other_dimensions(whole_batch_loss):
    """The layers see each piece with the batch's static shape but its
    rows: on TensorFlow a piece cut at a tensor position had lost them
    all, and a Keras `Conv2D` given unknown channels runs apart, compiled
    by XLA, past oneDNN's fused kernels (the CNN's split step was 1.13x
    the classic mode's CPU time, 0.85x with the shape kept)."""
    seen = _ShapeSeen()
    inputs = keras.Input((6, 5, 2))
    x = keras.layers.Conv2D(3, 3, activation="relu")(seen(inputs))
    outputs = keras.layers.Dense(1)(keras.layers.Flatten()(x))
    model = keras_accum.AccumModel(
        inputs, outputs, micro_batch_size=4, whole_batch_loss=whole_batch_loss
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=False)
    x = np.random.default_rng(0).normal(size=(12, 6, 5, 2)).astype("float32")
    y = np.zeros((12, 1), "float32")
    model.fit(x, y, batch_size=10, epochs=1, verbose=0)
    model.evaluate(x, y, batch_size=10, verbose=0)
    model.predict(x, batch_size=10, verbose=0)
    assert seen.seen
    assert {shape[1:] for shape in seen.seen} == {(6, 5, 2)}


@pytest.mark.parametrize(
    "case", ["sample_weights", "masked", "multi_output", "regularized", "sgd"]
)
def test_what_the_loss_averages_over(case, report_diff):
    rng = np.random.default_rng(2)
    fit_kwargs = {}
    if case == "masked":
        # All-zero timesteps are masked out: about a quarter of them.
        x = rng.normal(size=(N, 6, 2)).astype("float32")
        x[rng.random((N, 6)) < 0.25] = 0.0
        y = rng.normal(size=(N, 6, 3)).astype("float32")

        def build(cls, **kwargs):
            keras.utils.set_random_seed(1)
            inputs = keras.Input((6, 2))
            hidden = keras.layers.Masking(0.0)(inputs)
            outputs = keras.layers.Dense(3)(keras.layers.Dense(4)(hidden))
            return _compiled(cls(inputs, outputs, **kwargs))

    elif case == "multi_output":
        x, y = regression_data(n=N)
        y = {"reg": y, "cls": (y[:, :1] > 0).astype("float32")}

        def build(cls, **kwargs):
            keras.utils.set_random_seed(1)
            inputs = keras.Input((5,))
            hidden = keras.layers.Dense(8, activation="tanh")(inputs)
            reg = keras.layers.Dense(3, name="reg")(hidden)
            out = keras.layers.Dense(1, activation="sigmoid", name="cls")
            model = cls(inputs, {"reg": reg, "cls": out(hidden)}, **kwargs)
            return _compiled(
                model,
                loss={"reg": "mse", "cls": "binary_crossentropy"},
                loss_weights={"reg": 0.3, "cls": 2.0},
                metrics={"cls": ["accuracy"]},
            )

    else:
        x, y = regression_data(n=N)
        layer_kwargs = {}
        if case == "regularized":
            layer_kwargs = {"kernel_regularizer": keras.regularizers.L2(0.1)}
        if case == "sample_weights":
            fit_kwargs["sample_weight"] = rng.uniform(0.0, 2.0, N).astype(
                "float32"
            )
        optimizer = "sgd" if case == "sgd" else "adam"

        def build(cls, **kwargs):
            return _compiled(
                mlp(cls, layer_kwargs=layer_kwargs, **kwargs), optimizer
            )

    if case == "multi_output" and keras.backend.backend() == "tensorflow":
        # Keras's TensorFlow step weights each output's logged loss per
        # step where the batch has no static size (an equal weight per
        # batch, and so per micro-batch here): documented in the guide.
        fit_kwargs["skip_logs"] = ("reg_loss", "cls_loss")
    plain = build(keras.Model)
    accum = build(keras_accum.AccumModel, micro_batch_size=M)
    report_diff(
        _fit_both(accum, plain, x, y, **fit_kwargs), f"micro_batch_size, {case}"
    )


def test_mixed_precision_with_loss_scaling(report_diff):
    x, y = regression_data(n=N)
    policy = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_float16")
    try:
        plain = _compiled(mlp())
        accum = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M))
    finally:
        keras.config.set_dtype_policy(policy)
    assert isinstance(accum.optimizer, keras.optimizers.LossScaleOptimizer)
    common = {"epochs": 2, "shuffle": False, "verbose": 0}
    plain.fit(x, y, batch_size=B, **common)
    accum.fit(x, y, batch_size=B, **common)
    assert int(accum.optimizer.iterations) == int(plain.optimizer.iterations)
    # float16 forward passes: the micro-batches' sums round otherwise than
    # the large batch's, within float16's resolution.
    diff = assert_equivalent(accum, plain.get_weights(), atol=2e-3, rtol=2e-3)
    report_diff(diff, "micro_batch_size, mixed_float16")


def test_batch_normalization_moving_statistics_follow_the_batch(report_diff):
    shape = (4,)
    x, y = batch_norm_data(shape)
    plain = batch_norm_model(
        keras.Model, keras.layers.BatchNormalization, shape
    )
    accum = batch_norm_model(
        keras_accum.AccumModel,
        keras_accum.AccumBatchNormalization,
        shape,
        micro_batch_size=M,
    )
    for mine, theirs in zip(
        accum.trainable_weights, plain.trainable_weights, strict=True
    ):
        mine.assign(theirs.numpy())
    common = {"epochs": 2, "shuffle": False, "verbose": 0}
    plain.fit(x, y, batch_size=B, **common)
    accum.fit(x, y, batch_size=B, **common)
    # The first layer normalizes the inputs: its moving statistics are the
    # large batch's (pooled over the batch's micro-batches).
    diff = assert_equivalent(
        moving_statistics(accum)[0], moving_statistics(plain)[0]
    )
    report_diff(diff, "micro_batch_size, AccumBatchNormalization")


# -- The setting --------------------------------------------------------------


@pytest.mark.parametrize(
    "value,error,match",
    [
        (0, ValueError, r"Received: micro_batch_size=0"),
        (-3, ValueError, r"Received: micro_batch_size=-3"),
        (2**31, ValueError, r"from 1 to 2147483647"),
        (2.0, TypeError, r"Received: micro_batch_size=2.0 \(of type float\)"),
        (True, TypeError, r"Received: micro_batch_size=True"),
        ("big", TypeError, r"Received: micro_batch_size='big'"),
    ],
)
def test_bad_sizes_are_refused_naming_the_value(value, error, match):
    with pytest.raises(error, match=match):
        mlp(keras_accum.AccumModel, micro_batch_size=value)
    model = mlp(keras_accum.AccumModel)
    with pytest.raises(error, match=match):
        model.micro_batch_size = value


@pytest.mark.parametrize("accum_steps", [4, "auto", {0: 2}])
def test_a_size_beside_accum_steps_is_refused_naming_both(accum_steps):
    match = r"`micro_batch_size` and `accum_steps` cannot both be set.*"
    with pytest.raises(ValueError, match=match + "micro_batch_size=8"):
        mlp(keras_accum.AccumModel, accum_steps=accum_steps, micro_batch_size=8)
    model = mlp(keras_accum.AccumModel, micro_batch_size=8)
    with pytest.raises(ValueError, match=match):
        model.accum_steps = accum_steps
    assert model.accum_steps == 1 and model.micro_batch_size == 8


def test_the_size_travels_with_configs_clones_and_files(tmp_path):
    model = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M))
    x, y = regression_data(n=N)
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert model.get_config()["micro_batch_size"] == M
    assert keras.models.clone_model(model).micro_batch_size == M
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert loaded.micro_batch_size == M
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), model.predict(x, verbose=0), atol=1e-6
    )
    converted = keras_accum.AccumModel.from_model(
        mlp(), accum_steps=1, micro_batch_size=M
    )
    assert converted.micro_batch_size == M
    # Unset, the classic mode: each batch a micro-batch; `evaluate` and
    # `predict` are traced again, unsplit.
    before = model.evaluate(x, y, batch_size=B, verbose=0)
    model.micro_batch_size = None
    assert model.test_function is None and model.predict_function is None
    assert model.evaluate(x, y, batch_size=B, verbose=0) == pytest.approx(
        before, rel=1e-5
    )
    model.fit(x, y, batch_size=B, epochs=1, verbose=0)
    assert model.get_config()["micro_batch_size"] is None


@pytest.fixture(scope="module")
def mirrored():
    """Every `MirroredStrategy` case of `_micro_batch_worker.py`, run in
    one fresh process (two logical CPUs, set before TensorFlow starts);
    each test reads its case."""
    worker = Path(__file__).with_name("_micro_batch_worker.py")
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(worker.parent), *filter(None, [env.get("PYTHONPATH")])]
    )
    results = run_in_fresh_process([worker], env)
    assert results["replicas"] == 2
    return results


def _case(results, name):
    found = results[name]
    assert "traceback" not in found, found["traceback"]
    return found


@pytest.mark.tensorflow_only(reason="tf.distribute")
def test_mirrored_strategy_splits_each_replicas_part(mirrored, report_diff):
    # Each replica splits its part of the global batch; the window's close
    # (its one exchange) runs after the loop, on the last micro-batch.
    results = _case(mirrored, "split")
    assert results["updates"] == results["plain_updates"] == 6
    assert set(results["logs"]) == {"loss", "mae"}
    assert max(results["logs"].values()) < 1e-5, results["logs"]
    report_diff(results["diff"], "micro_batch_size, MirroredStrategy")


@pytest.mark.tensorflow_only(reason="tf.distribute")
def test_a_distributed_iterator_s_batches_stay_in_the_graph(
    mirrored, report_diff
):
    """Under `MirroredStrategy` the split train function takes each
    replica's part of its batches out of the distributed iterator inside
    the graph, three steps per execution: none passes through Python
    (each did, 3 in all), no more than `keras.Model`'s (1, its build's);
    and the training is `Model(B)`'s."""
    results = _case(mirrored, "graph")
    assert results["eager"] == 0
    assert results["plain_eager"] >= results["eager"]
    assert results["updates"] == 3
    report_diff(results["diff"], "micro_batch_size, MirroredStrategy, graph")


@pytest.mark.tensorflow_only(reason="tf.distribute")
def test_out_of_memory_under_a_strategy_loses_no_batch(mirrored, report_diff):
    """Under `MirroredStrategy`, three steps per execution, one replica's
    micro-batch of the second step runs out of memory in the graph (a
    real allocation refused): the kept batch is rebuilt on the replicas,
    undone and redone at half the size, and the third step runs after
    it: three updates, each `Model(16)`'s, no batch through Python."""
    results = _case(mirrored, "out_of_memory")
    assert results["eager"] == 0
    (shrink,) = results["shrinks"]
    assert "micro_batch_size=4" in shrink and "micro_batch_size=2" in shrink
    (choice,) = results["choices"]
    assert choice["reason"] == "out of memory"
    assert choice["micro_batch_size"] == 2
    assert results["updates"] == 3
    assert set(results["logs"]) == {"loss", "mae"}
    assert max(results["logs"].values()) < 1e-5, results["logs"]
    report_diff(results["diff"], "micro_batch_size, MirroredStrategy, OOM")


@pytest.mark.parametrize("reduction", ["sum_over_batch_size", "sum"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "weighted"])
def test_evaluate_and_predict_split_the_batch_too(reduction, weighted):
    # Masked timesteps, per-timestep weights, an L2 penalty: the evaluated
    # loss is the batch's (each micro-batch times what it averaged over;
    # summed losses count the penalty once).
    rng = np.random.default_rng(4)
    x = rng.normal(size=(N, 6, 2)).astype("float32")
    x[rng.random((N, 6)) < 0.25] = 0.0
    y = rng.normal(size=(N, 6, 3)).astype("float32")
    kwargs = {}
    if weighted:
        kwargs["sample_weight"] = rng.uniform(0, 2, (N, 6)).astype("float32")

    def build(cls, **model_kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((6, 2))
        hidden = keras.layers.Masking(0.0)(inputs)
        hidden = keras.layers.Dense(4, kernel_regularizer="l2")(hidden)
        model = cls(inputs, keras.layers.Dense(3)(hidden), **model_kwargs)
        loss = keras.losses.MeanSquaredError(reduction=reduction)
        model.compile(optimizer="adam", loss=loss, metrics=["mae"])
        return model

    plain = build(keras.Model)
    accum = build(keras_accum.AccumModel, micro_batch_size=M)
    expected = plain.evaluate(x, y, batch_size=B, verbose=0, **kwargs)
    found = accum.evaluate(x, y, batch_size=B, verbose=0, **kwargs)
    np.testing.assert_allclose(found, expected, rtol=1e-5)
    np.testing.assert_allclose(
        accum.predict(x, batch_size=B, verbose=0),
        plain.predict(x, batch_size=B, verbose=0),
        atol=1e-6,
    )


def test_validation_during_fit_is_the_large_batch_s(report_diff):
    x, y = regression_data(n=N)
    plain = LargeBatch(_compiled(mlp(), metrics=["mae"]))
    accum = _compiled(
        mlp(keras_accum.AccumModel, micro_batch_size=M), metrics=["mae"]
    )
    common = {"batch_size": B, "epochs": 2, "shuffle": False, "verbose": 0}
    data = {"validation_data": (x[:40], y[:40]), "validation_batch_size": 16}
    plain.fit(x, y, **common, **data)
    history = accum.fit(x, y, **common, **data)
    for key in ("val_loss", "val_mae"):
        assert_equivalent(history.history[key], plain, key=key)
    report_diff(assert_equivalent(accum, plain), "micro_batch_size, validation")


@pytest.mark.parametrize("save_freq", ["epoch", 1], ids=["epoch", "batch"])
def test_a_killed_run_resumes_as_the_uninterrupted_one(tmp_path, save_freq):
    # Every step closes its window: a backup between steps holds no open
    # window, at an epoch's end or after any batch.
    x, y = regression_data(n=N)

    def run(callbacks):
        model = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M))
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        return model

    def backup():
        return keras.callbacks.BackupAndRestore(
            str(tmp_path / "backup"), save_freq=save_freq
        )

    whole = run([])
    with pytest.raises(Killed):
        run([backup(), KillAt(1, 0 if save_freq == 1 else 2)])
    if save_freq == 1:
        # Keras restarts the epoch from its first batch: that batch is
        # trained twice, as for `keras.Model` (and warned about).
        with pytest.warns(UserWarning, match="trained twice"):
            resumed = run([backup()])
        assert int(resumed.optimizer.iterations) == 10
        return
    resumed = run([backup()])
    assert resumed.mini_step == 0
    assert int(resumed.optimizer.iterations) == 9
    for a, b in zip(whole.get_weights(), resumed.get_weights(), strict=True):
        np.testing.assert_array_equal(a, b)


# -- What a batch may hold ----------------------------------------------------


def test_no_sample_weight_in_every_entry_point():
    # `train_on_batch` and `test_on_batch` without weights, and batches of
    # `(x, y, None)` from a generator: the weight is None in the step.
    x, y = regression_data(n=N)
    plain = _compiled(mlp(), metrics=["mae"])
    accum = _compiled(
        mlp(keras_accum.AccumModel, micro_batch_size=M), metrics=["mae"]
    )
    for model in (plain, accum):
        model.train_on_batch(x[:B], y[:B])
    np.testing.assert_allclose(
        accum.test_on_batch(x[:B], y[:B]),
        plain.test_on_batch(x[:B], y[:B]),
        rtol=1e-5,
    )

    def batches():
        for start in range(B, N, B):
            yield x[start : start + B], y[start : start + B], None

    common = {"epochs": 1, "shuffle": False, "verbose": 0}
    expected = plain.fit(batches(), **common).history
    found = accum.fit(batches(), **common).history
    assert int(accum.optimizer.iterations) == 3
    for key in ("loss", "mae"):
        np.testing.assert_allclose(found[key], expected[key], rtol=1e-5)
    assert_equivalent(accum, plain.get_weights())


def test_the_logger_reports_each_batch_as_one_window():
    # Batches of 32 split into 5 micro-batches (4 of 7 and 1 of 4), the
    # epoch's last batch of 6 into 1: the epoch logs name the full batch.
    x, y = regression_data(n=N)
    model = _compiled(mlp(keras_accum.AccumModel, micro_batch_size=M))
    logger = keras_accum.PseudoBatchLogger()
    history = model.fit(
        x,
        y,
        batch_size=B,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[logger],
    )
    records = [(u.micro_batches, u.samples) for u in logger.updates]
    assert records == [(5, 32), (5, 32), (1, 6)] * 2
    assert history.history["pseudo_batch_window_length"] == [5, 5]
    assert history.history["pseudo_batch_size"] == [32, 32]


@pytest.mark.skipif(
    keras.backend.backend() == "torch",
    reason="Keras takes no sparse inputs on PyTorch",
)
def test_sparse_inputs_split_by_rows(report_diff):
    # `tf.SparseTensor` batches on TensorFlow, `BCOO` on JAX (Keras's
    # conversion of a SciPy matrix).
    import scipy.sparse

    rng = np.random.default_rng(6)
    # Two stored values a row: every batch of 32 holds as many (one shape
    # for JAX to compile).
    dense = rng.normal(size=(N, 5)).astype("float32")
    dense[rng.random((N, 5)).argsort(axis=1) >= 2] = 0.0
    x = scipy.sparse.csr_matrix(dense)
    y = rng.normal(size=(N, 3)).astype("float32")

    def build(cls, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((5,), sparse=True)
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        return _compiled(cls(inputs, keras.layers.Dense(3)(hidden), **kwargs))

    _split_against_plain(build, x, y, report_diff, "sparse")


@pytest.mark.tensorflow_only(reason="tf.RaggedTensor")
def test_ragged_inputs_split_by_rows(report_diff):
    import tensorflow as tf

    rng = np.random.default_rng(7)
    rows = [rng.normal(size=n).tolist() for n in rng.integers(1, 6, N)]
    x = tf.ragged.constant(rows, dtype=tf.float32)
    y = rng.normal(size=(N, 3)).astype("float32")

    class RowSummary(keras.layers.Layer):
        def call(self, x):
            lengths = tf.cast(x.row_lengths(), "float32")
            return tf.stack([tf.reduce_mean(x, axis=1), lengths], axis=1)

        def compute_output_shape(self, input_shape):
            return (input_shape[0], 2)

    def build(cls, **kwargs):
        keras.utils.set_random_seed(1)
        inputs = keras.Input((None,), ragged=True)
        hidden = keras.layers.Dense(8, activation="tanh")(RowSummary()(inputs))
        return _compiled(cls(inputs, keras.layers.Dense(3)(hidden), **kwargs))

    _split_against_plain(build, x, y, report_diff, "ragged")


def _split_against_plain(build, x, y, report_diff, label):
    """`fit`, `evaluate` and `predict` at `micro_batch_size=M` against
    `Model(B)`'s, on inputs `build`'s models take."""
    plain = LargeBatch(build(keras.Model))
    accum = build(keras_accum.AccumModel, micro_batch_size=M)
    common = {"batch_size": B, "shuffle": False, "verbose": 0}
    plain.fit(x, y, **common)
    found = accum.fit(x, y, **common).history
    assert int(accum.optimizer.iterations) == 3
    assert_equivalent(found["loss"], plain, key="loss")
    report_diff(assert_equivalent(accum, plain), f"micro_batch_size, {label}")
    model = plain.model
    np.testing.assert_allclose(
        accum.evaluate(x, y, batch_size=B, verbose=0),
        model.evaluate(x, y, batch_size=B, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        accum.predict(x, batch_size=B, verbose=0),
        model.predict(x, batch_size=B, verbose=0),
        atol=1e-6,
    )


def _batch_mean_error(y_true, y_pred):
    # One value per batch.
    return keras.ops.mean(keras.ops.abs(y_true - y_pred))


def _sample_mean_error(y_true, y_pred):
    # One value per sample: the same mean, over the samples, once Keras's
    # `Mean` adds them up.
    return keras.ops.mean(keras.ops.abs(y_true - y_pred), axis=-1)


def test_a_metric_of_one_value_per_batch_is_warned_of():
    x, y = regression_data(n=N)
    metrics = [_batch_mean_error, _sample_mean_error]
    plain = _compiled(mlp(), metrics=metrics)
    accum = _compiled(
        mlp(keras_accum.AccumModel, micro_batch_size=M), metrics=metrics
    )
    common = {"batch_size": B, "verbose": 0}
    data = {"validation_data": (x[:40], y[:40]), "shuffle": False}
    expected = plain.fit(x, y, epochs=2, **common, **data).history
    with pytest.warns(UserWarning) as caught:
        found = accum.fit(x, y, epochs=2, **common, **data).history
        evaluated = accum.evaluate(x, y, return_dict=True, **common)
    messages = [str(w.message) for w in caught if "per batch" in str(w)]
    # Once, naming the metric and the setting; the per-sample one exact.
    assert len(messages) == 1, messages
    assert "`_batch_mean_error`" in messages[0]
    assert "micro_batch_size=7" in messages[0]
    for key in ("_sample_mean_error", "val__sample_mean_error", "loss"):
        np.testing.assert_allclose(found[key], expected[key], rtol=1e-5)
    np.testing.assert_allclose(
        evaluated["_sample_mean_error"],
        plain.evaluate(x, y, return_dict=True, **common)["_sample_mean_error"],
        rtol=1e-5,
    )
    # What the warning says: the per-batch one is not the batch's.
    key = "_batch_mean_error"
    assert abs(found[key][0] - expected[key][0]) > 1e-4
