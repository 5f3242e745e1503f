"""bfloat16 accumulators: bias, error per window, training and memory.

What `AccumModel(accumulator_dtype="bfloat16")` (stochastic rounding into
bfloat16 accumulators for weights of >= 2**14 elements) gives and costs,
against float32 accumulators (the default) and Keras's own
`gradient_accumulation_steps`, whose accumulators under a bfloat16 policy
are bfloat16 and round to nearest. Four sections, each in processes of its
own (the script itself with `--child`); the parent imports no Keras:

- `--bias`: a window of k one-sample micro-batches whose gradient is
  256 in every element of a 128 x 128 bias-free kernel for the first and
  0.5 for the others (loss: the sum of the outputs), k = 8, 64, 256; the
  mean and standard deviation over the 16,384 elements of the window's
  sum minus the true sum, read from the open window (JAX);
- `--error`, the error per window: an MNIST MLP 784-256-256-10 (float32
  weights), micro-batch 32, k = 2, 8, 32, 128, five windows of data: the
  window's mean gradient by each accumulation against the float64 mean of
  the same float32 micro-batch gradients, relative L2 error over the
  kernels of >= 2**14 elements, median over windows (JAX);
- `--training`: bfloat16 models (`set_dtype_policy("bfloat16")`), SGD with
  momentum 0.9 (Adam does not move bfloat16 weights), 3 seeds, k = 32 and
  128: the MNIST MLP (test accuracy, final training loss) and a small
  causal transformer language model on synthetic sequences (eval loss)
  (JAX, the fastest backend on this CPU);
- `--memory`: a bfloat16 MLP 1024-2048-2048-1024 with Adam (its weights and
  both slots bfloat16: 6 bytes a parameter; memory only, it is not
  trained), B = 32, k = 8: accumulator bytes per parameter, JAX's compiled
  step (`memory_analysis()`, exact), TensorFlow's allocator under XLA
  and under the graph executor (`TF_CPU_ALLOCATOR_USE_BFC=true`, a fresh
  process per row) and PyTorch's state bytes (no CPU allocator peak);
  then the same MLP with float32 weights (float32 policy) and Adam, JAX's
  compiled step, for the rows whose accumulators differ.

    python benchmarks/bench_low_precision.py                # ~15 min
    python benchmarks/bench_low_precision.py --training --data=PATH
    python benchmarks/bench_low_precision.py --quick --json=/tmp/lp.json

`--data` is MNIST's `mnist.npz` (x_train, y_train, x_test, y_test); where
it is missing, and always with `--quick` (a smoke run, under a minute), the
MNIST sections use synthetic images. A full run writes
benchmarks/results/low_precision.json (`--json`) and, with every section,
benchmarks/results/low_precision.md; running some sections updates those
sections of an existing full-run JSON file.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _memory
import _workers

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ROOT.parent / "shared" / "data" / "mnist" / "mnist.npz"
SECTIONS = ("bias", "error", "training", "memory")

LARGE = 2**14  # Weights of at least this many elements: bfloat16 acc.
WIDE = 128  # The bias section's 128 x 128 kernel.
BIG, SMALL = 256.0, 0.5
B = 32  # Micro-batch of the MNIST sections and the memory section.
MLP = (784, 256, 256, 10)
LM = {"vocab": 64, "seq": 32, "width": 64, "blocks": 1}
# Sequences per micro-batch: bfloat16 matmuls are slow on this CPU (about
# 20 ms a micro-batch of 32 sequences, 4 ms of 8).
LM_BATCH = 8
LM_EVAL = 2048  # Held-out sequences (the full run's; `--quick`: fewer).
MEMORY_MLP = (1024, 2048, 2048, 1024)
MEMORY_K = 8

VARIANTS = {
    "f32": "AccumModel float32",
    "bf16": "AccumModel bfloat16 (stochastic)",
    "keras": "Keras accumulation (bfloat16, to nearest)",
}
TF_MODES = ("xla", "graph")  # jit_compile=True, False.
MEMORY_ROWS = {
    "plain": "Model(B)",
    "large": "Model(B·k)",
    "keras": "Keras accumulation",
    "f32": "AccumModel float32",
    "bf16": "AccumModel bfloat16",
}
# With float32 weights: Keras's accumulators are float32 too, as ours.
FLOAT32_ROWS = ("plain", "f32", "bf16")


def _settings(quick):
    """Sizes of every section: the full run's, or `--quick`'s."""
    if quick:
        # Each model a section builds is a compile or two (most of a smoke
        # run's time): one k for the bias, one window for the error.
        return {
            "bias_ks": [8],
            "error_ks": [4],
            "windows": 1,
            "train_ks": [4],
            "seeds": [0],
            "mlp_epochs": 1,
            "lm_updates": {4: 3},
            "lm_eval": 256,
            "memory_mlp": [256, 512, 512, 256],
        }
    return {
        "bias_ks": [8, 64, 256],
        "error_ks": [2, 8, 32, 128],
        "windows": 5,
        "train_ks": [32, 128],
        "seeds": [0, 1, 2],
        "mlp_epochs": 3,
        # Sequences: 150 x 32 x 8 = 38,400 at k = 32, twice at k = 128.
        "lm_updates": {32: 150, 128: 75},
        "memory_mlp": list(MEMORY_MLP),
    }


def _mlp_lr(k):
    """SGD's learning rate for the MLP: 0.1 at batch 1024 (k = 32), times
    sqrt(k / 32) (0.2 at 4096)."""
    return 0.1 * math.sqrt(k / 32)


def _lm_lr(k):
    """The language model's: 0.5 at both k. Raised by the same rule, 1.0
    at k = 128 spiked on one seed of three (eval loss 0.55 to 1.37 against
    0.16 to 0.22 on the others) and 2.0 diverged."""
    del k
    return 0.5


# -- Shared by the measured processes ----------------------------------------


def _np(value):
    """A backend tensor (bfloat16 too) as a float64 array."""
    import keras

    value = keras.ops.cast(value, "float32")
    return keras.ops.convert_to_numpy(value).astype("float64")


def _mlp(widths, seed):
    """(inputs, outputs): a ReLU MLP of `widths`, initialized from `seed`."""
    import keras

    keras.utils.set_random_seed(seed)
    inputs = keras.Input((widths[0],))
    x = inputs
    for width in widths[1:-1]:
        x = keras.layers.Dense(width, activation="relu")(x)
    return inputs, keras.layers.Dense(widths[-1])(x)


def _variant(variant, graph, k, optimizer, carry=False, **extra):
    """The compiled model of `variant` (`f32`, `bf16`, `keras`, `plain`,
    `large`) on `graph` = (inputs, outputs), with window k. `optimizer` is
    (class, kwargs); `carry`: an `AccumModel`'s partial window stays open
    (its sums readable); `extra` goes to `compile` (loss, jit_compile)."""
    import keras

    import keras_accum

    cls, kwargs = optimizer
    if variant in ("f32", "bf16"):
        model = keras_accum.AccumModel(
            *graph,
            accum_steps=k,
            accumulator_dtype="bfloat16" if variant == "bf16" else None,
            partial_window="carry" if carry else "apply",
        )
    else:
        model = keras.Model(*graph)
        if variant == "keras":
            kwargs = {**kwargs, "gradient_accumulation_steps": k}
    model.compile(optimizer=cls(**kwargs), **extra)
    return model


def _load_mnist(path, quick):
    """((x, y), (x_test, y_test), source): MNIST from `path`, else (and
    always with `quick`) synthetic images labelled by a random linear
    teacher."""
    import numpy as np

    if not quick and path and Path(path).exists():
        with np.load(path) as d:
            x, y = d["x_train"], d["y_train"]
            xt, yt = d["x_test"], d["y_test"]

        def flat(v):
            return v.reshape(len(v), -1).astype("float32") / 255.0

        train = (flat(x), y.astype("int32"))
        return train, (flat(xt), yt.astype("int32")), "MNIST"
    rng = np.random.default_rng(0)
    n = 1024 if quick else 60000
    x = rng.random((n + 1000, 784), dtype=np.float32)
    teacher = rng.standard_normal((784, 10))
    y = np.argmax((x - 0.5) @ teacher, axis=1).astype("int32")
    return (x[:n], y[:n]), (x[n:], y[n:]), "synthetic"


def _with_policy(policy, fn, *args):
    """`fn(*args)` under the dtype policy `policy`, float32 again after."""
    import keras

    keras.config.set_dtype_policy(policy)
    try:
        return fn(*args)
    finally:
        keras.config.set_dtype_policy("float32")


# -- Bias ---------------------------------------------------------------------


def _sum_of_outputs():
    """A loss whose sample loss is the sum of its outputs: with one sample
    a micro-batch, a bias-free kernel's gradient is the input, row by row."""
    import keras

    class SumOfOutputs(keras.losses.Loss):
        def call(self, y_true, y_pred):
            return keras.ops.sum(y_pred, axis=-1)

    return SumOfOutputs()


