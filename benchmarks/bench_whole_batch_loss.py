"""`whole_batch_loss`: the largest batch a memory budget holds, and its speed.

On a two-tower encoder trained with CLIP's symmetric InfoNCE loss and a
learnable temperature (a small conv tower for the images, an MLP for
the "text" features, both to a 64-d unit embedding), each backend in a
worker process of its own (this script with `--worker BACKEND`):

1. Memory (JAX and TensorFlow). The largest batch whose train step's peak
   fits `--budget-mib`, found by doubling and then bisection on the
   measured peak, for
   - `keras`: `keras.Model` at the batch;
   - `accum`: the classic accumulation, `AccumModel(accum_steps=k)` fed
     micro-batches: its figure is the largest micro-batch, which is also
     the most samples its loss ever sees (each micro-batch's own);
   - `whole`: `AccumModel(micro_batch_size=m, whole_batch_loss=True)`,
     its loss on the whole batch.
   The peak, state and batch included: on JAX, XLA's compiled memory
   analysis of the step (`_sizing.compiled_peak`; it compiles and runs
   nothing, so large batches cost only a compile); on TensorFlow, the
   allocator's in-use peak during the step's second run at that size
   (`TF_CPU_ALLOCATOR_USE_BFC=true`) less what was in use before it, plus
   the bytes of the model's variables and of the batch (made tensors
   before the measure). Then the peak of `whole` at its largest batch is
   split into the micro-batch step's (`keras` at `--micro-batch`), the
   batch's other inputs, its outputs and their gradient, and the rest (on
   JAX, the loss's own compiled value-and-gradient at that batch is shown
   beside it: its `B x B` logits).
2. Speed (all three backends). CPU time per sample (`time.process_time`)
   of one epoch of `fit` at `--batch`, for `keras`, `whole` and `split`
   (`AccumModel(micro_batch_size=m)`, the same pieces each with its own
   loss), `m` being `--speed-micro-batch`, after a warm-up, in `--rounds`
   interleaved rounds: the median of the rounds' ratios of `whole` to
   `keras` and their quartiles, and of `split` to `keras`, `whole` to
   `split` (what the loss over the whole batch adds to the pieces).
3. Profile (PyTorch, `--profile`). Where the train step at `--batch`
   spends its CPU time, for `keras`, `split` and `whole`: each phase's
   milliseconds a step (pass 1's forward, the forward with gradients,
   the backward, the loss and its output gradient, the window's adds,
   the update, ...: the functions that make them wrapped while timed,
   each call's time less its nested phases'), and the ops' self CPU
   time in each phase (`torch.profiler`).

    python benchmarks/bench_whole_batch_loss.py              # all three
    python benchmarks/bench_whole_batch_loss.py --backends=jax --no-speed
    python benchmarks/bench_whole_batch_loss.py --backends=jax --quick
    python benchmarks/bench_whole_batch_loss.py --backends=torch --no-memory \
        --no-speed --profile --torch-threads=1

Results go to benchmarks/results/whole_batch_loss.json.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
EMBED = 64
TEXT_FEATURES = 64


def _import_example():
    """The retrieval example's temperature layer, pair layer and loss."""
    sys.path.insert(0, str(ROOT / "examples"))
    import contrastive_retrieval

    return contrastive_retrieval


def build(variant, args, micro_batch):
    """The two-tower model as `variant`, compiled: `keras`, `accum`
    (`accum_steps`), `whole` (`whole_batch_loss`) or `split` (each piece
    its own loss), the last two in pieces of `micro_batch`."""
    import keras

    import keras_accum

    example = _import_example()
    keras.utils.set_random_seed(0)
    size, width = args.image_size, args.width
    image = keras.Input((size, size, 3), name="image")
    if args.image_tower == "conv":
        conv = keras.layers.Conv2D
        h = conv(width, 3, padding="same", activation="relu")(image)
        h = conv(width, 3, padding="same", activation="relu")(h)
        h = keras.layers.MaxPooling2D()(h)
        h = conv(2 * width, 3, padding="same", activation="relu")(h)
        h = keras.layers.GlobalAveragePooling2D()(h)
    else:
        h = keras.layers.Flatten()(image)
        h = keras.layers.Dense(32 * width, activation="relu")(h)
        h = keras.layers.Dense(32 * width, activation="relu")(h)
    h = keras.layers.Dense(EMBED)(h)
    image_embedding = keras.layers.UnitNormalization()(h)
    text = keras.Input((TEXT_FEATURES,), name="text")
    t = keras.layers.Dense(EMBED, activation="relu")(text)
    t = keras.layers.Dense(EMBED)(t)
    text_embedding = keras.layers.UnitNormalization()(t)
    scaled = example.LogitScale(name="temperature")(image_embedding)
    outputs = example.Pair(name="pair")(scaled, text_embedding)
    inputs = {"image": image, "text": text}
    if variant == "keras":
        model = keras.Model(inputs, outputs)
    elif variant == "accum":
        model = keras_accum.AccumModel(
            inputs, outputs, accum_steps=args.accum_steps
        )
    else:
        model = keras_accum.AccumModel(
            inputs,
            outputs,
            micro_batch_size=micro_batch,
            whole_batch_loss=variant == "whole",
        )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=example.clip_loss)
    return model


