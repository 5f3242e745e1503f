"""Losses that compare the samples of a batch, and the models they train,
written as a Keras user writes them (issue 52's equality cases).

Each loss reads the whole batch: split a batch in pieces and every piece
sees its own in-batch negatives only. Two styles, both common in Keras
code, and both to be supported:

- A compiled loss function `loss(y_true, y_pred)` returning one value per
  sample (an anchor's loss against the whole batch), with the learnable
  temperature or bias a weight of a layer whose output is part of
  `y_pred`: `clip_model` (the temperature scales the image embeddings),
  `siglip_model` (the bias rides in a column of `y_pred`),
  `supcon_model` (the labels in `y_true`).
- A model overriding `compute_loss`, which reads the model's own weights
  (the CLIP temperature as `self.logit_scale`, as keras-io's dual encoder
  and OpenCLIP hold it): `dual_encoder`; and a two-tower retrieval model
  with several inputs, dict outputs and no `y` (TensorFlow Recommenders'
  style): `two_tower`.

Every model has dropout inside, with explicit seeds, so that a
`keras.Model` and an `AccumModel` built alike draw alike; `dropout=0.0`
removes it. `model_cls` is `keras.Model` or `keras_accum.AccumModel`
(and `**kwargs` its settings). Same `seed`, same initial weights.
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

EMBED = 4
LOG_5 = math.log(5.0)


# -- Losses: one value per sample, each against the whole batch ---------------


def _cross_entropy_rows(logits):
    """Each row's cross-entropy with its diagonal entry as the label."""
    labels = ops.arange(ops.shape(logits)[0])
    return keras.losses.sparse_categorical_crossentropy(
        labels, logits, from_logits=True
    )


def clip_loss(y_true, y_pred):
    """CLIP's symmetric InfoNCE. `y_pred`: `(batch, 2, d)`, the scaled
    image embeddings and the text embeddings of each pair."""
    del y_true  # The pairs are the labels.
    logits = ops.matmul(y_pred[:, 0], ops.transpose(y_pred[:, 1]))
    return 0.5 * (
        _cross_entropy_rows(logits) + _cross_entropy_rows(ops.transpose(logits))
    )


def siglip_loss(y_true, y_pred):
    """SigLIP's pairwise sigmoid loss: every pair `(i, j)` of the batch is a
    binary example, positive on the diagonal. `y_pred`: `(batch, 2d + 1)`,
    the scaled image embeddings, the text embeddings, and the learnable
    bias in the last column (the same on every row)."""
    del y_true
    d = (ops.shape(y_pred)[1] - 1) // 2
    image, text, bias = y_pred[:, :d], y_pred[:, d : 2 * d], y_pred[:, -1]
    logits = ops.matmul(image, ops.transpose(text)) + ops.mean(bias)
    n = ops.shape(logits)[0]
    signs = 2.0 * ops.eye(n, dtype=logits.dtype) - 1.0
    # -log sigmoid(z) = softplus(-z): each anchor's row, summed.
    return ops.sum(ops.softplus(-signs * logits), axis=1)


def supcon_loss(y_true, y_pred, temperature=0.5):
    """Supervised contrastive loss (Khosla et al. 2020): each anchor against
    every other sample of the batch, its positives those with its label in
    `y_true`. `y_pred`: `(batch, d)`, normalized embeddings. An anchor
    with no positive in the batch has loss 0."""
    labels = ops.reshape(ops.cast(y_true, "int32"), (-1,))
    n = ops.shape(y_pred)[0]
    logits = ops.matmul(y_pred, ops.transpose(y_pred)) / temperature
    others = 1.0 - ops.eye(n, dtype=logits.dtype)
    positives = (
        ops.cast(ops.equal(labels[:, None], labels[None, :]), logits.dtype)
        * others
    )
    # The log-softmax over the other samples (the anchor itself left out).
    logits = logits - 1e9 * (1.0 - others)
    log_prob = logits - ops.logsumexp(logits, axis=1, keepdims=True)
    count = ops.sum(positives, axis=1)
    total = ops.sum(positives * log_prob * others, axis=1)
    return -total / ops.maximum(count, 1.0)


def in_batch_softmax(query, candidate, sample_weight=None):
    """The retrieval task's loss: each query's softmax over the batch's
    candidates, its own candidate the label; the weighted mean."""
    per_query = _cross_entropy_rows(ops.matmul(query, ops.transpose(candidate)))
    if sample_weight is None:
        return ops.mean(per_query)
    weight = ops.cast(ops.reshape(sample_weight, (-1,)), per_query.dtype)
    return ops.sum(per_query * weight) / ops.cast(
        ops.shape(per_query)[0], per_query.dtype
    )


# -- Layers --------------------------------------------------------------------


class LogitScale(keras.layers.Layer):
    """Multiplies its input by `exp(logit_scale)`, a trainable scalar
    (CLIP's temperature, as a layer of the model)."""

    def __init__(self, initial=LOG_5, **kwargs):
        super().__init__(**kwargs)
        self.initial = initial

    def build(self, input_shape):
        self.logit_scale = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(self.initial),
            name="logit_scale",
        )

    def call(self, x):
        return x * ops.exp(ops.cast(self.logit_scale, x.dtype))

    def get_config(self):
        return {**super().get_config(), "initial": self.initial}