def _biased_window(variant, k):
    """The 128 x 128 kernel's accumulator after k micro-batches (the first
    BIG, the others SMALL), read from the open window (float64)."""
    import keras
    import numpy as np

    keras.utils.set_random_seed(2)
    inputs = keras.Input((WIDE,))
    graph = (inputs, keras.layers.Dense(WIDE, use_bias=False)(inputs))
    # k + 1 with "carry": the window stays open after k steps.
    model = _variant(
        variant,
        graph,
        k + 1,
        (keras.optimizers.SGD, {}),
        carry=True,
        loss=_sum_of_outputs(),
    )
    x = np.full((k, WIDE), SMALL, "float32")
    x[0] = BIG
    model.fit(x, np.zeros_like(x), batch_size=1, verbose=0, shuffle=False)
    if variant == "keras":
        # Keras's accumulators (private; read for the comparison only).
        return _np(model.optimizer._accumulated_gradients[0])
    assert model.mini_step == k, model.mini_step
    return _np(model._window.acc_grads[0])


def _bias(settings):
    """One row per k: each variant's sum minus the true sum."""
    import keras

    rows = []
    for k in settings["bias_ks"]:
        true = BIG + (k - 1) * SMALL
        row = {"k": k, "true_sum": true}
        for variant in VARIANTS:
            policy = "bfloat16" if variant == "keras" else "float32"
            sums = _with_policy(policy, _biased_window, variant, k)
            error = sums - true
            row[variant] = {
                "mean_error": float(error.mean()),
                "std_error": float(error.std()),
                "max_abs_error": float(abs(error).max()),
                "relative_bias": float(error.mean() / true),
                "elements": int(error.size),
            }
        rows.append(row)
    return {"rows": rows, "backend": keras.backend.backend()}


# -- Error per window ---------------------------------------------------------


def _gradient_fn(model):
    """A jitted `(x, y) -> gradients` of `model`'s weights now, with the
    loss it is trained with here (sparse cross-entropy from logits, the
    mean over the batch), through `stateless_call` (JAX)."""
    import jax
    import keras

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainable = [v.value for v in model.trainable_variables]
    frozen = [v.value for v in model.non_trainable_variables]

    def loss_of(weights, x, y):
        logits, _ = model.stateless_call(weights, frozen, x, training=True)
        return loss(y, logits)

    grad = jax.jit(jax.grad(loss_of))
    return lambda x, y: grad(trainable, x, y)


