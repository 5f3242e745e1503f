"""Fine-tune a KerasHub text classifier with gradient accumulation.

Builds a small `BertTextClassifier` from a configuration (random weights,
a 29-token vocabulary: nothing is downloaded), converts it with
`AccumModel.from_model`, and trains it on synthetic reviews at micro-batch
8 with `accum_steps=4`. A second copy of the task, from the same weights,
trains at batch 32 as a plain `keras.Model`; the script prints the largest
weight difference between the two, which is float32 rounding.

    python examples/keras_hub_finetune.py
    python examples/keras_hub_finetune.py --distribute

`--distribute` runs on JAX under `keras.distribution.ModelParallel` on 8
simulated CPU devices (a 2 x 4 mesh: `batch` x `model`), with the
attention heads, feed-forward kernels and token embedding sharded across
`model`; the accumulators take their weights' shardings. For a pretrained
model, replace the configuration by
`keras_hub.models.BertTextClassifier.from_preset(...)`.
"""

import argparse
import math
import os

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument(
    "--distribute",
    action="store_true",
    help="JAX ModelParallel on 8 simulated CPU devices",
)
parser.add_argument("--accum-steps", type=int, default=4)
parser.add_argument("--micro-batch", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
args = parser.parse_args()

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
if args.distribute:
    # Before JAX starts: the simulated devices, and JAX as the backend.
    if os.environ.setdefault("KERAS_BACKEND", "jax") != "jax":
        parser.error(
            "--distribute runs on JAX (keras.distribution is JAX's in "
            f"Keras 3.15); unset KERAS_BACKEND={os.environ['KERAS_BACKEND']}"
        )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=8"
    )
else:
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_accum  # noqa: E402

# --8<-- [start:data]
POSITIVE = ["good", "great", "fine", "lovely", "superb", "fun"]
NEGATIVE = ["bad", "awful", "dull", "poor", "boring", "weak"]
NEUTRAL = ["the", "a", "film", "movie", "plot", "cast", "was", "is", "and"]
VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
VOCABULARY += POSITIVE + NEGATIVE + NEUTRAL + ["very", "not", "quite"]


def reviews(n, seed=0):
    """Short synthetic reviews, labelled by their majority of sentiment
    words (0: negative, 1: positive)."""
    rng = np.random.default_rng(seed)
    texts, labels = [], []
    for _ in range(n):
        good, bad = rng.integers(0, 4, size=2)
        if good == bad:
            good += 1
        words = list(rng.choice(POSITIVE, good)) + list(
            rng.choice(NEGATIVE, bad)
        )
        words += list(rng.choice(NEUTRAL, rng.integers(2, 6)))
        rng.shuffle(words)
        texts.append(" ".join(words))
        labels.append(int(good > bad))
    return texts, np.array(labels, "int32")


# --8<-- [end:data]
# --8<-- [start:task]
def bert_classifier():
    """A small BERT text classifier from a configuration (random weights)."""
    keras.utils.set_random_seed(7)  # The same weights for both copies.
    tokenizer = keras_hub.tokenizers.BertTokenizer(vocabulary=VOCABULARY)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=16
    )
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(VOCABULARY),
        num_layers=1,
        num_heads=4,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=16,
        # No dropout: a window's micro-batches cannot draw the large
        # batch's masks, so the comparison below would differ by them.
        dropout=0.0,
    )
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=2, preprocessor=preprocessor, dropout=0.0
    )


# --8<-- [end:task]


