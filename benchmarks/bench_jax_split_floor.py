"""The floor of the split mode's cost on XLA:CPU: plain JAX, no Keras.

The benchmark MLP's (784-512-512-10, softmax cross-entropy) gradient at
one batch of `m·k` rows against the same rows in `k` pieces of `m`, and
its matrix products alone at both sizes, in interleaved rounds after a
warm-up; reported as each round's ratio of CPU time per sample to the
whole batch's gradient (median, first–third quartile):

- `grad`: `jax.grad` at the whole batch (what `keras.Model` runs);
- `fori`: the pieces in a `fori_loop`, their gradients summed (the split
  mode's structure);
- `unrolled`: the pieces in a Python loop (one program, no loop);
- `calls`: a jitted gradient called once per piece;
- `products`, `products_pieces`: the eight products of a step (forward,
  the inputs' gradients but the first's, the weights' gradients), at the
  batch and at a piece (`k` calls);
- `weight_grad`, `weight_grad_pieces`: the first layer's weight gradient
  (784 × 512, summed over the rows) as autodiff writes it (Eigen's kernel
  on XLA:CPU), at the batch and at a piece;
  `weight_grad_pieces_copy`: at a piece, the rows' transpose copied first
  (XLA:CPU's YNNPACK kernel, `_jax_batch.cpu_layouts`).

    python benchmarks/bench_jax_split_floor.py --out /tmp/floor.json
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _workers

ROOT = Path(__file__).resolve().parents[1]
SIZES = ((784, 512), (512, 512), (512, 10))


def _cases(m, k):
    """`{name: (function of no arguments, calls per batch)}`."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    rng = np.random.default_rng(0)
    params = [
        (
            jnp.asarray(rng.normal(size=s).astype("float32") * 0.05),
            jnp.zeros(s[1], "float32"),
        )
        for s in SIZES
    ]
    n = m * k
    x = jnp.asarray(rng.normal(size=(n, 784)).astype("float32"))
    y = jnp.asarray(rng.integers(0, 10, size=n).astype("int32"))
    hidden = jnp.asarray(rng.normal(size=(n, 512)).astype("float32"))

    def loss(params, x, y):
        h = x
        for i, (w, b) in enumerate(params):
            h = h @ w + b
            if i < len(params) - 1:
                h = jax.nn.relu(h)
        log_p = jax.nn.log_softmax(h)
        return -jnp.sum(jnp.take_along_axis(log_p, y[:, None], 1))

    grad = jax.grad(loss)
    zeros = jax.tree.map(jnp.zeros_like, params)

    def add(a, b):
        return jax.tree.map(jnp.add, a, b)

    @jax.jit
    def fori(params, x, y):
        def body(i, total):
            rows = jax.lax.dynamic_slice_in_dim(x, i * m, m)
            labels = jax.lax.dynamic_slice_in_dim(y, i * m, m)
            return add(total, grad(params, rows, labels))

        return jax.lax.fori_loop(0, k, body, zeros)

    @jax.jit
    def unrolled(params, x, y):
        total = zeros
        for i in range(k):
            rows = slice(i * m, (i + 1) * m)
            total = add(total, grad(params, x[rows], y[rows]))
        return total

    def products(rows):
        @jax.jit
        def run(params, x, out_grad):
            h, inputs = x[:rows], []
            for w, _ in params:
                inputs.append(h)
                h = h @ w
            g, found = out_grad[:rows], []
            for i in reversed(range(len(params))):
                found.append(inputs[i].T @ g)
                if i:
                    g = g @ params[i][0].T
            return found

        return run

    def weight_grad(rows, copy):
        @jax.jit
        def run(x, g):
            rows_t = x[:rows].T
            if copy:
                rows_t = jax.lax.optimization_barrier(rows_t)
            return rows_t @ g[:rows]

        return run

    out_grad = hidden[:, :10]
    whole_grad = jax.jit(grad)
    at_batch, at_piece = products(n), products(m)
    eigen_batch = weight_grad(n, copy=False)
    eigen_piece = weight_grad(m, copy=False)
    copied_piece = weight_grad(m, copy=True)
    return {
        "grad": (lambda: whole_grad(params, x, y), 1),
        "fori": (lambda: fori(params, x, y), 1),
        "unrolled": (lambda: unrolled(params, x, y), 1),
        "calls": (lambda: whole_grad(params, x[:m], y[:m]), k),
        "products": (lambda: at_batch(params, x, out_grad), 1),
        "products_pieces": (lambda: at_piece(params, x, out_grad), k),
        "weight_grad": (lambda: eigen_batch(x, hidden), 1),
        "weight_grad_pieces": (lambda: eigen_piece(x, hidden), k),
        "weight_grad_pieces_copy": (lambda: copied_piece(x, hidden), k),
    }


def _time(cases, rounds, reps):
    """`{name: [CPU seconds per batch, a round each]}`, interleaved rounds
    in a rotating order after a warm-up."""
    import jax

    names = list(cases)
    for f, calls in cases.values():
        for _ in range(2 * calls):
            jax.block_until_ready(f())
    times = {name: [] for name in names}
    for round_ in range(rounds):
        turn = round_ % len(names)
        for name in names[turn:] + names[:turn]:
            f, calls = cases[name]
            start = time.process_time()
            for _ in range(reps * calls):
                out = f()
            jax.block_until_ready(out)
            times[name].append((time.process_time() - start) / reps)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--pieces", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/jax_split_floor.json")
    )
    args = parser.parse_args()
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    cases = _cases(args.micro_batch, args.pieces)
    times = _time(cases, args.rounds, args.reps)
    n = args.micro_batch * args.pieces
    rows = [
        {
            "case": name,
            "baseline": "grad",
            "cpu_ms_per_batch": 1e3 * sorted(t)[len(t) // 2],
            **_workers.paired_ratios(times, name, "grad"),
        }
        for name, t in times.items()
    ]
    _workers.write_report(
        args.out,
        rows,
        args.rounds,
        micro_batch=args.micro_batch,
        pieces=args.pieces,
    )
    print(f"batch {n} against pieces of {args.micro_batch}")
    print(f"{'case':<24} vs grad  median  (q1-q3)   CPU ms per batch")
    for r in rows:
        print(
            f"{r['case']:<24} {r['ratio_median']:.3f}  ({r['ratio_q1']:.3f}-"
            f"{r['ratio_q3']:.3f})   {r['cpu_ms_per_batch']:.2f}"
        )


if __name__ == "__main__":
    main()
