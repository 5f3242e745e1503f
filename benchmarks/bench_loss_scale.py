"""Loss-scale head-room of AccumModel against the large batch, float16.

Under `mixed_float16` a `LossScaleOptimizer` multiplies the loss by its
scale before backpropagation; float16 overflows (the update is skipped and
the scale halved) when the scale is too high and loses small gradients
when it is too low. A window should behave like the large batch it
replaces. For each backend this measures, at initial scales 2^0 to 2^24:

- **one update** (scale fixed, SGD with learning rate 1): whether it was
  skipped, and the relative error of the applied gradient against the
  same large batch computed in float32 (where the scale is low, what
  float16 lost; where it is high, overflow);
- **a dynamic run** (initial scale 2^s, growth every 4 updates, 48
  updates' worth of data): how many updates were skipped, the final scale,
  and the max weight difference from the plain large batch run.

Variants: `Model(B*k)` (the large batch) and `AccumModel(B, k)`, k = 8.

    python benchmarks/bench_loss_scale.py [--backends=tensorflow,jax,torch]

Results go to benchmarks/results/loss_scale.json (or `--out`); the table
is printed in Markdown. Each backend runs in a worker process of its own;
`--in-process` (one backend, a smoke run's shortcut) runs it in the
script's process instead, on the backend `KERAS_BACKEND` names.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
B, K = 8, 8
SCALES = list(range(0, 25, 2))
DYNAMIC_UPDATES = 48


def _data(n, seed=0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 32)).astype("float32")
    w = rng.normal(size=(32, 4)).astype("float32")
    y = (x @ w + rng.normal(size=(n, 4))).astype("float32")
    return x, y


def _model(model_cls, policy, **kwargs):
    import keras

    keras.utils.set_random_seed(1)
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(64, activation="tanh", dtype=policy)(inputs)
    hidden = keras.layers.Dense(64, activation="tanh", dtype=policy)(hidden)
    outputs = keras.layers.Dense(4, dtype=policy)(hidden)
    return model_cls(inputs, outputs, **kwargs)


def _fit(variant, policy, x, y, optimizer):
    import keras

    import keras_accum

    if variant == "large":
        model = _model(keras.Model, policy)
        batch = B * K
    else:
        model = _model(keras_accum.AccumModel, policy, accum_steps=K)
        batch = B
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def _lso(scale, growth):
    import keras

    return keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(1.0 if growth is None else 0.01),
        initial_scale=2.0**scale,
        dynamic_growth_steps=growth or 10**9,
    )


def worker(scales, dynamic_updates):
    import keras
    import numpy as np

    x, y = _data(B * K)
    reference = _fit("large", "float32", x, y, keras.optimizers.SGD(1.0))
    start = _model(keras.Model, "float32").get_weights()
    true_step = [
        w1 - w0 for w0, w1 in zip(start, reference.get_weights(), strict=True)
    ]
    norm = np.sqrt(sum(float(np.sum(g * g)) for g in true_step))

    one, dynamic = {}, {}
    for variant in ("large", "accum"):
        rows = one[variant] = []
        for s in scales:
            model = _fit(variant, "mixed_float16", x, y, _lso(s, None))
            step = [
                w1 - w0
                for w0, w1 in zip(start, model.get_weights(), strict=True)
            ]
            skipped = int(model.optimizer.iterations) == 0
            error = np.sqrt(
                sum(
                    float(np.sum((g - t) ** 2))
                    for g, t in zip(step, true_step, strict=True)
                )
            )
            rows.append(
                {
                    "log2_scale": s,
                    "skipped": skipped,
                    "relative_error": None if skipped else error / norm,
                }
            )
    xd, yd = _data(B * K * dynamic_updates, seed=2)
    models = {}
    for variant in ("large", "accum"):
        rows = dynamic[variant] = []
        for s in scales:
            model = _fit(variant, "mixed_float16", xd, yd, _lso(s, 4))
            models[(variant, s)] = model.get_weights()
            rows.append(
                {
                    "log2_scale": s,
                    "skipped": dynamic_updates
                    - int(model.optimizer.iterations),
                    "final_log2_scale": float(
                        np.log2(float(model.optimizer.dynamic_scale.numpy()))
                    ),
                }
            )
    for row, s in zip(dynamic["accum"], scales, strict=True):
        row["max_weight_diff"] = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(
                models[("large", s)], models[("accum", s)], strict=True
            )
        )
    return {"one_update": one, "dynamic": dynamic}


def _fmt(row):
    if row["skipped"]:
        return "skipped"
    return f"{row['relative_error']:.1e}"


def _parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="tensorflow,jax,torch")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/loss_scale.json")
    )
    parser.add_argument(
        "--scales",
        default=",".join(map(str, SCALES)),
        help="log2 of the initial loss scales",
    )
    parser.add_argument("--dynamic-updates", type=int, default=DYNAMIC_UPDATES)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="measure the one backend of --backends in this process (the "
        "backend KERAS_BACKEND names), not in a worker of its own",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return parser


def _run_worker(args, backend):
    """One backend's results, from a worker process of its own."""
    env = {**os.environ, "KERAS_BACKEND": backend}
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            f"--scales={args.scales}",
            f"--dynamic-updates={args.dynamic_updates}",
        ],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def _print_one_update(results, scales):
    print("One update, fixed scale: relative error of the applied gradient")
    print("against float32 (or skipped on overflow).\n")
    header = "| log2 scale |" + "".join(
        f" {b} B·k | {b} AccumModel |" for b in results
    )
    print(header)
    print("|---:|" + "---|---|" * len(results))
    for i, s in enumerate(scales):
        cells = "".join(
            f" {_fmt(r['one_update']['large'][i])} |"
            f" {_fmt(r['one_update']['accum'][i])} |"
            for r in results.values()
        )
        print(f"| {s} |{cells}")


def _print_dynamic(results, scales, updates):
    print(f"\nDynamic scale, {updates} windows, growth every 4:")
    print("skipped updates, final log2 scale (B·k / AccumModel), max diff.\n")
    print("| log2 scale |" + "".join(f" {b} |" for b in results))
    print("|---:|" + "---|" * len(results))
    for i, s in enumerate(scales):
        cells = ""
        for r in results.values():
            large, accum = r["dynamic"]["large"][i], r["dynamic"]["accum"][i]
            cells += (
                f" {large['skipped']}/{accum['skipped']} skipped, "
                f"2^{large['final_log2_scale']:g}/"
                f"2^{accum['final_log2_scale']:g}, "
                f"{accum['max_weight_diff']:.0e} |"
            )
        print(f"| {s} |{cells}")


def _in_process(args, scales):
    """`--in-process`: the one backend's results, from this process."""
    import keras

    if args.backends != keras.backend.backend():
        raise SystemExit(
            "--in-process measures the backend Keras runs on here "
            f"({keras.backend.backend()}); received --backends={args.backends}"
        )
    return {args.backends: worker(scales, args.dynamic_updates)}


def main(argv=None):
    args = _parser().parse_args(argv)
    scales = [int(s) for s in args.scales.split(",")]
    if args.worker:
        print(json.dumps(worker(scales, args.dynamic_updates)))
        return
    if args.in_process:
        results = _in_process(args, scales)
    else:
        results = {
            backend: _run_worker(args, backend)
            for backend in args.backends.split(",")
        }
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    _print_one_update(results, scales)
    _print_dynamic(results, scales, args.dynamic_updates)


if __name__ == "__main__":
    main()
