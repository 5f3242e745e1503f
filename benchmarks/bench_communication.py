"""Bytes a JAX train step all-reduces, read from its compiled HLO.

Under `keras.distribution.DataParallel` on simulated CPU devices
(`--devices`, default 4), each variant's train step is compiled as `fit`
compiles it, and the operand bytes of its all-reduce and reduce-scatter
ops are summed from the optimized HLO text, apart for those inside a
conditional's branches (which run only when the branch is taken: an
`AccumModel` window's close) and those outside (which run on every
micro-batch). The variants: a plain `keras.Model`, Keras's own
`gradient_accumulation_steps=k`, and `AccumModel` at each `--accum-steps`;
the model is a 256-512-512-10 MLP with Adam, micro-batch `--batch`.

The bytes are deterministic: the same figures on any machine with the
same JAX. With `--rounds N`, each variant's `fit` is also timed (process
CPU time per sample over `--steps` micro-batches, N interleaved rounds)
and reported over the plain model's at the same micro-batch: the median
of the per-round ratios. Simulated devices share the host's cores and
exchange through memory: the ratio shows what the step computes, not
what a slow interconnect would cost.

    python benchmarks/bench_communication.py
    python benchmarks/bench_communication.py --devices 2 --accum-steps 4
    python benchmarks/bench_communication.py --rounds 7

Results go to benchmarks/results/communication.json (`--out`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "communication.json"
_BYTES = {"f64": 8, "s64": 8, "f32": 4, "s32": 4, "u32": 4, "f16": 2}
_BYTES.update({"bf16": 2, "pred": 1, "s8": 1, "u8": 1})
_SHAPE = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE = re.compile(
    r"^\s*(?:ROOT )?%?[\w.\-]+ = (.*?) "
    r"(all-reduce|all-reduce-start|reduce-scatter)\("
)
_CALLED = re.compile(
    r"(?:to_apply|calls|body|condition|true_computation|false_computation)"
    r"=%?([\w.\-]+)"
)


def shape_bytes(text: str) -> int:
    """Bytes of the array shapes in an HLO result type (tuples summed)."""
    total = 0
    for dtype, dims in _SHAPE.findall(text):
        count = 1
        for dim in filter(None, dims.split(",")):
            count *= int(dim)
        total += count * _BYTES[dtype]
    return total


def computations(hlo: str) -> dict:
    """Each computation's name and its lines."""
    found, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            name = (
                line.split()[1] if line.startswith("ENTRY") else line.split()[0]
            )
            current = name.lstrip("%")
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def branch_computations(found: dict) -> set:
    """The computations a conditional's branches run, and what they call."""
    todo = []
    for lines in found.values():
        for line in lines:
            if " conditional(" not in line:
                continue
            match = re.search(r"branch_computations=\{([^}]*)\}", line)
            names = match.group(1).split(",") if match else []
            names += re.findall(
                r"(?:true|false)_computation=%?([\w.\-]+)", line
            )
            todo += [n.strip().lstrip("%") for n in names]
    inside = set()
    while todo:
        name = todo.pop()
        if name in inside:
            continue
        inside.add(name)
        for line in found.get(name, []):
            todo += _CALLED.findall(line)
    return inside


def collective_bytes(hlo: str) -> dict:
    """`{"every_step": bytes, "in_branches": bytes}` of the collectives."""
    found = computations(hlo)
    inside = branch_computations(found)
    totals = {"every_step": 0, "in_branches": 0}
    for name, lines in found.items():
        for line in lines:
            match = _COLLECTIVE.match(line)
            if match:
                key = "in_branches" if name in inside else "every_step"
                totals[key] += shape_bytes(match.group(1))
    return totals


def step_bytes(model, x, y) -> dict:
    """`collective_bytes` of `model`'s train step (built, under the current
    `keras.distribution`) compiled as `fit` compiles it, on `(x, y)`."""
    import jax
    import keras

    state = model._get_jax_state(
        trainable_variables=True,
        non_trainable_variables=True,
        optimizer_variables=True,
        metrics_variables=True,
        purge_model_variables=False,
    )
    layout = keras.distribution.distribution().get_data_layout
    data = tuple(
        jax.device_put(a, layout(a.shape).backend_layout) for a in (x, y)
    )
    step = jax.jit(
        model.train_step,
        out_shardings=(None, model._get_state_sharding_spec()),
    )
    return collective_bytes(step.lower(state, data).compile().as_text())