def data(rows, args, seed=0):
    """`rows` pairs of random images and text features, and dummy labels."""
    import numpy as np

    rng = np.random.default_rng(seed)
    size = args.image_size
    x = {
        "image": rng.random((rows, size, size, 3), dtype=np.float32),
        "text": rng.standard_normal((rows, TEXT_FEATURES), dtype=np.float32),
    }
    return x, np.zeros((rows,), "float32")


def _variable_bytes(model):
    """The bytes of the model's and its optimizer's variables."""
    import numpy as np

    variables = list(model.variables) + list(model.optimizer.variables)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables
    )


# -- Peaks ---------------------------------------------------------------------


def jax_peak(model, rows, args):
    """The compiled train step's peak at `rows` samples (JAX): state,
    batch, outputs not aliased to the state, temporaries."""
    import jax

    from keras_accum import _sizing

    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
    )
    size = args.image_size
    batch = (
        {
            "image": jax.ShapeDtypeStruct((rows, size, size, 3), "float32"),
            "text": jax.ShapeDtypeStruct((rows, TEXT_FEATURES), "float32"),
        },
        jax.ShapeDtypeStruct((rows,), "float32"),
    )

    # A new function each time: `jax.jit` caches a trace by the function.
    def step(state, data):
        return model.train_step(state, data)

    # As Keras compiles the step (`donate_argnums=0`).
    compiled = jax.jit(step, donate_argnums=0).lower(state, batch).compile()
    return _sizing.compiled_peak(compiled.memory_analysis())


def jax_loss_peak(rows):
    """The compiled peak of the loss's value and gradient with respect to
    the outputs alone, at `rows` samples (JAX)."""
    import jax

    from keras_accum import _sizing

    loss = _import_example().clip_loss
    y_pred = jax.ShapeDtypeStruct((rows, 2, EMBED), "float32")

    def value_and_grad(y_pred):
        return jax.value_and_grad(lambda p: loss(None, p).mean())(y_pred)

    compiled = jax.jit(value_and_grad).lower(y_pred).compile()
    return _sizing.compiled_peak(compiled.memory_analysis())


def tf_peak(model, rows, args):
    """The allocator's in-use peak during the step at `rows` samples
    (TensorFlow, its second run at that size: the first holds one-time
    buffers), above what was in use before it, plus the variables'
    bytes; None if it ran out of memory."""
    import tensorflow as tf

    info = tf.config.experimental.get_memory_info
    # Tensors before the measure, counted by their size: a tensor made
    # from a NumPy array may share its memory or not (by its alignment).
    x, y = tf.nest.map_structure(tf.constant, data(rows, args))
    try:
        for _ in range(2):
            tf.config.experimental.reset_memory_stats("CPU:0")
            before = info("CPU:0")["current"]
            model.train_on_batch(x, y)
            above = info("CPU:0")["peak"] - before
    except tf.errors.ResourceExhaustedError:
        return None
    return _variable_bytes(model) + _input_bytes(rows, args) + above


def _input_bytes(rows, args):
    """The bytes of a batch of `rows` inputs and labels (float32)."""
    return rows * (args.image_size**2 * 3 + TEXT_FEATURES + 1) * 4