def _reference(grad, xs, ys, k, large):
    """(float64 mean of the k micro-batch gradients, round-to-nearest
    bfloat16 running sum of them / k), over the weights `large`."""
    import ml_dtypes
    import numpy as np

    bf16 = ml_dtypes.bfloat16
    exact = rtn = None
    for j in range(k):
        part = slice(j * B, (j + 1) * B)
        g = [np.asarray(grad(xs[part], ys[part])[i]) for i in large]
        if exact is None:
            exact = [np.zeros(v.shape, "float64") for v in g]
            rtn = [np.zeros(v.shape, bf16) for v in g]
        for i, v in enumerate(g):
            exact[i] += v
            # As Keras's bfloat16 accumulators: the sum rounds to nearest.
            rtn[i] = (rtn[i].astype("float32") + v).astype(bf16)
    return [e / k for e in exact], [r.astype("float64") / k for r in rtn]


def _window_mean(variant, weights, data, k, seed):
    """The window's mean gradient from an `AccumModel` (`f32`/`bf16`) left
    open after k micro-batches of `data`: its accumulators / normalizer."""
    import keras

    keras.utils.set_random_seed(seed)
    model = _variant(
        variant,
        _mlp(MLP, 0),
        k + 1,
        (keras.optimizers.SGD, {}),
        carry=True,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.set_weights(weights)
    model.fit(*data, batch_size=B, verbose=0, shuffle=False)
    assert model.mini_step == k, model.mini_step
    total = float(_np(model._window.counters.acc_normalizer))
    return [_np(a) / total for a in model._window.acc_grads]


def _errors(found, exact):
    """(||found - exact|| / ||exact||, <found - exact, exact> / ||exact||²),
    over all the arrays together: the error, and its component along the
    exact gradient (negative: the sum lost magnitude, as round-to-nearest
    loses small addends)."""
    import numpy as np

    pairs = list(zip(found, exact, strict=True))
    norm = sum(float(np.sum(e * e)) for e in exact)
    error = sum(float(np.sum((f - e) ** 2)) for f, e in pairs)
    along = sum(float(np.sum((f - e) * e)) for f, e in pairs)
    return math.sqrt(error / norm), along / norm


def _error_window(models, data, k, seed):
    """The four ways' errors in one window, `{"relative_error": {way:
    value}, "along": {way: value}}` (`models`: the float32 reference and
    the bfloat16 copy's gradient functions, the large weights' indices)."""
    plain, grad, large_grad, large = models
    xs, ys = data
    exact, rtn = _reference(grad, xs, ys, k, large)
    weights = plain.get_weights()
    found = {"rtn": rtn}
    for variant in ("f32", "bf16"):
        means = _window_mean(variant, weights, data, k, seed)
        found[variant] = [means[i] for i in large]
    whole = large_grad(xs, ys)
    found["large_bf16"] = [_np(whole[i]) for i in large]
    errors = {name: _errors(g, exact) for name, g in found.items()}
    return {
        "relative_error": {name: e[0] for name, e in errors.items()},
        "along": {name: e[1] for name, e in errors.items()},
    }


def _error(settings, data_path):
    """Rows per k: each way's relative error, per window and the median."""
    import keras
    import numpy as np

    (x, y), _, source = _load_mnist(data_path, settings["quick"])
    plain = keras.Model(*_mlp(MLP, 0))
    large = [
        i
        for i, v in enumerate(plain.trainable_weights)
        if math.prod(v.shape) >= LARGE
    ]
    low = _with_policy("bfloat16", lambda: keras.Model(*_mlp(MLP, 0)))
    low.set_weights(plain.get_weights())
    models = (plain, _gradient_fn(plain), _gradient_fn(low), large)
    rows = []
    stride = B * max(settings["error_ks"])
    for k in settings["error_ks"]:
        windows = []
        for w in range(settings["windows"]):
            part = slice(w * stride, w * stride + B * k)
            data = (x[part], y[part])
            windows.append(_error_window(models, data, k, seed=100 + w))
        row = {"k": k, "windows": windows}
        for figure, ways in windows[0].items():
            row[figure] = {
                way: float(np.median([w[figure][way] for w in windows]))
                for way in ways
            }
        rows.append(row)
    sizes = [list(plain.trainable_weights[i].shape) for i in large]
    return {"rows": rows, "data": source, "weights": sizes}


# -- Training -----------------------------------------------------------------


def _train_mlp(variant, k, seed, settings, data):
    """One bfloat16 MLP run: test accuracy and final training loss."""
    import keras
    import numpy as np

    (x, y), (xt, yt), _ = data
    n = len(x) // (B * k) * (B * k)  # Whole windows only.
    x, y = x[:n], y[:n]
    model = _variant(
        variant,
        _mlp(MLP, seed),
        k,
        (keras.optimizers.SGD, {"learning_rate": _mlp_lr(k), "momentum": 0.9}),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(seed)
    for _ in range(settings["mlp_epochs"]):
        order = rng.permutation(n)
        model.fit(x[order], y[order], batch_size=B, verbose=0, shuffle=False)
    logits = model.predict(xt, batch_size=1000, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, -1) == yt))
    train_logits = model.predict(x[:10000], batch_size=1000, verbose=0)
    loss = _cross_entropy(train_logits, y[:10000])
    return {"test_accuracy": accuracy, "train_loss": loss, "samples": n}


def _cross_entropy(logits, labels, weights=None):
    """The (weighted) mean cross-entropy of `logits`, in float64."""
    import numpy as np

    z = np.asarray(logits, "float64")
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, labels[..., None], -1)[..., 0]
    if weights is None:
        return float(nll.mean())
    return float((nll * weights).sum() / weights.sum())


