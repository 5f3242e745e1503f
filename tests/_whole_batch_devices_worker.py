"""Runs `whole_batch_loss=True` under `tf.distribute.MirroredStrategy` on
2 logical CPUs; prints `RESULTS {...}` (one JSON line).

Started in a fresh process by `test_whole_batch_devices.py`: logical
devices must be set up before TensorFlow starts.

    python _whole_batch_devices_worker.py

Each case (a CLIP model whose temperature is an output's, SGD with
momentum; a dual encoder whose temperature only the loss reads, with
weight regularization, Adam) trains
an `AccumModel(micro_batch_size=3, whole_batch_loss=True)`
under the strategy and a plain `keras.Model` on one device (no strategy)
on the same batches of 8 (the dual encoder's last one 5: the replicas
hold 3 and 2 rows), asserting their weights equal after every update
(`_helpers.assert_same_weights`) and their logs (the loss; for CLIP a
metric that reads the whole batch), then their `evaluate`. The refusal
of another strategy is checked too.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _contrastive import (  # noqa: E402
    CASES,
    DualEncoder,
    _cross_entropy_rows,
    compiled_case,
)
from _helpers import (  # noqa: E402
    assert_same_weights,
    fit_recording,
    max_weight_diff,
)

import keras_accum  # noqa: E402

# Batches of 8; the dual encoder's last uneven, 3 and 2 rows on the
# replicas (another shape: the step traced again, 4 s of CPU).
SIZES = {"clip": (8, 8, 8), "dual_encoder": (8, 8, 5)}


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
            loss = loss + tf.nn.scale_regularization_loss(tf.add_n(self.losses))
        return loss


def build(name, model_cls, **kwargs):
    # SGD with momentum for one, Adam for the other. (Adam's first step
    # takes a gradient's sign: on the CLIP model's data here a bias whose
    # gradient is near zero moved 1.8e-5 apart, float32 rounding of the
    # replicas' summed gradient amplified; SGD's updates agree to 1e-7.)
    if name == "clip":
        optimizer = keras.optimizers.SGD(0.3, momentum=0.9)
    else:
        optimizer = keras.optimizers.Adam(0.05)
    return compiled_case(
        name, model_cls, ReplicaDualEncoder, optimizer, **kwargs
    )


def data(name):
    """`(x, y)`: the case's batches (`SIZES`)."""
    return CASES["clip"][1](sum(SIZES[name]))


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
    x, y = data(name)
    plain_run = fit_recording(plain, x, y)
    accum_run = fit_recording(accum, x, y)
    assert len(accum_run.updates) == len(plain_run.updates) == len(SIZES[name])
    diffs = []
    for (_, found), (_, expected) in zip(
        accum_run.updates, plain_run.updates, strict=True
    ):
        assert_same_weights(found, expected)
        diffs.append(max_weight_diff(found, expected))
    logs = list(zip(accum_run.logs, plain_run.logs, strict=True))
    # Evaluated at batch 8: the loss on the global batch.
    evaluated = [
        accum.evaluate(x, y, batch_size=8, verbose=0, return_dict=True),
        plain.evaluate(x, y, batch_size=8, verbose=0, return_dict=True),
    ]
    return {
        "case": name,
        "replicas": STRATEGY.num_replicas_in_sync,
        "max_weight_diff": max(diffs),
        "moved": max_weight_diff(plain, start),
        "logs": logs,
        "evaluated": evaluated,
    }


def other_strategy_refused():
    """Another strategy of two replicas (`CentralStorageStrategy`, whose
    replicas share one copy of the variables): refused, naming it, as
    `MultiWorkerMirroredStrategy` is (it needs several processes)."""
    strategy = tf.distribute.experimental.CentralStorageStrategy(
        ["/cpu:0", "/cpu:1"]
    )
    with strategy.scope():
        model = build(
            "clip",
            keras_accum.AccumModel,
            micro_batch_size=3,
            whole_batch_loss=True,
        )
    try:
        fit_recording(model, *data("clip"))
    except NotImplementedError as error:
        return str(error)
    return f"trained on {strategy.num_replicas_in_sync} replicas"


def main():
    results = {"cases": []}
    for name in ("clip", "dual_encoder"):
        try:
            results["cases"].append(case(name))
        except Exception:  # noqa: BLE001 (reported to the test)
            results["cases"].append(
                {"case": name, "traceback": traceback.format_exc()}
            )
    try:
        results["other_strategy"] = other_strategy_refused()
    except Exception:  # noqa: BLE001 (reported to the test)
        results["other_strategy"] = traceback.format_exc()
    print("RESULTS " + json.dumps(results))


if __name__ == "__main__":
    main()