class BiasColumn(keras.layers.Layer):
    """Appends a trainable scalar as a last column, the same on every row
    (SigLIP's bias, carried out of the model in `y_pred`)."""

    def __init__(self, initial=-2.0, **kwargs):
        super().__init__(**kwargs)
        self.initial = initial

    def build(self, input_shape):
        self.bias = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(self.initial),
            name="bias",
        )

    def call(self, x):
        column = ops.ones_like(x[:, :1]) * ops.cast(self.bias, x.dtype)
        return ops.concatenate([x, column], axis=1)

    def get_config(self):
        return {**super().get_config(), "initial": self.initial}


class Pair(keras.layers.Layer):
    """Stacks two `(batch, d)` tensors into `(batch, 2, d)`."""

    def call(self, a, b):
        return ops.stack([a, b], axis=1)


def encoder(name, features, dropout, seed, hidden=8):
    """Dense, dropout, dense, unit-normalized: one tower."""
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(hidden, activation="tanh"),
            keras.layers.Dropout(dropout, seed=seed),
            keras.layers.Dense(EMBED),
            keras.layers.UnitNormalization(),
        ],
        name=name,
    )


# -- Models whose compiled loss sees the batch ---------------------------------


def clip_model(model_cls=keras.Model, dropout=0.1, seed=1, **kwargs):
    """Two inputs (`{"image", "text"}`), one output `(batch, 2, d)`; the
    temperature a `LogitScale` layer's weight. Compiled with `clip_loss`."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((6,), name="image")
    text = keras.Input((5,), name="text")
    scaled = LogitScale(name="logit_scale")(
        encoder("image_tower", 6, dropout, 11)(image)
    )
    pair = Pair(name="pair")(
        scaled, encoder("text_tower", 5, dropout, 12)(text)
    )
    return model_cls({"image": image, "text": text}, pair, **kwargs)


def siglip_model(model_cls=keras.Model, dropout=0.1, seed=1, **kwargs):
    """As `clip_model`, one output `(batch, 2d + 1)` with the bias column.
    Compiled with `siglip_loss`."""
    keras.utils.set_random_seed(seed)
    image = keras.Input((6,), name="image")
    text = keras.Input((5,), name="text")
    scaled = LogitScale(math.log(3.0), name="logit_scale")(
        encoder("image_tower", 6, dropout, 11)(image)
    )
    joined = keras.layers.Concatenate()(
        [scaled, encoder("text_tower", 5, dropout, 12)(text)]
    )
    out = BiasColumn(name="bias")(joined)
    return model_cls({"image": image, "text": text}, out, **kwargs)


def supcon_model(model_cls=keras.Model, dropout=0.1, seed=1, **kwargs):
    """One input, normalized embeddings out; `y` the class labels.
    Compiled with `supcon_loss`."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((6,))
    return model_cls(inputs, encoder("tower", 6, dropout, 13)(inputs), **kwargs)


# -- Models that override `compute_loss` ---------------------------------------

_CLASSES = {}


def _subclass(kind, model_cls):
    """The `kind` model class over `model_cls` (made once per base)."""
    key = (kind, model_cls)
    if key not in _CLASSES:
        _CLASSES[key] = type(
            f"{kind.__name__}Over{model_cls.__name__}", (kind, model_cls), {}
        )
    return _CLASSES[key]


class DualEncoder:
    """Subclassing style: two towers and the temperature `logit_scale` a
    weight of the model itself, read by `compute_loss` (not an output)."""

    def __init__(self, dropout=0.1, **kwargs):
        super().__init__(**kwargs)
        self.image_tower = encoder("image_tower", 6, dropout, 11)
        self.text_tower = encoder("text_tower", 5, dropout, 12)
        self.logit_scale = self.add_weight(
            shape=(),
            initializer=keras.initializers.Constant(math.log(5.0)),
            name="logit_scale",
        )

    def call(self, inputs, training=False):
        return {
            "image": self.image_tower(inputs["image"], training=training),
            "text": self.text_tower(inputs["text"], training=training),
        }

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        scale = ops.exp(ops.cast(self.logit_scale, y_pred["image"].dtype))
        logits = scale * ops.matmul(
            y_pred["image"], ops.transpose(y_pred["text"])
        )
        per_pair = 0.5 * (
            _cross_entropy_rows(logits)
            + _cross_entropy_rows(ops.transpose(logits))
        )
        if sample_weight is not None:
            per_pair = per_pair * ops.cast(
                ops.reshape(sample_weight, (-1,)), per_pair.dtype
            )
        loss = ops.mean(per_pair)
        # As Keras's own `compute_loss` example adds the model's losses.
        for extra in self.losses:
            loss = loss + ops.cast(extra, loss.dtype)
        return loss


