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
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "communication.json"
# The HLO reading the tests share (tests/_collectives.py).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _collectives import step_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _workers  # noqa: E402


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
    # After the caller's own flags, if any.
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        f"{flags} --xla_force_host_platform_device_count={args.devices}"
    ).strip()
    if "keras" in sys.modules:
        raise SystemExit("run as a script: JAX's devices are set at import")
    _workers.without_tensorflow()
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