def _sequences(n, rng):
    """(x, y, mask): n arithmetic progressions mod 63 of tokens 1..63 (a
    random start and step 1..7), of random lengths 8..33, padded with 0;
    next-token prediction, the mask 1 on real targets."""
    import numpy as np

    seq = LM["seq"]
    start = rng.integers(0, 63, n)[:, None]
    step = rng.integers(1, 8, n)[:, None]
    length = rng.integers(8, seq + 2, n)[:, None]
    i = np.arange(seq + 1)
    tokens = np.where(i < length, (start + step * i) % 63 + 1, 0)
    x, y = tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    return x, y, (y != 0).astype("float32")


def _positions():
    """A learned positional embedding added to its input."""
    import keras

    class Positions(keras.layers.Layer):
        def build(self, shape):
            self.table = self.add_weight(
                shape=tuple(shape[1:]),
                initializer=keras.initializers.RandomNormal(stddev=0.02),
            )

        def call(self, x):
            return x + keras.ops.cast(self.table, x.dtype)[None]

    return Positions()


def _lm(seed):
    """(inputs, outputs): a pre-norm causal transformer, LM's sizes; the
    feed-forward kernels (64 x 256) get bfloat16 accumulators."""
    import keras

    keras.utils.set_random_seed(seed)
    width = LM["width"]
    inputs = keras.Input((LM["seq"],), dtype="int32")
    x = keras.layers.Embedding(LM["vocab"], width)(inputs)
    x = _positions()(x)
    for _ in range(LM["blocks"]):
        h = keras.layers.LayerNormalization()(x)
        attention = keras.layers.MultiHeadAttention(4, width // 4)
        x = x + attention(h, h, use_causal_mask=True)
        h = keras.layers.LayerNormalization()(x)
        h = keras.layers.Dense(4 * width, activation="gelu")(h)
        x = x + keras.layers.Dense(width)(h)
    x = keras.layers.LayerNormalization()(x)
    return inputs, keras.layers.Dense(LM["vocab"])(x)


def _train_lm(variant, k, seed, settings, data):
    """One bfloat16 language-model run: the eval set's token-weighted
    cross-entropy. Fresh sequences for every update (`seed`'s)."""
    import keras
    import numpy as np

    del data
    updates = settings["lm_updates"][k]
    x, y, mask = _sequences(updates * k * LM_BATCH, np.random.default_rng(seed))
    model = _variant(
        variant,
        _lm(seed),
        k,
        (keras.optimizers.SGD, {"learning_rate": _lm_lr(k), "momentum": 0.9}),
        # The mask as sample weights; "sum_over_batch_size" divides by the
        # micro-batch's entries, the same in every micro-batch: each real
        # token weighs the same, in Keras's accumulation too.
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(
        x, y, sample_weight=mask, batch_size=LM_BATCH, verbose=0, shuffle=False
    )
    evals = settings.get("lm_eval", LM_EVAL)
    xe, ye, me = _sequences(evals, np.random.default_rng(10_000))
    logits = model.predict(xe, batch_size=min(512, evals), verbose=0)
    return {"eval_loss": _cross_entropy(logits, ye, me), "updates": updates}


def _training(job, settings, data_path):
    """Every variant and seed of one model at one k (`train:MODEL:K`)."""
    _, name, k = job.split(":")
    k = int(k)
    train = {"mlp": _train_mlp, "lm": _train_lm}[name]
    data = _load_mnist(data_path, settings["quick"]) if name == "mlp" else None
    runs = []
    for variant in VARIANTS:
        for seed in settings["seeds"]:
            start = time.process_time()
            found = _with_policy(
                "bfloat16", train, variant, k, seed, settings, data
            )
            found["cpu_s"] = time.process_time() - start
            runs.append({"variant": variant, "seed": seed, **found})
    return {
        "model": name,
        "k": k,
        "data": data[2] if data else "synthetic sequences",
        "learning_rate": (_mlp_lr if name == "mlp" else _lm_lr)(k),
        "runs": runs,
    }


# -- Memory -------------------------------------------------------------------


def _memory_model(row, widths, jit_compile, policy="bfloat16"):
    """(model, x, y, batch, counts): a `MEMORY_ROWS` row of the MLP
    `widths` under `policy` with Adam (weights and slots bfloat16 under
    the default policy), B·k samples."""
    import keras
    import numpy as np

    def build():
        return _variant(
            row,
            _mlp(widths, 0),
            MEMORY_K,
            (keras.optimizers.Adam, {"learning_rate": 1e-3}),
            loss="mse",
            jit_compile=jit_compile,
        )

    model = _with_policy(policy, build)
    rng = np.random.default_rng(0)
    n = B * MEMORY_K
    x = rng.standard_normal((n, widths[0])).astype("float32")
    y = rng.standard_normal((n, widths[-1])).astype("float32")
    sizes = [math.prod(v.shape) for v in model.trainable_weights]
    counts = {
        "params": sum(sizes),
        "large_params": sum(s for s in sizes if s >= LARGE),
    }
    return model, x, y, (n if row == "large" else B), counts


def _nbytes(variables):
    """Bytes of `variables`, from their dtypes and shapes."""
    import numpy as np

    return sum(
        math.prod(v.shape) * np.dtype(_np_dtype(v.dtype)).itemsize
        for v in variables
    )


def _np_dtype(dtype):
    import keras
    import ml_dtypes

    name = keras.backend.standardize_dtype(dtype)
    return ml_dtypes.bfloat16 if name == "bfloat16" else name


def _accumulators(model, row):
    """The accumulators of `row`'s model: Keras's or the window's."""
    if row == "keras":
        return list(model.optimizer._accumulated_gradients)
    if row in ("f32", "bf16"):
        return list(model._window.acc_grads)
    return []


def _memory_jax(settings, policy="bfloat16"):
    """Every row's compiled step figures, in this one process (exact)."""
    import jax

    rows = {}
    for row in MEMORY_ROWS if policy == "bfloat16" else FLOAT32_ROWS:
        model, x, y, batch, counts = _memory_model(
            row, settings["memory_mlp"], jit_compile=True, policy=policy
        )
        model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
        state = model._get_jax_state(
            trainable_variables=True,
            non_trainable_variables=True,
            optimizer_variables=True,
            metrics_variables=True,
        )
        # As Keras compiles the step (`donate_argnums=0`).
        step = jax.jit(model.train_step, donate_argnums=0)
        found = step.lower(state, (x[:batch], y[:batch])).compile()
        found = found.memory_analysis()
        rows[row] = {
            **counts,
            "accumulator_bytes": _nbytes(_accumulators(model, row)),
            "argument_bytes": found.argument_size_in_bytes,
            "temp_bytes": found.temp_size_in_bytes,
            "output_bytes": found.output_size_in_bytes,
            "alias_bytes": found.alias_size_in_bytes,
        }
    return rows


def _memory_tensorflow(row, settings, xla):
    """One row's allocator figures (a fresh process), under XLA or the
    graph executor: what the process holds after a first window, and the
    next window's peak over that."""
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info
    before = info("CPU:0")["current"]
    model, x, y, batch, counts = _memory_model(
        row, settings["memory_mlp"], jit_compile=xla
    )
    # A first window: optimizer slots, accumulators, the traced step.
    model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
    tf.config.experimental.reset_memory_stats("CPU:0")
    held = info("CPU:0")["current"]
    model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
    return {
        **counts,
        "accumulator_bytes": _nbytes(_accumulators(model, row)),
        "held_bytes": held - before,
        "step_peak_bytes": info("CPU:0")["peak"] - held,
    }


def _memory_torch(settings):
    """Every row's state bytes: weights, optimizer variables and the
    window's accumulators, each counted once (no CPU allocator peak)."""
    rows = {}
    for row in MEMORY_ROWS:
        model, x, y, batch, counts = _memory_model(
            row, settings["memory_mlp"], jit_compile=False
        )
        model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)
        accumulators = _accumulators(model, row)
        state = {}
        for v in [*model.weights, *model.optimizer.variables, *accumulators]:
            state[id(v)] = v
        rows[row] = {
            **counts,
            "accumulator_bytes": _nbytes(accumulators),
            "state_bytes": _nbytes(state.values()),
        }
    return rows


# -- The measured processes ---------------------------------------------------


def _child_job(job, settings, data_path):
    """What one job (`bias`, `error`, `train:M:K`, `memory:jax`,
    `memory:torch`, `memory:tensorflow:ROW:xla|graph`) measures, in this
    process."""
    if job == "bias":
        return _bias(settings)
    if job == "error":
        return _error(settings, data_path)
    if job.startswith("train:"):
        return _training(job, settings, data_path)
    if job == "memory:jax":
        return _memory_jax(settings)
    if job == "memory:jax:float32":
        return _memory_jax(settings, policy="float32")
    if job == "memory:torch":
        return _memory_torch(settings)
    if job.startswith("memory:tensorflow:"):
        _, _, row, mode = job.split(":")
        return _memory_tensorflow(row, settings, xla=mode == "xla")
    raise ValueError(f"unknown job {job!r}")


def _revision():
    """The checkout's commit, with "+changes" where the package differs
    from it (the package changing under a run would mix versions)."""

    def git(*command):
        return subprocess.run(
            ["git", *command],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", "keras_accum")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+changes" if changed else "")


def _child(args):
    """Runs the jobs of `--child`; prints their results as the last line."""
    revision = _revision()
    _workers.without_tensorflow()
    import keras

    settings = {**_settings(args.quick), "quick": args.quick}
    results = {}
    for job in args.child.split(","):
        start = time.time()
        results[job] = _child_job(job, settings, args.data)
        results[job]["wall_s"] = time.time() - start
    print(
        json.dumps(
            {
                "backend": keras.backend.backend(),
                "keras": keras.__version__,
                "revision": revision,
                "jobs": results,
            }
        )
    )


def _run(args, backend, jobs):
    """The results of `jobs` from a fresh process on `backend`."""
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "JAX_PLATFORMS": "cpu",
        "TF_CPP_MIN_LOG_LEVEL": "3",
        # Allocator statistics on every CPU (TensorFlow keeps them only as
        # the BFC allocator, its default only where it enables oneDNN).
        "TF_CPU_ALLOCATOR_USE_BFC": "true",
    }
    child = [f"--child={','.join(jobs)}", f"--data={args.data}"]
    if args.quick:
        child.append("--quick")
    start = time.time()
    found = _memory.run_child(__file__, child, env, timeout=3600)
    if "error" in found:
        sys.exit(f"{backend} {jobs} failed:\n{found['error']}")
    print(f"  {','.join(jobs)} ({backend}): {time.time() - start:.0f} s")
    return found