def measure(variant: str, k: int, batch: int) -> tuple:
    import keras
    import numpy as np

    import keras_accum

    keras.utils.set_random_seed(0)
    inputs = keras.Input((256,))
    hidden = keras.layers.Dense(512, activation="relu")(inputs)
    hidden = keras.layers.Dense(512, activation="relu")(hidden)
    outputs = keras.layers.Dense(10)(hidden)
    if variant == "accum_model":
        model = keras_accum.AccumModel(inputs, outputs, accum_steps=k)
        optimizer = keras.optimizers.Adam()
    else:
        model = keras.Model(inputs, outputs)
        steps = k if variant == "keras_ga" else None
        optimizer = keras.optimizers.Adam(gradient_accumulation_steps=steps)
    model.compile(
        optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    rng = np.random.default_rng(0)
    x = rng.random((batch, 256), dtype="float32")
    y = rng.integers(0, 10, batch)
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    found = step_bytes(model, x, y)
    gradient = sum(4 * int(np.prod(v.shape)) for v in model.trainable_variables)
    return model, {
        "variant": variant,
        "accum_steps": k,
        "micro_batch": batch,
        "gradient_bytes": gradient,
        **found,
        "every_step_per_gradient": found["every_step"] / gradient,
        "bytes_per_sample": (found["every_step"] * k + found["in_branches"])
        / (k * batch),
    }


def cpu_seconds_per_sample(model, batch: int, steps: int) -> float:
    """Process CPU time of `fit` over `steps` micro-batches, per sample."""
    import time

    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.random((batch * steps, 256), dtype="float32")
    y = rng.integers(0, 10, batch * steps)
    start = time.process_time()
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, shuffle=False)
    return (time.process_time() - start) / len(x)


def throughput_ratios(models, rows, args) -> None:
    """Each variant's CPU time per sample over `keras.Model`'s at the same
    micro-batch: the median of per-round ratios, rounds interleaved
    (`ratio_to_plain`, with the first and third quartiles)."""
    import numpy as np

    ratios = [[] for _ in models]
    for _ in range(args.rounds):
        times = [
            cpu_seconds_per_sample(m, args.batch, args.steps) for m in models
        ]
        for found, seconds in zip(ratios, times, strict=True):
            found.append(seconds / times[0])
    for row, found in zip(rows, ratios, strict=True):
        q1, median, q3 = np.percentile(found, [25, 50, 75])
        row["ratio_to_plain"] = float(median)
        row["ratio_quartiles"] = [float(q1), float(q3)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--accum-steps", default="1,4,16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="also time fit, interleaved rounds (0: bytes only)",
    )
    parser.add_argument(
        "--steps", type=int, default=64, help="micro-batches per timed fit"
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={args.devices}"
    )
    if "keras" in sys.modules:
        raise SystemExit("run as a script: JAX's devices are set at import")
    import jax
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(devices=jax.devices())
    )
    steps = [int(k) for k in args.accum_steps.split(",")]
    variants = [("plain", 1)]
    variants += [("keras_ga", k) for k in steps if k > 1]
    variants += [("accum_model", k) for k in steps]
    models, rows = zip(
        *(measure(variant, k, args.batch) for variant, k in variants),
        strict=True,
    )
    rows = list(rows)
    if args.rounds:
        throughput_ratios(models, rows, args)
    for row in rows:
        row["devices"] = args.devices
        row["jax"] = jax.__version__
    print(
        "| variant | k | all-reduced every micro-batch | at the close | "
        "per sample | CPU time / Model(B) |"
    )
    print("|---|---|---|---|---|---|")
    for r in rows:
        ratio = "-"
        if "ratio_to_plain" in r:
            q1, q3 = r["ratio_quartiles"]
            ratio = f"{r['ratio_to_plain']:.2f} ({q1:.2f}-{q3:.2f})"
        print(
            f"| {r['variant']} | {r['accum_steps']} | {r['every_step']:,} B "
            f"({r['every_step_per_gradient']:.2f} x gradient) | "
            f"{r['in_branches']:,} B | {r['bytes_per_sample']:,.0f} B | "
            f"{ratio} |"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
