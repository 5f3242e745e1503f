"""Retrieval with in-batch negatives: batch 1024 against accumulation 64 x 16.

A contrastive loss compares each sample with the rest of its batch, so
gradient accumulation does not train what the large batch trains: split a
batch of 1,024 pairs into 16 micro-batches of 64 and each pair is told apart
from its micro-batch's 63 other pairs instead of the batch's 1,023. This
example measures what that costs on a retrieval task.

The task: two random views of each MNIST digit (each shifted by up to 3
pixels each way, Gaussian noise of standard deviation 0.1 added), one
encoder shared by both views (an MLP 784-256-64, unit-normalized) and CLIP's
symmetric InfoNCE loss with a learnable temperature (a weight of the model,
applied inside it, so the loss reads it in `y_pred`). Each run trains 8
epochs of 58 x 1,024 training pairs, fresh views every epoch, with Adam and
a cosine decay from 2e-3 to 0, from the same initial weights and on the same
pairs in the same order as the other runs of its seed:

- A: batch 1,024, each pair against the 1,023 others of its batch; 464
  updates, as `AccumModel(micro_batch_size=64, whole_batch_loss=True)`,
  which holds 64 samples' activations at a time.
- K: the same as a plain `keras.Model` at batch 1,024, which A equals.
- B: the classic accumulation, `AccumModel(accum_steps=16)` fed batches of
  64: the same 464 updates of 1,024 pairs each, but each micro-batch's loss
  over its own 64 pairs (63 negatives).
- C: for context, `keras.Model` at batch 64: 63 negatives, 16x the updates
  (7,424), the same compute.

The score: for each of the 10,000 test digits, is its second view the
nearest of all 10,000 test second views to its first view (top-1), or among
the 5 nearest (top-5), by cosine similarity? (Test views drawn once, seed
99; chance is 1 in 10,000.)

Results (JAX 0.10.2, Keras 3.15.1, CPU; seeds 1-3; top-1 / top-5):

    run                        seed 1       seed 2       seed 3       mean
    K  batch 1024, keras.Model .830/.964    .833/.960    .827/.959    .830/.961
    A  1024, whole_batch_loss  .831/.962    .833/.960    .827/.958    .831/.960
    B  accumulation 64 x 16    .699/.913    .691/.915    .679/.908    .690/.912
    C  batch 64, 16x updates   .853/.978    .848/.978    .852/.980    .851/.979

The whole batch's negatives win by 14 points of top-1 (5 of top-5) at the
same updates, data and order, on every seed (seed-to-seed spread under 2
points). Trained twice as long (`--epochs 16`, seed 1), K reaches .909/.986
and B .827/.966: B needs about twice K's updates to match it. C shows that
accumulation is the weak one, not small batches: with 16 times the updates
(its learned scale reaches about 90, against 16 for A and K and 15 for B),
batch 64 even edges out A on this small task. The case for the large batch
is the one accumulation is for: the updates are fixed (each costs a step
over many devices, or the schedule is set for batch 1024), and then only
the whole batch's negatives keep A's accuracy.
About 45 s of CPU time per run of K or B, 50 to 58 s of A (its extra
forward pass), on one core of a shared two-core machine. A and K differ
by float32 rounding per update, carried by 464 Adam updates into the third
decimal.

    python examples/contrastive_retrieval.py --runs A,K,B,C  # the table
    python examples/contrastive_retrieval.py --quick       # < 60 s smoke run

MNIST is read from `--data` (default: `../shared/data/mnist/mnist.npz`
beside the checkout), else downloaded once by `keras.datasets.mnist`.
The backend is JAX unless `KERAS_BACKEND` says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np
from keras import ops

import keras_accum

BATCH = 1024
MICRO_BATCH = 64
EMBED = 64
PAD = 3  # Each view is shifted by up to PAD pixels each way.
# The offline copy beside the checkout; elsewhere Keras downloads MNIST once.
DEFAULT_DATA = os.path.join(
    os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ),
    "shared",
    "data",
    "mnist",
    "mnist.npz",
)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument(
        "--runs",
        default="A,B",
        help="comma-separated: A (batch 1024, whole_batch_loss), K (batch "
        "1024, keras.Model), B (64 x 16 accumulation), "
        "C (batch 64, 16x the updates); default A,B",
    )
    parser.add_argument(
        "--train", type=int, default=58, help="training batches of 1024"
    )
    parser.add_argument(
        "--gallery", type=int, default=10_000, help="test pairs to rank"
    )
    parser.add_argument("--learning-rate", type=float, default=2e-3)
    parser.add_argument("--noise", type=float, default=0.1)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument(
        "--quick", action="store_true", help="a < 60 s smoke run (CI)"
    )
    parser.add_argument("--data", default=DEFAULT_DATA)
    args = parser.parse_args(argv)
    if args.quick:
        args.epochs, args.seeds, args.train, args.gallery = 3, 1, 8, 1000
    return args


# -- Data: two augmented views of each digit ---------------------------------


def views(images, rng, noise):
    """A random view of each image: shifted by up to `PAD` pixels each way,
    Gaussian noise of standard deviation `noise` added; uint8."""
    n = len(images)
    padded = np.pad(images, ((0, 0), (PAD, PAD), (PAD, PAD)))
    dy, dx = rng.integers(0, 2 * PAD + 1, size=(2, n))
    rows = dy[:, None] + np.arange(28)[None, :]
    cols = dx[:, None] + np.arange(28)[None, :]
    out = padded[np.arange(n)[:, None, None], rows[:, :, None], cols[:, None]]
    out = out.astype("float32") / 255.0
    out += noise * rng.standard_normal(out.shape, dtype="float32")
    return np.clip(out * 255.0, 0, 255).astype("uint8").reshape(n, 784)


def pair_views(images, rng, args):
    return {
        "view1": views(images, rng, args.noise),
        "view2": views(images, rng, args.noise),
    }


# -- Model: one encoder for both views, CLIP's loss ---------------------------


# --8<-- [start:model]
class LogitScale(keras.layers.Layer):
    """Multiplies its input by `exp(logit_scale)`, a trainable scalar: the
    learnable inverse temperature, a weight of the model."""

    def build(self, input_shape):
        self.logit_scale = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(np.log(10.0)),
            name="logit_scale",
        )

    def call(self, x):
        return x * ops.exp(self.logit_scale)


class Pair(keras.layers.Layer):
    """Stacks the two views' embeddings: `y_pred` is `(batch, 2, 64)`."""

    def call(self, a, b):
        return ops.stack([a, b], axis=1)


