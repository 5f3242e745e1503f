"""Embedding models for `test_embeddings.py`, and its cross-backend worker.

The builders here are shared by the test and the worker so that both
backends train the same model on the same tokens. Run as a script, it
trains plain `keras.Model`s at the large batch on the backend that
`KERAS_BACKEND` names, one per optimizer given on the command line, from
weights set from numpy, and prints the weights after every update, and
those of the same training in float64 (`_helpers.LargeBatch`):

    KERAS_BACKEND=jax python _embedding_worker.py adam adagrad

On JAX and PyTorch, Keras computes an `Embedding` gradient as a dense
tensor, so plain Keras there trains on the true large-batch gradient: the
reference that `AccumModel` on TensorFlow must equal. The test asserts on
the results; this script only measures.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _helpers import LargeBatch, numpy_weights

VOCAB, DIM, LENGTH, OUTPUTS = 20, 4, 6, 3
# Micro-batch, window length, samples: windows of 4, 4 and 1 micro-batches
# per epoch, the last one 6 samples.
B, K, N = 8, 4, 70
EPOCHS = 2

# Rates large enough that an embedding row moves visibly in 6 updates;
# Adadelta's default 1e-3 would leave it still.
OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(0.5),
    "sgd_momentum": lambda: keras.optimizers.SGD(0.5, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(0.02),
    "adamw": lambda: keras.optimizers.AdamW(0.02, weight_decay=0.05),
    "rmsprop": lambda: keras.optimizers.RMSprop(0.01),
    "adagrad": lambda: keras.optimizers.Adagrad(0.1),
    "adadelta": lambda: keras.optimizers.Adadelta(1.0),
    "adamax": lambda: keras.optimizers.Adamax(0.02),
    "nadam": lambda: keras.optimizers.Nadam(0.02),
    "ftrl": lambda: keras.optimizers.Ftrl(0.1),
    "lion": lambda: keras.optimizers.Lion(0.005),
    "lamb": lambda: keras.optimizers.Lamb(0.02),
    "adafactor": lambda: keras.optimizers.Adafactor(0.1),
    # Keras clips an `IndexedSlices` by the norm of its rows, repeats
    # included: not the norm of the gradient.
    "adam_clipnorm": lambda: keras.optimizers.Adam(0.02, clipnorm=0.05),
}


def token_data(n=N, outputs=OUTPUTS, seed=0):
    """Integer tokens with many repeats, within and across samples.

    Zipf-like frequencies: the first few tokens fill most positions, so
    most samples hold one of them twice or more; the rarest ones barely
    occur, so some embedding rows get no gradient in a window.
    """
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, VOCAB + 1) ** 1.5
    tokens = rng.choice(VOCAB, size=(n, LENGTH), p=p / p.sum())
    table = rng.normal(size=(VOCAB, outputs))
    y = np.tanh(table[tokens].mean(axis=1)) + 0.1 * rng.normal(
        size=(n, outputs)
    )
    return tokens.astype("int32"), y.astype("float32")


def embedding_model(model_cls=keras.Model, head=True, seed=1, **kwargs):
    """`Embedding` -> mean over positions (-> `Dense`), same weights per seed.

    Without the head the embedding table is the only weight: every gradient
    the optimizer sees is then the embedding's, and the targets have `DIM`
    columns.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((LENGTH,), dtype="int32")
    x = keras.layers.Embedding(VOCAB, DIM)(inputs)
    outputs = keras.layers.GlobalAveragePooling1D()(x)
    if head:
        outputs = keras.layers.Dense(OUTPUTS)(outputs)
    return model_cls(inputs, outputs, **kwargs)


def main():
    x, y = token_data()
    runs = {}
    for name in sys.argv[1:]:
        model = embedding_model()
        numpy_weights(model)
        model.compile(optimizer=OPTIMIZERS[name](), loss="mse")
        reference = LargeBatch(model)
        reference.fit(
            x,
            y,
            batch_size=B * K,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
        )
        _, exact, _ = reference.float64()
        runs[name] = {
            kind: [
                [step, [w.tolist() for w in weights]]
                for step, weights in updates
            ]
            for kind, updates in (
                ("float32", reference.updates.updates),
                ("float64", exact),
            )
        }
    print(
        "RESULTS "
        + json.dumps({"backend": keras.backend.backend(), "runs": runs}),
        flush=True,
    )


if __name__ == "__main__":
    main()
