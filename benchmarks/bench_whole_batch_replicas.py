"""What a contrastive loss sees under `tf.distribute`: each replica's rows,
or the global batch.

Under `MirroredStrategy` a plain `keras.Model` runs its step on each
replica's rows: its loss compares each pair with the other pairs of its
replica only (B/R - 1 negatives instead of B - 1), and the update is the
mean of the replicas' gradients. `AccumModel(whole_batch_loss=True)`
gathers the outputs, so that the loss sees the global batch, as one
device at the batch computes it.

The model: a CLIP dual encoder (two towers, 32 -> 64 tanh -> 16, unit
normalized) with a learnable temperature (initial 10), its symmetric
InfoNCE loss, on paired noisy views of random items. For each global
batch B, from the same initial weights, on 2 replicas (2 logical CPUs):

- the loss each run logs on its first batch, against one device's;
- the first update's error (SGD, learning rate 1, so the update is the
  gradient): |update - one device's update| / |one device's update|;
- the weights after an epoch of Adam (8 updates, learning rate 1e-3): the
  largest difference from one device's, beside how far one device's
  weights moved.

    python benchmarks/bench_whole_batch_replicas.py [--batches=32,256]

Results go to benchmarks/results/whole_batch_replicas.json (or `--out`);
the table is printed in Markdown.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

ROOT = Path(__file__).resolve().parents[1]
REPLICAS = 2
UPDATES = 8


def _strategy():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS
    )
    return tf.distribute.MirroredStrategy(
        [f"/cpu:{i}" for i in range(REPLICAS)]
    )


def _clip_loss(y_true, y_pred):
    from keras import ops

    del y_true  # The pairs are the labels.
    logits = ops.matmul(y_pred[:, 0], ops.transpose(y_pred[:, 1]))
    labels = ops.arange(ops.shape(logits)[0])

    def rows(logits):
        return ops.sparse_categorical_crossentropy(
            labels, logits, from_logits=True
        )

    return 0.5 * (rows(logits) + rows(ops.transpose(logits)))


def _model(model_cls, **kwargs):
    import keras
    from keras import ops

    class Temperature(keras.layers.Layer):
        def build(self, input_shape):
            self.log_scale = self.add_weight(
                shape=(),
                initializer=keras.initializers.Constant(2.3),
                name="log_scale",
            )

        def call(self, x):
            return x * ops.exp(self.log_scale)

    def tower(name):
        return keras.Sequential(
            [
                keras.layers.Dense(64, activation="tanh"),
                keras.layers.Dense(16),
                keras.layers.UnitNormalization(),
            ],
            name=name,
        )

    keras.utils.set_random_seed(1)
    image = keras.Input((32,), name="image")
    text = keras.Input((32,), name="text")
    scaled = Temperature()(tower("image_tower")(image))
    paired = keras.layers.Lambda(lambda ab: ops.stack(ab, axis=1))(
        [scaled, tower("text_tower")(text)]
    )
    return model_cls({"image": image, "text": text}, paired, **kwargs)


def _data(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    items = rng.normal(size=(n, 8))
    views = [
        items @ rng.normal(size=(8, 32)) + 0.5 * rng.normal(size=(n, 32))
        for _ in range(2)
    ]
    x = {
        "image": views[0].astype("float32"),
        "text": views[1].astype("float32"),
    }
    return x, np.zeros((n, 1), "float32")


def _run(variant, batch, strategy, start, optimizer):
    """`(first logged loss, weights after the run)` of `variant` trained
    on `UPDATES` batches of `batch` (one with `"sgd"`)."""
    import contextlib

    import keras

    import keras_accum

    scope = contextlib.nullcontext()
    kwargs = {}
    if variant != "one_device":
        scope = strategy.scope()
    if variant == "whole_batch":
        model_cls = keras_accum.AccumModel
        kwargs = {"micro_batch_size": batch // (2 * REPLICAS)}
        kwargs["whole_batch_loss"] = True
    else:
        model_cls = keras.Model
    with scope:
        model = _model(model_cls, **kwargs)
        model.set_weights(start)
        if optimizer == "sgd":
            made = keras.optimizers.SGD(1.0)
        else:
            made = keras.optimizers.Adam(1e-3)
        model.compile(optimizer=made, loss=_clip_loss)
    updates = 1 if optimizer == "sgd" else UPDATES
    x, y = _data(batch * updates)
    losses = []
    callback = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda _, logs: losses.append(float(logs["loss"]))
    )
    model.fit(
        x,
        y,
        batch_size=batch,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[callback],
    )
    return losses[0], model.get_weights()


def _flat(weights):
    import numpy as np

    return np.concatenate([np.ravel(w) for w in weights])


def measure(batch, strategy) -> list[dict]:
    import keras
    import numpy as np

    start = _model(keras.Model).get_weights()
    found = {}
    for variant in ("one_device", "plain", "whole_batch"):
        loss, after_sgd = _run(variant, batch, strategy, start, "sgd")
        _, after_adam = _run(variant, batch, strategy, start, "adam")
        found[variant] = (loss, _flat(after_sgd), _flat(after_adam))
    reference = found["one_device"]
    update = reference[1] - _flat(start)
    rows = []
    for variant, (loss, after_sgd, after_adam) in found.items():
        own = after_sgd - _flat(start)
        rows.append(
            {
                "batch": batch,
                "variant": variant,
                "loss": loss,
                "loss_one_device": reference[0],
                "update_error": float(
                    np.linalg.norm(own - update) / np.linalg.norm(update)
                ),
                "adam_max_diff": float(
                    np.max(np.abs(after_adam - reference[2]))
                ),
                # How far one device's weights moved, for scale.
                "adam_moved": float(
                    np.max(np.abs(reference[2] - _flat(start)))
                ),
            }
        )
    return rows


NAMES = {
    "one_device": "`keras.Model`, one device",
    "plain": "`keras.Model`, MirroredStrategy",
    "whole_batch": "`AccumModel(whole_batch_loss=True)`, MirroredStrategy",
}


def table(rows) -> str:
    lines = [
        "| batch | run | first loss (one device's) | first update's error "
        f"| after {UPDATES} Adam updates: max weight diff (one device's "
        "largest move) |",
        "|---:|---|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['batch']} | {NAMES[row['variant']]} | "
            f"{row['loss']:.4f} ({row['loss_one_device']:.4f}) | "
            f"{row['update_error']:.2e} | {row['adam_max_diff']:.2e} "
            f"({row['adam_moved']:.2e}) |"
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", default="32,256")
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks/results/whole_batch_replicas.json"),
    )
    args = parser.parse_args(argv)
    strategy = _strategy()
    sys.path.insert(0, str(ROOT))
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows.extend(measure(batch, strategy))
    Path(args.out).write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(table(rows))


if __name__ == "__main__":
    main()