# --8<-- [start:layout]
def model_parallel():
    """Batches split over `batch`, BERT's heads, feed-forward kernels and
    token embedding over `model` (Megatron-style): a 2 x 4 mesh on 8
    devices, 1 x 2 on 2."""
    devices = keras.distribution.list_devices()
    model_axis = math.gcd(len(devices), 4)  # Splits BERT's 4 heads evenly.
    mesh = keras.distribution.DeviceMesh(
        (len(devices) // model_axis, model_axis), ["batch", "model"], devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["token_embedding/embeddings"] = (None, "model")
    layout_map[".*(query|key|value)/kernel"] = (None, "model", None)
    layout_map[".*(query|key|value)/bias"] = ("model", None)
    layout_map[".*attention_output/kernel"] = ("model", None, None)
    layout_map[".*feedforward_intermediate_dense/kernel"] = (None, "model")
    layout_map[".*feedforward_output_dense/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


# --8<-- [end:layout]


# --8<-- [start:compile]
def compile_like_the_task(model):
    # What `BertTextClassifier.compile()` sets by default (Adam 5e-5,
    # sparse cross-entropy from logits, accuracy), with SGD: Adam on an
    # embedding differs on TensorFlow (docs/guides/embeddings.md).
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )


# --8<-- [end:compile]


# --8<-- [start:lora]
def is_lora_factor(variable):
    return variable.path.rsplit("/", 1)[-1].startswith("lora_kernel_")


def save_lora_run(task, directory):
    """Everything a LoRA run trained. `save_lora_weights` writes the LoRA
    factors only, while `enable_lora` leaves more trainable: the targeted
    layers' biases, and the task's head outside the backbone (Keras and
    KerasHub behaviour). Those are written beside the factors."""
    task.backbone.save_lora_weights(os.path.join(directory, "run.lora.h5"))
    rest = {
        v.path: keras.ops.convert_to_numpy(v)
        for v in task.trainable_weights
        if not is_lora_factor(v)
    }
    np.savez(os.path.join(directory, "run.npz"), **rest)


def load_lora_run(task, directory):
    """Into `task` as it was before `enable_lora` (as `from_preset` builds
    it): enables LoRA at the saved rank, loads the factors, then what
    else trained."""
    task.backbone.load_lora_weights(os.path.join(directory, "run.lora.h5"))
    with np.load(os.path.join(directory, "run.npz")) as rest:
        for v in task.trainable_weights:
            if not is_lora_factor(v):
                v.assign(rest[v.path])


# --8<-- [end:lora]


def main():
    if args.distribute:
        keras.distribution.set_distribution(model_parallel())
    micro_batch, accum_steps = args.micro_batch, args.accum_steps
    epochs = args.epochs

    # --8<-- [start:convert]
    texts, labels = reviews(micro_batch * accum_steps * 4)
    task = bert_classifier()
    # The task's preprocessor tokenizes raw strings; `from_model` keeps the
    # computation only, so tokenize once (or in a tf.data pipeline).
    x = keras.tree.map_structure(
        keras.ops.convert_to_numpy, task.preprocessor(texts)
    )
    model = keras_accum.AccumModel.from_model(task, accum_steps=accum_steps)
    compile_like_the_task(model)  # Compile defaults are not carried over.
    model.fit(
        x,
        labels,
        batch_size=micro_batch,
        epochs=epochs,
        shuffle=False,
        verbose=2,
    )
    # The task shares the trained weights: predict from raw text with it.
    logits = task.predict(["a superb film", "dull and boring"], verbose=0)
    print(f"the task's logits for two raw reviews: {logits.tolist()}")
    # --8<-- [end:convert]

    # The large batch: the task itself, on raw text (its preprocessor gives
    # the same tokens).
    reference = bert_classifier()
    compile_like_the_task(reference)
    reference.fit(
        texts,
        labels,
        batch_size=micro_batch * accum_steps,
        epochs=epochs,
        shuffle=False,
        verbose=0,
    )

    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(
            model.get_weights(), reference.get_weights(), strict=True
        )
    )
    if args.distribute:
        # Each device's partial sum of the window: one per weight shard
        # (a leading axis over the mesh's `batch` rows).
        same = all(
            acc.value.sharding.shard_shape(acc.shape)
            == (1, *weight.value.sharding.shard_shape(weight.shape))
            for acc, weight in zip(
                model.accumulators, model.trainable_variables, strict=True
            )
        )
        sharded = sum(
            "model" in str(weight.value.sharding.spec)
            for weight in model.trainable_variables
        )
        print(
            f"devices: {len(keras.distribution.list_devices())}, sharded "
            f"weights: {sharded}, accumulators hold their weights' shards: "
            f"{same}"
        )
    print(
        f"backend: {keras.backend.backend()}, optimizer updates: accumulated "
        f"{int(model.optimizer.iterations)}, large batch "
        f"{int(reference.optimizer.iterations)}"
    )
    batch = micro_batch * accum_steps
    print(f"max |weight difference| vs batch {batch}: {diff:.3e}")
    if diff > 1e-5:
        raise SystemExit("accumulated training diverged from large-batch")


if __name__ == "__main__":
    main()
