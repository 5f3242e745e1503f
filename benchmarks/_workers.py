"""What the per-backend CPU-time scripts share: workers, rounds, ratios.

`bench_backends.py` and `bench_micro_batch.py` run each backend in a worker
process of its own (the script itself with `--worker BACKEND`: Keras fixes
its backend at import), time their variants there in interleaved rounds,
and report each variant's CPU time per sample as paired ratios against a
baseline. The parent collects the workers' rows and writes the report.
This module imports no Keras at import time: a worker sets its backend
first.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path


def without_tensorflow():
    """In a JAX or PyTorch process, before Keras is imported: makes
    TensorFlow unimportable, so that Keras leaves it out.

    `keras.utils.set_random_seed` imports TensorFlow wherever it is
    installed, only to seed it: seconds of CPU per process, for a module
    that a JAX or PyTorch measurement never runs. Keras treats it as not
    installed (its optional imports catch the `ImportError`).
    """
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if backend != "tensorflow" and "tensorflow" not in sys.modules:
        sys.modules["tensorflow"] = None


def run_worker(script, backend, args, options, flags=()):
    """One backend's rows, from a worker process of its own.

    Runs `script --worker BACKEND`, passing on `args`' values of `options`
    (as `--name=value`) and of the true ones among `flags` (as `--name`),
    in that order; the worker prints one line `RESULTS [...]`. Exits with
    the worker's error output where it fails.
    """
    env = {
        **os.environ,
        "KERAS_BACKEND": backend,
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu"),
    }
    command = [sys.executable, str(script), "--worker", backend]
    for option in options:
        command.append(f"--{option.replace('_', '-')}={getattr(args, option)}")
    for flag in flags:
        if getattr(args, flag):
            command.append(f"--{flag.replace('_', '-')}")
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=False
    )
    line = next(
        (x for x in result.stdout.splitlines() if x.startswith("RESULTS ")),
        None,
    )
    if result.returncode != 0 or line is None:
        sys.exit(f"{backend} worker failed:\n{result.stderr[-3000:]}")
    return json.loads(line[len("RESULTS ") :])


def run_workers(script, args, options, flags=()):
    """The rows of every backend in `args.backends`, one worker each."""
    rows = []
    for backend in args.backends.split(","):
        rows.extend(run_worker(script, backend, args, options, flags))
    return rows


def print_rows(rows):
    """A worker's output: its rows, as the line `run_worker` reads."""
    print("RESULTS " + json.dumps(rows), flush=True)


def cpu_per_sample(model, x, y, batch_size):
    """CPU seconds per sample of one epoch of `fit`, unshuffled."""
    start = time.process_time()
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return (time.process_time() - start) / len(x)


def time_rounds(built, x, y, batch_size, rounds):
    """`{variant: [CPU seconds per sample, a round each]}` of the models
    `built` (`{variant: model}`), each fitting one epoch of `x`, `y` at
    `batch_size` (a number, or `{variant: number}`).

    Each model runs once first to trace, compile and warm up, untimed;
    then `rounds` rounds, in an order that rotates each round, so that no
    variant always runs first.
    """
    variants = tuple(built)
    if not isinstance(batch_size, dict):
        batch_size = dict.fromkeys(variants, batch_size)

    def time_one(variant):
        return cpu_per_sample(built[variant], x, y, batch_size[variant])

    for variant in variants:
        time_one(variant)
    times = {v: [] for v in variants}
    for round_ in range(rounds):
        turn = round_ % len(variants)
        for variant in variants[turn:] + variants[:turn]:
            times[variant].append(time_one(variant))
    return times


def paired_ratios(times, variant, baseline):
    """Each round's ratio of `variant`'s time to `baseline`'s, with their
    median and quartiles: the keys of a row."""
    ratios = [
        t / b for t, b in zip(times[variant], times[baseline], strict=True)
    ]
    quartiles = (
        statistics.quantiles(ratios, n=4)
        if len(ratios) > 1
        else [ratios[0]] * 3
    )
    return {
        "ratios": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_q1": quartiles[0],
        "ratio_q3": quartiles[2],
    }


def write_report(out, rows, rounds, **settings):
    """Writes the results file `out`: the machine, the clock (CPU time),
    `rounds`, `settings` and the rows. Keras's version comes from the
    installed package's metadata: the parent imports no Keras (under
    TensorFlow, that import alone costs seconds of CPU)."""
    report = {
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "cpus": os.cpu_count(),
            "keras": importlib.metadata.version("keras"),
        },
        "clock": "cpu",
        "rounds": rounds,
        **settings,
        "rows": rows,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1) + "\n")