def clip_loss(y_true, y_pred):
    """Symmetric InfoNCE over the batch: pair i's views are each other's
    positive; the other pairs' views in the batch are its negatives."""
    del y_true
    logits = ops.matmul(y_pred[:, 0], ops.transpose(y_pred[:, 1]))
    labels = ops.arange(ops.shape(logits)[0])
    xent = keras.losses.sparse_categorical_crossentropy
    return 0.5 * (
        xent(labels, logits, from_logits=True)
        + xent(labels, ops.transpose(logits), from_logits=True)
    )


def build(model_cls, seed, args, **kwargs):
    """The two-view model (as `model_cls`) and its encoder; the same initial
    weights for every run of a seed."""
    keras.utils.set_random_seed(seed)
    encoder = keras.Sequential(
        [
            keras.Input((784,), dtype="uint8"),
            keras.layers.Rescaling(1.0 / 255.0),
            keras.layers.Dense(args.hidden, activation="relu"),
            keras.layers.Dense(EMBED),
            keras.layers.UnitNormalization(),
        ],
        name="encoder",
    )
    view1 = keras.Input((784,), dtype="uint8", name="view1")
    view2 = keras.Input((784,), dtype="uint8", name="view2")
    scaled = LogitScale(name="temperature")(encoder(view1))
    outputs = Pair(name="pair")(scaled, encoder(view2))
    model = model_cls({"view1": view1, "view2": view2}, outputs, **kwargs)
    return model, encoder