def dual_encoder(model_cls=keras.Model, dropout=0.1, seed=1, **kwargs):
    """A subclassed CLIP dual encoder (`{"image", "text"}` in, dict out)
    whose `compute_loss` reads its `logit_scale` weight; built."""
    keras.utils.set_random_seed(seed)
    model = _subclass(DualEncoder, model_cls)(dropout=dropout, **kwargs)
    model(
        {
            "image": np.zeros((2, 6), "float32"),
            "text": np.zeros((2, 5), "float32"),
        }
    )
    return model


class TwoTower:
    """TensorFlow Recommenders' retrieval style: the loss in `compute_loss`,
    on the towers' dict outputs, with no `y`."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        del y
        loss = in_batch_softmax(
            y_pred["query"], y_pred["candidate"], sample_weight
        )
        for extra in self.losses:
            loss = loss + ops.cast(extra, loss.dtype)
        return loss


def two_tower(model_cls=keras.Model, dropout=0.1, seed=1, **kwargs):
    """Functional: inputs `{"query": (5,), "user": (3,), "candidate": (7,)}`
    (the query tower reads two), dict outputs `{"query", "candidate"}`;
    compiled with no loss, trained with no `y`."""
    keras.utils.set_random_seed(seed)
    query = keras.Input((5,), name="query")
    user = keras.Input((3,), name="user")
    candidate = keras.Input((7,), name="candidate")
    query_features = keras.layers.Concatenate()([query, user])
    outputs = {
        "query": encoder("query_tower", 8, dropout, 14)(query_features),
        "candidate": encoder("candidate_tower", 7, dropout, 15)(candidate),
    }
    inputs = {"query": query, "user": user, "candidate": candidate}
    return _subclass(TwoTower, model_cls)(inputs, outputs, **kwargs)


# -- Data ----------------------------------------------------------------------


def pairs(n=32, seed=0):
    """`({"image", "text"}, y)`: paired views of `n` latent items (each view
    a noisy linear map of the item), and the items' classes (4) as `y`."""
    rng = np.random.default_rng(seed)
    items = rng.normal(size=(n, 3))
    image = items @ rng.normal(size=(3, 6)) + 0.3 * rng.normal(size=(n, 6))
    text = items @ rng.normal(size=(3, 5)) + 0.3 * rng.normal(size=(n, 5))
    classes = np.argmax(items @ rng.normal(size=(3, 4)), axis=1)
    x = {"image": image.astype("float32"), "text": text.astype("float32")}
    return x, classes.astype("int32")


def labelled(n=32, seed=0):
    """`(x, labels)` for `supcon_model`: 4 classes around 4 centres."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 4, size=n)
    centres = rng.normal(size=(4, 6)) * 2.0
    x = centres[labels] + rng.normal(size=(n, 6))
    return x.astype("float32"), labels.astype("int32")


def queries(n=32, seed=0):
    """Inputs for `two_tower`: each query with its own candidate."""
    rng = np.random.default_rng(seed)
    items = rng.normal(size=(n, 3))
    return {
        "query": (items @ rng.normal(size=(3, 5))).astype("float32"),
        "user": rng.normal(size=(n, 3)).astype("float32"),
        "candidate": (
            items @ rng.normal(size=(3, 7)) + 0.2 * rng.normal(size=(n, 7))
        ).astype("float32"),
    }


# Each case: (name, build, data, loss to compile with), `data()` giving
# `(x, y)` (y None for the two-tower model).
CASES = {
    "clip": (clip_model, lambda n=32: pairs(n), clip_loss),
    "siglip": (siglip_model, lambda n=32: pairs(n), siglip_loss),
    "supcon": (supcon_model, lambda n=32: labelled(n), supcon_loss),
    "dual_encoder": (dual_encoder, lambda n=32: pairs(n), None),
    "two_tower": (two_tower, lambda n=32: (queries(n), None), None),
}


def in_batch_accuracy(y_true, y_pred):
    """A metric for `clip_model` that reads the whole batch: whether each
    image's nearest text of the batch is its own (one value per sample)."""
    del y_true
    logits = ops.matmul(y_pred[:, 0], ops.transpose(y_pred[:, 1]))
    hits = ops.equal(
        ops.argmax(logits, axis=1), ops.arange(ops.shape(logits)[0])
    )
    return ops.cast(hits, "float32")


def compiled_case(name, model_cls, encoder, optimizer, **kwargs):
    """Seed 1, no dropout: `"clip"`'s model (its loss and
    `in_batch_accuracy`), or for another `name` the two-tower `encoder`
    (a `DualEncoder`) with L2 on each tower's first kernel, losses the
    model adds itself; compiled with `optimizer`."""
    keras.utils.set_random_seed(1)
    if name == "clip":
        model = CASES["clip"][0](model_cls, dropout=0.0, **kwargs)
        loss, metrics = CASES["clip"][2], [in_batch_accuracy]
    else:
        model = _subclass(encoder, model_cls)(dropout=0.0, **kwargs)
        model(CASES["clip"][1](2)[0])
        for tower in (model.image_tower, model.text_tower):
            tower.layers[0].kernel.regularizer = keras.regularizers.L2(0.05)
        assert len(model.losses) == 2  # The regularization counts.
        loss, metrics = None, None
    model.compile(optimizer=optimizer, loss=loss, metrics=metrics)
    return model
