"""What the benchmark scripts build, on whichever backend Keras runs.

The models (inputs, outputs, input shape, input range) and the variants
compared at micro-batch B: `plain` (`keras.Model`), `accum` (`AccumModel`
with `accum_steps=k`), `keras_ga` (Keras's optimizer-level
`gradient_accumulation_steps=k`) and `large` (`keras.Model`, fed batch B*k).
Imports only Keras and the package, so each benchmark picks the backend.
"""

from __future__ import annotations

import keras

import keras_accum


def mlp():
    inputs = keras.Input((784,))
    x = keras.layers.Dense(512, activation="relu")(inputs)
    x = keras.layers.Dense(512, activation="relu")(x)
    return inputs, keras.layers.Dense(10)(x), (784,), 10


def cnn():
    inputs = keras.Input((28, 28, 1))
    x = keras.layers.Conv2D(32, 3, activation="relu")(inputs)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Conv2D(64, 3, activation="relu")(x)
    x = keras.layers.MaxPooling2D()(x)
    x = keras.layers.Flatten()(x)
    return inputs, keras.layers.Dense(10)(x), (28, 28, 1), 10


def transformer():
    seq, width, vocab = 64, 64, 1000
    inputs = keras.Input((seq,), dtype="int32")
    x = keras.layers.Embedding(vocab, width)(inputs)
    attention = keras.layers.MultiHeadAttention(num_heads=4, key_dim=16)
    x = keras.layers.LayerNormalization()(x + attention(x, x))
    ffn = keras.layers.Dense(4 * width, activation="gelu")(x)
    x = keras.layers.LayerNormalization()(x + keras.layers.Dense(width)(ffn))
    x = keras.layers.GlobalAveragePooling1D()(x)
    return inputs, keras.layers.Dense(10)(x), (seq,), vocab


MODELS = {"mlp": mlp, "cnn": cnn, "transformer": transformer}


def compiled(inputs, outputs, variant, k, **compile_kwargs):
    """The `variant` model on `inputs` → `outputs`, compiled with Adam."""
    optimizer_kwargs = {}
    if variant == "keras_ga":
        optimizer_kwargs["gradient_accumulation_steps"] = k
    if variant.startswith("accum"):
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=k)
    else:
        model = keras.Model(inputs, outputs)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3, **optimizer_kwargs),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **compile_kwargs,
    )
    return model