def _plan(args, sections, settings):
    """[(backend, jobs)]: the processes to run, JAX's first. `--quick`
    runs the JAX jobs in one process (seconds, not minutes)."""
    jax_jobs = [[s] for s in ("bias", "error") if s in sections]
    if "training" in sections:
        for model in ("mlp", "lm"):
            jax_jobs += [[f"train:{model}:{k}"] for k in settings["train_ks"]]
    backends = args.memory_backends.split(",")
    memory = "memory" in sections
    if memory and "jax" in backends:
        jax_jobs.append(["memory:jax", "memory:jax:float32"])
    if args.quick and jax_jobs:
        jax_jobs = [[job for jobs in jax_jobs for job in jobs]]
    plan = [("jax", jobs) for jobs in jax_jobs]
    if memory and "tensorflow" in backends:
        # A fresh process per row: the allocator's figures are absolute.
        plan += [
            ("tensorflow", [f"memory:tensorflow:{row}:{mode}"])
            for mode in TF_MODES
            for row in MEMORY_ROWS
        ]
    if memory and "torch" in backends:
        plan.append(("torch", ["memory:torch"]))
    return plan


def _spread(values):
    """{mean, std (n - 1), min, max, values} of per-seed `values`."""
    import statistics

    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def _training_rows(found):
    """Per (model, k, variant): each metric's mean and spread over seeds."""
    rows = []
    for job, result in found.items():
        if not job.startswith("train:"):
            continue
        metrics = ("test_accuracy", "train_loss", "eval_loss")
        for variant in VARIANTS:
            runs = [r for r in result["runs"] if r["variant"] == variant]
            row = {
                "model": result["model"],
                "k": result["k"],
                "variant": variant,
                "learning_rate": result["learning_rate"],
                "data": result["data"],
                "seeds": [r["seed"] for r in runs],
                "cpu_s": sum(r["cpu_s"] for r in runs),
            }
            for metric in metrics:
                if metric in runs[0]:
                    row[metric] = _spread([r[metric] for r in runs])
            rows.append(row)
    return rows