def largest(measure, budget, start, limit, resolution, peaks):
    """(largest rows that fit, the peak there, the smallest found not to
    fit or None): doubling from `start`, then bisection to within
    `resolution` of the lower end; each peak measured is kept in `peaks`
    (`{rows: bytes}`). Assumes the peak grows with the batch."""

    def fits(rows):
        peaks[rows] = measure(rows)
        return peaks[rows] is not None and peaks[rows] <= budget

    low, high = 0, None
    rows = start
    while rows <= limit:
        if not fits(rows):
            high = rows
            break
        low, rows = rows, rows * 2
    if high is not None and low == 0:
        # Even `start` does not fit: down from it.
        rows = start // 2
        while rows >= 1 and not fits(rows):
            high, rows = rows, rows // 2
        low = max(rows, 0)
    while high is not None and high - low > max(1, int(low * resolution)):
        middle = (low + high) // 2
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, peaks.get(low), high


def memory(args, backend):
    """Each variant's largest batch under the budget, and `whole`'s peak
    split into the micro-batch step's and the rest."""
    budget = args.budget_mib * MIB
    peak = jax_peak if backend == "jax" else tf_peak
    models = {}
    found = {}
    peaks = {}
    warm_x, warm_y = data(2 * args.micro_batch, args)
    for variant in ("keras", "accum", "whole"):
        model = models[variant] = build(variant, args, args.micro_batch)
        # Builds the optimizer's and the window's variables.
        model.fit(warm_x, warm_y, batch_size=2 * args.micro_batch, verbose=0)
        # The others need at least `keras`'s memory at a batch: their
        # search starts where `keras`'s ended.
        start = max(args.micro_batch, found.get("keras", {}).get("largest", 0))
        rows, at, above = largest(
            lambda rows, model=model: peak(model, rows, args),
            budget,
            start=start,
            limit=args.max_batch,
            resolution=args.resolution,
            peaks=peaks.setdefault(variant, {}),
        )
        found[variant] = {"largest": rows, "peak": at, "not_fit": above}
        print(f"{variant}: {found[variant]}", file=sys.stderr, flush=True)
    whole = found["whole"]["largest"]
    split = {"batch": whole, "micro_batch": args.micro_batch}
    if whole:
        split["whole_step"] = found["whole"]["peak"]
        m = args.micro_batch
        split["micro_batch_step"] = peaks["keras"].get(m) or peak(
            models["keras"], m, args
        )
        # y_pred (the scaled image and the text embeddings, float32) and
        # its gradient with respect to the loss.
        # The batch's inputs beyond the micro-batch's: the split step
        # holds the whole batch's inputs (a JAX argument).
        split["inputs"] = _input_bytes(whole - m, args)
        split["outputs_and_gradient"] = 2 * whole * 2 * EMBED * 4
        split["rest"] = (
            split["whole_step"]
            - split["micro_batch_step"]
            - split["inputs"]
            - split["outputs_and_gradient"]
        )
        if backend == "jax":
            split["loss_value_and_gradient"] = jax_loss_peak(whole)
    return {
        "backend": backend,
        "budget": budget,
        "measure": (
            "XLA compiled memory analysis"
            if backend == "jax"
            else "TensorFlow BFC allocator peak + variables"
        ),
        "variants": found,
        "split": split,
    }


