"""KerasHub tasks converted with `AccumModel.from_model`.

Built from small configurations with random weights (nothing is
downloaded): a `BertTextClassifier` and a `GPT2CausalLM`, each trained as
an `AccumModel` at batch B with `accum_steps=K` and compared after every
update with the task itself, a plain `keras.Model`, at batch B * K; then
saved as a `.keras` file, loaded, and trained on identically. SGD, so that
the comparison holds on TensorFlow too, where Keras's Adam updates an
embedding from its per-occurrence rows (docs/guides/embeddings.md).
Dropout is 0: a window's masks cannot be the large batch's.
"""

import keras
import numpy as np
import pytest
from _helpers import train_pair

import keras_accum

# Conversion and `.keras` saving are Keras code, the same on every backend;
# about 20 s a run, so once. The JAX run's sharding of the accumulators is
# tests/test_sharding.py, and the TensorFlow run also trains a KerasHub
# classifier on JAX (examples/keras_hub_finetune.py, test_examples.py).
pytestmark = pytest.mark.full_run_only(
    reason="KerasHub tasks through from_model: backend-neutral Keras code; "
    "test_model.py's from_model cases cover the conversion on this backend"
)

# Micro-batch, window length, samples: two windows per epoch. Full
# batches only, so that each model compiles one step (an uneven last batch
# is covered by tests/test_model.py).
B, K, N = 4, 4, 32
VOCAB, LENGTH = 40, 8


def tokens(seed=0):
    rng = np.random.default_rng(seed)
    token_ids = rng.integers(1, VOCAB, size=(N, LENGTH)).astype("int32")
    # Padding at the end of each sequence, of varying length.
    lengths = rng.integers(3, LENGTH + 1, size=(N, 1))
    padding_mask = np.arange(LENGTH)[None, :] < lengths
    return np.where(padding_mask, token_ids, 0), padding_mask


# One transformer layer of width 8, no dropout: BERT's and GPT-2's.
TINY_BACKBONE = {
    "vocabulary_size": VOCAB,
    "num_layers": 1,
    "num_heads": 2,
    "hidden_dim": 8,
    "intermediate_dim": 16,
    "max_sequence_length": LENGTH,
    "dropout": 0.0,
}


def bert_classifier():
    # Imported here: the JAX and PyTorch runs skip this module, and
    # importing KerasHub costs them seconds.
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.BertBackbone(**TINY_BACKBONE)
    return keras_hub.models.BertTextClassifier(
        backbone, num_classes=3, preprocessor=None, dropout=0.0
    )


def bert_data():
    token_ids, padding_mask = tokens()
    x = {
        "token_ids": token_ids,
        "segment_ids": np.zeros_like(token_ids),
        "padding_mask": padding_mask,
    }
    y = np.random.default_rng(1).integers(0, 3, size=(N,))
    return x, y, None


def gpt2_causal_lm():
    import keras_hub

    keras.utils.set_random_seed(1)
    backbone = keras_hub.models.GPT2Backbone(**TINY_BACKBONE)
    return keras_hub.models.GPT2CausalLM(backbone, preprocessor=None)


def gpt2_data():
    # What the task's preprocessor would give: the next token as the label,
    # padding out of the loss through the sample weights.
    token_ids, padding_mask = tokens()
    x = {"token_ids": token_ids[:, :-1], "padding_mask": padding_mask[:, :-1]}
    y = token_ids[:, 1:]
    sample_weight = padding_mask[:, 1:].astype("float32")
    return x, y, sample_weight


TASKS = {
    "bert_text_classifier": (bert_classifier, bert_data),
    "gpt2_causal_lm": (gpt2_causal_lm, gpt2_data),
}


def _compile(model):
    # The tasks' own default loss (and weighted metric for the causal LM),
    # with SGD in place of their Adam.
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )


@pytest.mark.parametrize("name", sorted(TASKS))
def test_from_model_trains_like_the_task_and_saves(name, tmp_path, report_diff):
    build, data = TASKS[name]
    x, y, sample_weight = data()
    plain = build()
    task = build()
    accum = keras_accum.AccumModel.from_model(task, accum_steps=K)
    # The conversion shares the task's weights: training one trains both.
    assert accum.trainable_weights == task.trainable_weights
    accum.set_weights(plain.get_weights())
    _compile(plain)
    _compile(accum)
    fit_kwargs = {}
    if sample_weight is not None:
        fit_kwargs["sample_weight"] = sample_weight
    diff, _, _ = train_pair(plain, accum, x, y, B, K, **fit_kwargs)
    report_diff(diff, f"KerasHub {name}, SGD")
    assert int(accum.optimizer.iterations) == 4
    assert any(
        float(np.max(np.abs(a - b))) > 1e-3
        for a, b in zip(task.get_weights(), build().get_weights(), strict=True)
    ), "training moved no weight of the task"

    # Saved and loaded: the loaded model trains on exactly as the original.
    path = tmp_path / f"{name}.keras"
    accum.save(path)
    loaded = keras.saving.load_model(path)
    assert isinstance(loaded, keras_accum.AccumModel)
    assert loaded.accum_steps == K
    for model in (accum, loaded):
        model.fit(
            x,
            y,
            batch_size=B,
            epochs=1,
            shuffle=False,
            verbose=0,
            **fit_kwargs,
        )
    assert int(loaded.optimizer.iterations) == 6
    for a, b in zip(accum.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-7, rtol=0)