def _memory_rows(found, policy="bfloat16"):
    """Per row: accumulator bytes and each backend's figures, also as
    bytes per parameter over Model(B). With float32 weights, JAX's."""
    if policy == "float32":
        by = {"jax": found.get("memory:jax:float32", {})}
    else:
        by = {
            "jax": found.get("memory:jax", {}),
            "torch": found.get("memory:torch", {}),
        }
    for mode in TF_MODES if policy == "bfloat16" else ():
        by[f"tensorflow_{mode}"] = {
            row: found[f"memory:tensorflow:{row}:{mode}"]
            for row in MEMORY_ROWS
            if f"memory:tensorflow:{row}:{mode}" in found
        }

    def total(backend, r):
        if backend == "jax":
            return r["argument_bytes"] + r["temp_bytes"]
        if backend == "torch":
            return r["state_bytes"]
        return r["held_bytes"] + r["step_peak_bytes"]

    rows = []
    for row, label in MEMORY_ROWS.items():
        if policy == "float32" and row not in FLOAT32_ROWS:
            continue
        out = {"row": row, "label": label}
        for backend, figures in by.items():
            if row not in figures:
                continue
            f = figures[row]
            out.update(params=f["params"], large_params=f["large_params"])
            out["accumulator_bytes_per_param"] = (
                f["accumulator_bytes"] / f["params"]
            )
            plain = total(backend, figures["plain"])
            keep = {k: v for k, v in f.items() if k.endswith("_bytes")}
            out[backend] = {
                **keep,
                "total_bytes": total(backend, f),
                "over_plain_per_param": (total(backend, f) - plain)
                / f["params"],
            }
        rows.append(out)
    return rows


def _assemble(found, sections):
    """The report's sections from the jobs' results."""
    report = {}
    if "bias" in sections:
        report["bias"] = found["bias"]
    if "error" in sections:
        report["error"] = found["error"]
    if "training" in sections:
        report["training"] = {"backend": "jax", "rows": _training_rows(found)}
    if "memory" in sections:
        rows = _memory_rows(found)
        large, params = rows[0]["large_params"], rows[0]["params"]
        report["memory"] = {
            "model": "-".join(map(str, found["_settings"]["memory_mlp"])),
            "micro_batch": B,
            "k": MEMORY_K,
            "optimizer": "Adam (bfloat16 slots; memory only, not trained)",
            # What bfloat16 accumulators should add over Model(B): 2 bytes
            # per element of the large weights, 4 of the small ones.
            "expected_bf16_bytes_per_param": (2 * large + 4 * (params - large))
            / params,
            "rows": rows,
        }
        if "memory:jax:float32" in found:
            report["memory_float32"] = {
                "model": report["memory"]["model"],
                "micro_batch": B,
                "k": MEMORY_K,
                "optimizer": "Adam (float32 weights and slots)",
                "rows": _memory_rows(found, policy="float32"),
            }
    return report


# -- Tables -------------------------------------------------------------------


def _table(header, rows):
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


def _bias_table(section):
    header = ["k", "true sum"]
    for label in VARIANTS.values():
        header.append(f"{label}: mean (std) of sum − true")
    header.append("relative bias of the window mean (f32 / Keras / ours)")
    rows = []
    for r in section["rows"]:
        cells = [r["k"], f"{r['true_sum']:g}"]
        for v in VARIANTS:
            cells.append(f"{r[v]['mean_error']:+.4g} ({r[v]['std_error']:.3g})")
        cells.append(
            " / ".join(
                f"{r[v]['relative_bias']:+.2e}"
                for v in ("f32", "keras", "bf16")
            )
        )
        rows.append(cells)
    return _table(header, rows)


def _error_table(section, figure, digits):
    header = [
        "",
        "(a) AccumModel float32",
        "(b) AccumModel bfloat16 stochastic",
        "(c) bfloat16 to nearest (Keras's way)",
        "(d) bfloat16 model, whole B·k batch",
    ]
    ways = ("f32", "bf16", "rtn", "large_bf16")
    rows = [
        [f"k = {r['k']}"] + [f"{r[figure][n]:{digits}}" for n in ways]
        for r in section["rows"]
    ]
    return _table(header, rows)