def speed(args, backend):
    """CPU time per sample of `whole` against `keras` at the batch."""
    if backend == "torch" and args.torch_threads:
        import torch

        torch.set_num_threads(args.torch_threads)
    m = args.speed_micro_batch
    built = {v: build(v, args, m) for v in ("keras", "whole", "split")}
    samples = max(1, args.samples_per_run // args.batch) * args.batch
    x, y = data(samples, args, seed=1)
    times = _workers.time_rounds(built, x, y, args.batch, args.rounds)
    # `time_rounds` divides by `len(x)`: the inputs' count, x being a dict.
    times = {v: [t * len(x) / samples for t in ts] for v, ts in times.items()}
    return {
        "backend": backend,
        "batch": args.batch,
        "micro_batch": m,
        "samples_per_run": samples,
        "keras_cpu_per_sample": _median(times["keras"]),
        "whole_cpu_per_sample": _median(times["whole"]),
        "split_cpu_per_sample": _median(times["split"]),
        **_workers.paired_ratios(times, "whole", "keras"),
        # The same pieces, each with its own loss: what the pieces cost
        # without the loss's pass over the whole batch.
        "split_vs_keras": _workers.paired_ratios(times, "split", "keras"),
        "whole_vs_split": _workers.paired_ratios(times, "whole", "split"),
    }


def _median(values):
    import statistics

    return statistics.median(values)


# -- Where PyTorch's step spends its time (--profile) --------------------------

# Phases of a train step, each the CPU time spent in it and not in a
# phase nested inside it; what no phase claims is "other" (Python, Keras's
# step around them).
PHASES = (
    "forward, no gradients (pass 1)",
    "forward",
    "backward",
    "loss",
    "loss gradient (outputs)",
    "window adds",
    "update",
    "metrics",
    "slices and join",
    "seeds",
    "other",
)


class _PhaseClock:
    """Wraps the functions that make a step's phases, for as long as it is
    entered: each call's exclusive CPU time goes to its phase, and under
    `torch.profiler` into a `record_function` range of that name."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.stack = []
        self.ranges = False

    def _wrap(self, function, phase):
        import functools
        import time

        import torch

        @functools.wraps(function)
        def wrapped(*args, **kwargs):
            name = phase() if callable(phase) else phase
            now = time.process_time()
            if self.stack:
                self.totals[self.stack[-1][0]] += now - self.stack[-1][1]
            self.stack.append([name, now])
            scope = (
                torch.profiler.record_function(name) if self.ranges else None
            )
            try:
                if scope is None:
                    return function(*args, **kwargs)
                with scope:
                    return function(*args, **kwargs)
            finally:
                end = time.process_time()
                name, start = self.stack.pop()
                self.totals[name] += end - start
                if self.stack:
                    self.stack[-1][1] = end

        return wrapped

    def _targets(self):
        import keras
        import torch
        from keras.src.optimizers import base_optimizer
        from keras.src.trainers import trainer

        from keras_accum import (
            _seeds,
            _torch_batch,
            _torch_output_grads,
            _window,
        )

        def forward():
            if torch.is_grad_enabled():
                return "forward"
            return "forward, no gradients (pass 1)"

        def backward():
            # The whole-batch loss's gradient with respect to the outputs
            # is the loss's, not the model's.
            if self.stack and self.stack[-1][0] == "loss gradient (outputs)":
                return "loss gradient (outputs)"
            return "backward"

        ops = _torch_batch.TorchBatchOps
        replay = _seeds.SeedReplay
        return [
            (keras.Model, "__call__", forward),
            (torch.autograd, "grad", backward),
            (torch.Tensor, "backward", backward),
            (trainer.Trainer, "_compute_loss", "loss"),
            (
                _torch_output_grads,
                "loss_and_output_grads",
                "loss gradient (outputs)",
            ),
            (_window, "accumulate", "window adds"),
            (base_optimizer.BaseOptimizer, "apply", "update"),
            (trainer.Trainer, "compute_metrics", "metrics"),
            (ops, "piece", "slices and join"),
            (ops, "join", "slices and join"),
            (replay, "start", "seeds"),
            (replay, "enter", "seeds"),
            (replay, "finish", "seeds"),
            (_seeds, "_torch_rng_state", "seeds"),
            (_seeds, "_set_torch_rng_state", "seeds"),
        ]

    def __enter__(self):
        self.kept = []
        for owner, name, phase in self._targets():
            # An inherited method (`keras.Model.__call__` is `Layer`'s) is
            # wrapped on `owner` alone, and deleted there after.
            self.kept.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, self._wrap(getattr(owner, name), phase))
        return self

    def __exit__(self, *exc):
        for owner, name, function in reversed(self.kept):
            if function is None:
                delattr(owner, name)
            else:
                setattr(owner, name, function)

    def time(self, step, steps):
        """`{phase: CPU milliseconds per step}` of `steps` calls of `step`."""
        import time

        self.totals = dict.fromkeys(PHASES, 0.0)
        self.stack = [["other", time.process_time()]]
        for _ in range(steps):
            step()
        name, start = self.stack.pop()
        self.totals[name] += time.process_time() - start
        found = {k: v * 1e3 / steps for k, v in self.totals.items()}
        return {**found, "total": sum(found.values())}


def _ops_by_phase(events, top):
    """`{phase: {op: self CPU milliseconds}}` of a profile's `events`: each
    op counted in the innermost phase range around it, the `top` largest
    of each phase (the rest summed as "the rest")."""
    found = {}
    for event in events:
        if event.name in PHASES:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name not in PHASES:
            parent = parent.cpu_parent
        phase = "other" if parent is None else parent.name
        ops = found.setdefault(phase, {})
        ops[event.name] = ops.get(event.name, 0.0) + event.self_cpu_time_total
    kept = {}
    for phase, ops in found.items():
        ranked = sorted(ops.items(), key=lambda item: -item[1])
        kept[phase] = {op: us / 1e3 for op, us in ranked[:top]}
        kept[phase]["the rest"] = sum(us for _, us in ranked[top:]) / 1e3
    return kept


def torch_profile(args):
    """Where PyTorch's train step at `--batch` spends its CPU time, for
    `keras`, `split` and `whole` in pieces of `--speed-micro-batch`: each
    phase's CPU milliseconds per step (`PHASES`, exclusive; the median of
    `--rounds` interleaved rounds of `--profile-steps` steps after a
    warm-up), and the ops' self CPU time in each phase (milliseconds per
    step, from `torch.profiler` over one further round)."""
    import torch

    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    variants = ("keras", "split", "whole")
    built = {v: build(v, args, args.speed_micro_batch) for v in variants}
    x, y = data(args.batch, args, seed=1)
    batch = ({k: torch.as_tensor(v) for k, v in x.items()}, torch.as_tensor(y))
    for model in built.values():
        # Builds the train function and the metrics; then one more step.
        model.fit(x, y, batch_size=args.batch, verbose=0)
        model.train_step(batch)
    steps = args.profile_steps
    rounds = {v: [] for v in variants}
    with _PhaseClock() as clock:
        for round_ in range(args.rounds):
            turn = round_ % len(variants)
            for v in variants[turn:] + variants[:turn]:
                step = built[v].train_step
                rounds[v].append(clock.time(lambda s=step: s(batch), steps))
        clock.ranges = True
        ops = {}
        for v in variants:
            activities = [torch.profiler.ProfilerActivity.CPU]
            with torch.profiler.profile(activities=activities) as profile:
                clock.time(lambda s=built[v].train_step: s(batch), steps)
            ops[v] = {
                phase: {op: ms / steps for op, ms in found.items()}
                for phase, found in _ops_by_phase(profile.events(), 6).items()
            }
    phases = {
        v: {
            phase: _median([r[phase] for r in rounds[v]])
            for phase in (*PHASES, "total")
        }
        for v in variants
    }
    return {
        "batch": args.batch,
        "micro_batch": args.speed_micro_batch,
        "steps_per_round": steps,
        "phases_ms_per_step": phases,
        "ops_ms_per_step": ops,
    }


def worker(args):
    import keras

    backend = keras.backend.backend()
    row = {"backend": backend}
    if backend in ("jax", "tensorflow") and not args.no_memory:
        row["memory"] = memory(args, backend)
    if not args.no_speed:
        row["speed"] = speed(args, backend)
    if backend == "torch" and args.profile:
        row["profile"] = torch_profile(args)
    _workers.print_rows([row])


# -- The report ----------------------------------------------------------------


def _mib(value):
    return "-" if value is None else f"{value / MIB:.1f}"


def print_tables(rows):
    print("largest batch under the budget (peak MiB there)")
    print(
        f"{'backend':<11} {'budget':>7}  {'keras':>14} {'accum':>14} "
        f"{'whole':>14}  whole/keras"
    )
    for row in rows:
        found = row.get("memory")
        if not found:
            continue
        cells = []
        for variant in ("keras", "accum", "whole"):
            v = found["variants"][variant]
            cells.append(f"{v['largest']:>6} ({_mib(v['peak']):>6})")
        keras_rows = found["variants"]["keras"]["largest"]
        ratio = found["variants"]["whole"]["largest"] / max(keras_rows, 1)
        print(
            f"{row['backend']:<11} {_mib(found['budget']):>7}  "
            f"{' '.join(cells)}  {ratio:.1f}x"
        )
    print("\nwhole_batch_loss's peak at its largest batch, MiB")
    for row in rows:
        split = row.get("memory", {}).get("split")
        if not split or "whole_step" not in split:
            continue
        loss = split.get("loss_value_and_gradient")
        print(
            f"{row['backend']:<11} B={split['batch']} m={split['micro_batch']}"
            f": whole step {_mib(split['whole_step'])} = micro-batch step "
            f"{_mib(split['micro_batch_step'])} + the other inputs "
            f"{_mib(split['inputs'])} + outputs and gradient "
            f"{_mib(split['outputs_and_gradient'])} + rest "
            f"{_mib(split['rest'])}"
            + (
                f" (the loss's value and gradient alone: {_mib(loss)})"
                if loss is not None
                else ""
            )
        )
    print("\nCPU time per sample, whole_batch_loss / keras.Model at the batch")
    for row in rows:
        if "speed" not in row:
            continue
        s = row["speed"]
        print(
            f"{row['backend']:<11} B={s['batch']} m={s['micro_batch']}: "
            f"{s['ratio_median']:.3f} ({s['ratio_q1']:.3f}-"
            f"{s['ratio_q3']:.3f}); keras {s['keras_cpu_per_sample'] * 1e3:.3f}"
            f" ms, whole {s['whole_cpu_per_sample'] * 1e3:.3f} ms a sample; "
            f"split (the pieces, each its own loss) / keras "
            f"{s['split_vs_keras']['ratio_median']:.3f}, whole / split "
            f"{s['whole_vs_split']['ratio_median']:.3f}"
        )


def print_profile(rows):
    for row in rows:
        found = row.get("profile")
        if not found:
            continue
        phases = found["phases_ms_per_step"]
        variants = tuple(phases)
        print(
            f"\n{row['backend']}: CPU ms per train step at B={found['batch']}"
            f" (pieces of {found['micro_batch']}), by phase (exclusive)"
        )
        print(f"{'phase':<32}" + "".join(f"{v:>9}" for v in variants))
        for phase in (*PHASES, "total"):
            print(
                f"{phase:<32}"
                + "".join(f"{phases[v][phase]:>9.1f}" for v in variants)
            )
        print("\nops' self CPU ms per step in each phase (torch.profiler)")
        for phase in PHASES:
            for v in variants:
                ops = found["ops_ms_per_step"][v].get(phase)
                if not ops or sum(ops.values()) < 0.5:
                    continue
                listed = ", ".join(f"{op} {ms:.1f}" for op, ms in ops.items())
                print(f"{phase} | {v}: {listed}")


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument("--budget-mib", type=int, default=8)
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument(
        "--image-tower",
        choices=("conv", "mlp"),
        default="conv",
        help="the image tower: 3 conv layers of `width`, `2 width` "
        "filters, or an MLP of two `32 width` layers",
    )
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--accum-steps", type=int, default=16)
    parser.add_argument("--max-batch", type=int, default=1 << 16)
    parser.add_argument(
        "--resolution",
        type=float,
        default=1 / 4,
        help="bisect to within this fraction of the largest batch",
    )
    parser.add_argument(
        "--speed-micro-batch",
        type=int,
        default=32,
        help="whole_batch_loss's micro-batch in the timed runs",
    )
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--samples-per-run", type=int, default=512)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-speed", action="store_true")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=0,
        help="PyTorch's intra-op threads in the timed runs (0: its own "
        "default); on shared cores idle threads spin, and CPU time counts it",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="PyTorch: the train step's CPU time by phase and by op, for "
        "keras, split and whole",
    )
    parser.add_argument("--profile-steps", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument(
        "--out",
        default=str(ROOT / "benchmarks/results/whole_batch_loss.json"),
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


WORKER_OPTIONS = (
    "budget_mib",
    "image_size",
    "width",
    "image_tower",
    "micro_batch",
    "accum_steps",
    "max_batch",
    "resolution",
    "speed_micro_batch",
    "batch",
    "rounds",
    "samples_per_run",
    "torch_threads",
    "profile_steps",
)
WORKER_FLAGS = ("no_memory", "no_speed", "profile")


def main():
    args = _parser().parse_args()
    if args.quick:
        args.budget_mib, args.image_size, args.width = 2, 8, 8
        args.micro_batch, args.batch, args.rounds = 8, 32, 1
        args.samples_per_run, args.max_batch = 32, 4096
        args.resolution, args.speed_micro_batch = 1.0, 8
    if args.worker:
        return worker(args)
    # Allocator statistics on every CPU (TensorFlow keeps them only as the
    # BFC allocator, its default only where it enables oneDNN).
    os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
    rows = _workers.run_workers(__file__, args, WORKER_OPTIONS, WORKER_FLAGS)
    settings = {
        name: getattr(args, name) for name in WORKER_OPTIONS + ("quick",)
    }
    _workers.write_report(args.out, rows, args.rounds, settings=settings)
    print_tables(rows)
    print_profile(rows)


if __name__ == "__main__":
    main()