# --8<-- [end:model]


# -- Runs ---------------------------------------------------------------------

RUNS = {
    "A": "batch 1024 by 64 at a time (whole_batch_loss)",
    "K": "batch 1024, keras.Model",
    "B": "accumulation 64 x 16 (63 negatives)",
    "C": "batch 64, 16x the updates",
}


def train_and_score(run, seed, data, args):
    x_train, x_test = data
    if run == "A":
        # The batch of 1024 in one step, its loss on the whole batch; the
        # device holds 64 samples' activations at a time.
        model_cls = keras_accum.AccumModel
        kwargs = {"micro_batch_size": MICRO_BATCH, "whole_batch_loss": True}
        batch, per_update = BATCH, BATCH
    elif run == "K":
        # What A must equal: a plain model at batch 1024.
        model_cls, kwargs = keras.Model, {}
        batch, per_update = BATCH, BATCH
    elif run == "B":
        model_cls = keras_accum.AccumModel
        kwargs = {"accum_steps": BATCH // MICRO_BATCH}
        batch, per_update = MICRO_BATCH, BATCH
    else:
        model_cls, kwargs = keras.Model, {}
        batch, per_update = MICRO_BATCH, MICRO_BATCH
    model, encoder = build(model_cls, seed, args, **kwargs)
    n = args.train * BATCH
    updates = args.epochs * n // per_update
    schedule = keras.optimizers.schedules.CosineDecay(
        args.learning_rate, decay_steps=updates
    )
    model.compile(optimizer=keras.optimizers.Adam(schedule), loss=clip_loss)
    rng = np.random.default_rng(seed)
    start = time.process_time()
    for _ in range(args.epochs):
        # Fresh views each epoch, the same for every run of a seed.
        order = rng.permutation(len(x_train))[:n]
        x = pair_views(x_train[order], rng, args)
        model.fit(
            x,
            np.zeros((n,), "float32"),
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
        )
    seconds = time.process_time() - start
    test = pair_views(x_test[: args.gallery], np.random.default_rng(99), args)
    q = encoder.predict(test["view1"], batch_size=1000, verbose=0)
    g = encoder.predict(test["view2"], batch_size=1000, verbose=0)
    top1 = top5 = 0
    for i in range(0, len(q), 1000):
        sims = q[i : i + 1000] @ g.T
        own = sims[np.arange(len(sims)), i + np.arange(len(sims))]
        rank = np.sum(sims > own[:, None], axis=1)
        top1 += int(np.sum(rank < 1))
        top5 += int(np.sum(rank < 5))
    scale = float(np.exp(model.get_layer("temperature").logit_scale.numpy()))
    # The updates the optimizer made (the same for A and B).
    updates = int(model.optimizer.iterations)
    return top1 / len(q), top5 / len(q), scale, updates, seconds


def main(argv=None):
    args = parse_args(argv)
    if os.path.exists(args.data):
        with np.load(args.data) as f:
            data = (f["x_train"], f["x_test"])
    else:
        (x_train, _), (x_test, _) = keras.datasets.mnist.load_data()
        data = (x_train, x_test)
    runs = args.runs.split(",")
    print(
        f"backend {keras.backend.backend()}, {args.epochs} epochs of "
        f"{args.train * BATCH} pairs, gallery {args.gallery}"
    )
    results = {run: [] for run in runs}
    for seed in range(1, args.seeds + 1):
        for run in runs:
            top1, top5, scale, updates, seconds = train_and_score(
                run, seed, data, args
            )
            results[run].append((top1, top5))
            print(
                f"run {run} seed {seed}: top1 {top1:.4f} top5 {top5:.4f} "
                f"scale {scale:.1f} updates {updates} cpu {seconds:.0f}s",
                flush=True,
            )
    for run in runs:
        mean = np.mean(results[run], axis=0)
        print(f"{run} {RUNS[run]}: mean top1 {mean[0]:.4f} top5 {mean[1]:.4f}")
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
