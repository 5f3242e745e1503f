"""Runs `whole_batch_loss=True` under `tf.distribute.MirroredStrategy` on
2 logical CPUs; prints `RESULTS {...}` (one JSON line).

Started in a fresh process by `test_whole_batch_devices.py`: logical
devices must be set up before TensorFlow starts.

    python _whole_batch_devices_worker.py

Each case trains an `AccumModel(micro_batch_size=3, whole_batch_loss=True)`
under the strategy and a plain `keras.Model` on one device (no strategy)
on the same batches of 8, the last one 5 (the replicas hold 3 and 2
rows), asserting their weights equal after every update
(`_helpers.assert_same_weights`) and their logged losses, then their
`evaluate`. The refusal of `MultiWorkerMirroredStrategy` is checked too.
"""

import json
import os
import sys
import traceback

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
STRATEGY = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])

import keras  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contrastive import (  # noqa: E402
    CASES,
    DualEncoder,
    _cross_entropy_rows,
    _subclass,
)
from _helpers import assert_same_weights, max_weight_diff  # noqa: E402

import keras_accum  # noqa: E402

SIZES = (8, 8, 5)  # The last batch uneven: 3 and 2 rows on the replicas.


class ReplicaDualEncoder(DualEncoder):
    """`_contrastive.DualEncoder` (its temperature a weight only the loss
    reads) with the loss written as `tf.distribute` asks of a loss of
    one's own: `tf.nn.compute_average_loss` divides by the replica count,
    as Keras's losses do."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        scale = keras.ops.exp(self.logit_scale)
        logits = scale * keras.ops.matmul(
            y_pred["image"], keras.ops.transpose(y_pred["text"])
        )
        per_pair = 0.5 * (
            _cross_entropy_rows(logits)
            + _cross_entropy_rows(keras.ops.transpose(logits))
        )
        loss = tf.nn.compute_average_loss(per_pair)
        if self.losses:
            loss = loss + tf.nn.scale_regularization_loss(
                tf.add_n(self.losses)
            )
        return loss


def regularized(model_cls=keras.Model, dropout=0.0, **kwargs):
    """`supcon_model`'s tower with L2-regularized kernels."""
    keras.utils.set_random_seed(1)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.05)
    )(inputs)
    outputs = keras.layers.UnitNormalization()(
        keras.layers.Dense(4, kernel_regularizer=keras.regularizers.L2(0.05))(
            hidden
        )
    )
    return model_cls(inputs, outputs, **kwargs)


def build(name, model_cls, **kwargs):
    if name == "clip":
        model = CASES["clip"][0](model_cls, dropout=0.0, **kwargs)
        loss = CASES["clip"][2]
    elif name == "dual_encoder":
        keras.utils.set_random_seed(1)
        model = _subclass(ReplicaDualEncoder, model_cls)(dropout=0.0, **kwargs)
        model(batches(name)[2][0][0])
        loss = None
    else:
        model = regularized(model_cls, **kwargs)
        loss = CASES["supcon"][2]
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=loss)
    return model


def batches(name):
    data = CASES["supcon" if name == "regularized" else "clip"][1]
    x, y = data(sum(SIZES))
    found, start = [], 0
    for size in SIZES:
        rows = slice(start, start + size)
        found.append(
            (keras.tree.map_structure(lambda t, r=rows: t[r], x), y[rows])
        )
        start += size
    return x, y, found


def fit_once(model, batch):
    """One update on `batch`; its logged loss."""
    x, y = batch
    size = len(y)
    history = model.fit(x, y, batch_size=size, epochs=1, verbose=0)
    return history.history["loss"][0]


def case(name):
    plain = build(name, keras.Model)
    with STRATEGY.scope():
        accum = build(
            name,
            keras_accum.AccumModel,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
    accum.set_weights(plain.get_weights())
    start = plain.get_weights()
    x, y, found = batches(name)
    diffs, losses = [], []
    for batch in found:
        # One update each (`fit` distributes the batch over the replicas;
        # `train_on_batch` would give each replica all of it).
        plain_loss = fit_once(plain, batch)
        accum_loss = fit_once(accum, batch)
        assert_same_weights(accum, plain.get_weights())
        diffs.append(max_weight_diff(accum, plain))
        losses.append([accum_loss, plain_loss])
    # Evaluated at batch 8 (the last one 5): the loss on the global batch.
    evaluated = [
        float(accum.evaluate(x, y, batch_size=8, verbose=0)),
        float(plain.evaluate(x, y, batch_size=8, verbose=0)),
    ]
    return {
        "case": name,
        "replicas": STRATEGY.num_replicas_in_sync,
        "max_weight_diff": max(diffs),
        "moved": max_weight_diff(plain, start),
        "losses": losses,
        "evaluated": evaluated,
    }


def multi_worker_refused():
    """MultiWorkerMirroredStrategy (one worker here, its two CPUs): refused,
    naming it."""
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    with strategy.scope():
        model = build(
            "clip",
            keras_accum.AccumModel,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
    _, _, found = batches("clip")
    try:
        fit_once(model, found[0])
    except NotImplementedError as error:
        return str(error)
    return f"trained on {strategy.num_replicas_in_sync} replicas"


def main():
    results = {"cases": []}
    for name in ("clip", "dual_encoder", "regularized"):
        try:
            results["cases"].append(case(name))
        except Exception:
            results["cases"].append(
                {"case": name, "traceback": traceback.format_exc()}
            )
    try:
        results["multi_worker"] = multi_worker_refused()
    except Exception:
        results["multi_worker"] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