def _training_table(section, model):
    metrics = {
        "mlp": ("test_accuracy", "train_loss"),
        "lm": ("eval_loss",),
    }[model]
    header = ["k", "batch", "lr", "variant"]
    header += [f"{m}: mean ± std (seeds)" for m in metrics]
    rows = []
    batch = B if model == "mlp" else LM_BATCH
    for r in section["rows"]:
        if r["model"] != model:
            continue
        cells = [r["k"], batch * r["k"], f"{r['learning_rate']:g}"]
        cells.append(VARIANTS[r["variant"]])
        for m in metrics:
            s = r[m]
            seeds = ", ".join(f"{v:.4f}" for v in s["values"])
            cells.append(f"{s['mean']:.4f} ± {s['std']:.4f} ({seeds})")
        rows.append(cells)
    return _table(header, rows)


def _memory_tables(section):
    """JAX's table (with the accumulator bytes), TensorFlow's, PyTorch's:
    those with figures."""
    mib = 2**20
    tables = {"jax": [], "tensorflow": [], "torch": []}
    for r in section["rows"]:
        j = r.get("jax")
        if j:
            tables["jax"].append(
                [r["label"], f"{r['accumulator_bytes_per_param']:.3f}"]
                + [
                    f"{j[name] / mib:.2f}"
                    for name in ("argument_bytes", "temp_bytes", "total_bytes")
                ]
                + [f"{j['over_plain_per_param']:+.3f}"]
            )
        cells = [r["label"]]
        for mode in TF_MODES:
            f = r.get(f"tensorflow_{mode}")
            if f:
                cells += [
                    f"{f['held_bytes'] / mib:.2f}",
                    f"{f['step_peak_bytes'] / mib:.2f}",
                    f"{f['over_plain_per_param']:+.3f}",
                ]
        if len(cells) > 1:
            tables["tensorflow"].append(cells)
        t = r.get("torch")
        if t:
            tables["torch"].append(
                [
                    r["label"],
                    f"{t['state_bytes'] / mib:.2f}",
                    f"{t['over_plain_per_param']:+.3f}",
                ]
            )
    return [
        _table(_MEMORY_HEADERS[b], rows) for b, rows in tables.items() if rows
    ]


_OVER = "over Model(B), bytes / param"
_MEMORY_HEADERS = {
    "jax": [
        "",
        "accumulator bytes / param",
        "JAX argument MiB",
        "JAX temp MiB",
        "JAX argument + temp MiB",
        _OVER,
    ],
    "tensorflow": [""]
    + [
        f"{name} {figure}"
        for name in ("TF XLA", "TF graph")
        for figure in (
            "held MiB",
            "step peak over held MiB",
            f"held + peak {_OVER}",
        )
    ],
    "torch": ["", "PyTorch state MiB", _OVER],
}


def _notes(report):
    """A paragraph per section: how its figures are computed."""
    settings = report["settings"]
    updates = ", ".join(
        f"{n} updates at k = {k}" for k, n in settings["lm_updates"].items()
    )
    notes = {
        "bias": "The kernel's accumulator after k one-sample micro-batches,"
        " read from the open window (`accum_steps=k + 1`, "
        '`partial_window="carry"`; Keras\'s from '
        "`optimizer._accumulated_gradients`), minus the true sum "
        "256 + 0.5 (k − 1): mean and standard deviation over the 16,384 "
        "elements. JAX.",
        "error": "g_j: each micro-batch's float32 gradient (`jax.grad` of "
        "the sparse cross-entropy, the mean over the micro-batch, through "
        "`model.stateless_call`); the reference: their float64 mean. (a), "
        "(b): an `AccumModel` left open after the k micro-batches, its "
        "accumulators / `acc_normalizer`; (c): acc = bfloat16(float32(acc)"
        " + g_j) with ml_dtypes (round to nearest even, as Keras's "
        "bfloat16 accumulators round), / k; (d): the gradient of the whole "
        "B·k batch with the same weights in a model built under the "
        "bfloat16 policy (bfloat16 weights and activations). JAX.",
        "mlp": "Test accuracy on the 10,000 test images; training loss: "
        "float64 cross-entropy on the first 10,000 training images after "
        f"training. {settings['mlp_epochs']} epoch(s) of the training "
        "images cut to whole windows, shuffled by the seed (the same order "
        "and initial weights for every variant); learning rate "
        "0.1 · sqrt(k / 32).",
        "lm": f"Vocabulary {LM['vocab']}, sequence {LM['seq']}, width "
        f"{LM['width']}, {LM['blocks']} pre-norm block(s) (4 heads, causal "
        "mask), feed-forward kernels 64 x 256 (bfloat16 accumulators). "
        "Sequences: arithmetic progressions mod 63 (tokens 1..63, random "
        "start, step 1..7), lengths 8..33 padded with 0, next-token "
        "targets, the padding mask as sample weights; fresh sequences "
        f"every update, {updates} (k = 128 sees twice the sequences). Eval: "
        f"token-weighted cross-entropy on "
        f"{settings.get('lm_eval', LM_EVAL):,} held-out sequences (floor "
        "about 0.10: the second token is a guess among 7). Learning rate "
        "0.5 at both k (1.0 at k = 128 spiked on one seed of three).",
    }
    if "memory" in report:
        notes["memory"] = (
            "Accumulator bytes from the accumulators' dtypes and sizes "
            "(Keras's `optimizer._accumulated_gradients`, ours "
            "`model._window.acc_grads`) over the trainable parameters. JAX:"
            " `jax.jit(model.train_step, donate_argnums=0).lower(state, "
            "micro-batch).compile().memory_analysis()` after a first "
            "window. TensorFlow: `get_memory_info('CPU:0')`, held: current "
            "after a first window less before building; step peak: the "
            "peak over a second window less held. PyTorch: weights, "
            "optimizer variables and window accumulators. bfloat16 "
            "accumulators should add "
            f"{report['memory']['expected_bf16_bytes_per_param']:.4f} "
            "bytes / param over Model(B) (2 per element of the large "
            "weights, 4 of the small ones)."
        )
    return notes