def test_a_frozen_backbone_gets_no_accumulators():
    x, y, _ = bert_data()
    task = bert_classifier()
    frozen = [w.numpy().copy() for w in task.backbone.weights]
    task.backbone.trainable = False
    accum = keras_accum.AccumModel.from_model(task, accum_steps=K)
    _compile(accum)
    head = [w.numpy().copy() for w in task.trainable_weights]
    accum.fit(x, y, batch_size=B, shuffle=False, verbose=0)
    # The head's logits kernel and bias only.
    assert len(accum.accumulators) == len(task.trainable_weights) == 2
    for before, weight in zip(frozen, task.backbone.weights, strict=True):
        np.testing.assert_array_equal(before, weight.numpy())
    assert all(
        float(np.max(np.abs(b - w.numpy()))) > 1e-4
        for b, w in zip(head, task.trainable_weights, strict=True)
    )


def test_a_task_whose_preprocessor_never_ran_trains(report_diff):
    """The fine-tuning guide's case where `x` comes tokenized (from disk,
    or from another copy of the task): the task's preprocessor is never
    called, so it stays unbuilt. Before: "The model's trainable weights
    changed ... Call `compile()` again" on TensorFlow and JAX."""
    import keras_hub

    vocabulary = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocabulary += [f"word{i}" for i in range(VOCAB - len(vocabulary))]
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        keras_hub.models.BertTokenizer(vocabulary=vocabulary),
        sequence_length=LENGTH,
    )
    plain = bert_classifier()
    task = bert_classifier()
    task.preprocessor = preprocessor
    assert not preprocessor.built
    accum = keras_accum.AccumModel.from_model(task, accum_steps=K)
    accum.set_weights(plain.get_weights())
    _compile(plain)
    _compile(accum)
    x, y, _ = bert_data()
    diff, _, _ = train_pair(plain, accum, x, y, B, K)
    report_diff(diff, "KerasHub task with an unbuilt preprocessor")
    assert int(accum.optimizer.iterations) == 4
    assert not preprocessor.built


def test_lora_weights_keep_the_factors_only_not_the_biases_lora_trains(
    tmp_path,
):
    # Keras and KerasHub behaviour, which the fine-tuning guide states and
    # its `save_lora_run` handles (run on every backend by the page):
    # `save_lora_weights` writes the LoRA factors only, while
    # `enable_lora` leaves the targeted layers' biases trainable. Before,
    # the guide said the reloaded task computes what the trained one did.
    x, y, sample_weight = gpt2_data()
    task = gpt2_causal_lm()
    task.backbone.enable_lora(rank=2)
    others = [
        v
        for v in task.trainable_weights
        if not v.path.rsplit("/", 1)[-1].startswith("lora_kernel_")
    ]
    assert others and all(v.path.endswith("/bias") for v in others)
    model = keras_accum.AccumModel.from_model(task, accum_steps=K)
    _compile(model)
    model.fit(x, y, sample_weight=sample_weight, batch_size=B, verbose=0)
    assert model.mini_step == 0  # saved at a window's end
    task.backbone.save_lora_weights(tmp_path / "run.lora.h5")
    trained = keras.ops.convert_to_numpy(task.predict(x, verbose=0))

    again = gpt2_causal_lm()
    again.backbone.load_lora_weights(tmp_path / "run.lora.h5")
    logits = keras.ops.convert_to_numpy(again.predict(x, verbose=0))
    # The biases' training lost: 3.4e-4 here (float32 rounding: 1e-7).
    assert np.max(np.abs(logits - trained)) > 1e-4
    # With the biases too, the same function: nothing else trained.
    mine = {v.path: v for v in again.trainable_weights}
    for v in others:
        mine[v.path].assign(v)
    np.testing.assert_allclose(
        keras.ops.convert_to_numpy(again.predict(x, verbose=0)),
        trained,
        atol=1e-6,
    )