def _markdown(report):
    """The report's tables, with a line on what each shows."""
    parts = []
    notes = _notes(report)
    if "bias" in report:
        parts += [
            "### Bias: first gradient 256, then 0.5 (128 x 128 kernel)",
            notes["bias"],
            _bias_table(report["bias"]),
        ]
    if "error" in report:
        parts += [
            "### Error of the window's mean gradient (MLP "
            f"{'-'.join(map(str, MLP))}, B = {B}, {report['error']['data']},"
            " relative L2 over the kernels of >= 2**14 elements, median "
            f"over {len(report['error']['rows'][0]['windows'])} windows)",
            notes["error"],
            _error_table(report["error"], "relative_error", ".2e"),
            "Component of the error along the reference, <g - g_ref, g_ref>"
            " / ||g_ref||² (median; negative: the mean lost magnitude)",
            _error_table(report["error"], "along", "+.1e"),
        ]
    if "training" in report:
        parts += [
            f"### Training, bfloat16 MLP {'-'.join(map(str, MLP))}, "
            f"SGD momentum 0.9, micro-batch {B} (JAX)",
            notes["mlp"],
            _training_table(report["training"], "mlp"),
            "### Training, bfloat16 causal transformer LM, SGD momentum "
            f"0.9, micro-batch {LM_BATCH} sequences (JAX)",
            notes["lm"],
            _training_table(report["training"], "lm"),
        ]
    if "memory" in report:
        m = report["memory"]
        parts += [
            f"### Memory, bfloat16 MLP {m['model']}, {m['optimizer']}, "
            f"B = {m['micro_batch']}, k = {m['k']}",
            notes["memory"],
            *_memory_tables(m),
        ]
    if "memory_float32" in report:
        m = report["memory_float32"]
        parts += [
            f"### Memory, float32 MLP {m['model']}, {m['optimizer']}, "
            f"B = {m['micro_batch']}, k = {m['k']} (JAX)",
            "As above, under the float32 policy: JAX's compiled step.",
            *_memory_tables(m),
        ]
    return "\n\n".join(parts) + "\n"


# -- The parent ---------------------------------------------------------------


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for section in SECTIONS:
        parser.add_argument(
            f"--{section}",
            action="store_true",
            help=f"run the {section} section",
        )
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--data", default=str(DATA), help="MNIST's .npz")
    parser.add_argument(
        "--json", help="results file (default results/low_precision.json)"
    )
    parser.add_argument(
        "--md", help="tables file (default results/low_precision.md)"
    )
    parser.add_argument(
        "--memory-backends",
        help="of jax, tensorflow, torch (default: all; --quick: jax)",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def _merged(path, report):
    """`report` over the sections of a full run's results at `path`."""
    if report["quick"] or not path.exists():
        return report
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        return report
    if old.get("quick"):
        return report
    revisions = set(old.get("revisions", [])) | set(report["revisions"])
    return {
        **old,
        **report,
        "revisions": sorted(revisions),
        "wall_s": {**old.get("wall_s", {}), **report["wall_s"]},
    }


def main():
    args = _parser().parse_args()
    if args.child:
        _child(args)
        return
    if args.memory_backends is None:
        args.memory_backends = "jax" if args.quick else "jax,tensorflow,torch"
    sections = [s for s in SECTIONS if getattr(args, s)] or list(SECTIONS)
    settings = _settings(args.quick)
    start = time.time()
    found = {"_settings": settings}
    versions, revisions = {}, set()
    for backend, jobs in _plan(args, sections, settings):
        result = _run(args, backend, jobs)
        versions[backend] = result["keras"]
        revisions.add(result["revision"] or "unknown")
        found.update(result["jobs"])
    if len(revisions) > 1:
        print(f"warning: the package changed during the run: {revisions}")
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "keras": sorted(set(versions.values())),
        },
        "quick": args.quick,
        "revisions": sorted(revisions),
        "settings": settings,
        "wall_s": {"total": time.time() - start}
        | {job: r["wall_s"] for job, r in found.items() if "wall_s" in r},
        **_assemble(found, sections),
    }
    out = Path(args.json) if args.json else None
    if out is None and not args.quick:
        out = RESULTS / "low_precision.json"
    tables = _markdown(report)
    print(tables)
    if out is not None:
        report = _merged(out, report)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {out}")
    md = Path(args.md) if args.md else None
    if md is None and not args.quick and all(s in report for s in SECTIONS):
        md = RESULTS / "low_precision.md"
    if md is not None:
        md.write_text(_header(report) + _markdown(report))
        print(f"wrote {md}")


def _header(report):
    """The .md file's opening: what the tables are, where they came from."""
    return (
        "# bfloat16 accumulators: `benchmarks/bench_low_precision.py`\n\n"
        f"{report['machine']['cpus']} CPUs, Keras "
        f"{', '.join(report['machine']['keras'])}, keras-accum at "
        f"{', '.join(report['revisions'])}; total wall time "
        f"{report['wall_s']['total'] / 60:.1f} min. How each figure is "
        "computed: the script's docstring and "
        "benchmarks/results/low_precision.json.\n\n"
    )


if __name__ == "__main__":
    main()
