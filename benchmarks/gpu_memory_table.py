"""A text table of `bench_gpu_memory.py` results.

Reads DIR/gpu_memory_<backend>.json (`new`: the working tree) and
DIR/gpu_memory_<backend>_baseline.json (an older copy of keras_accum), as
`benchmarks/gpu_memory.sh` writes them, and writes DIR/gpu_memory.txt:

- per backend and root, each variant's allocator growth in MiB: `state`
  (what the first `fit` left allocated: optimizer slots, accumulators),
  `steady` (the transient peak of the measured `fit` above that), `total`
  (peak growth over the freshly built model), and `total - Model(B)` in
  units of P, the model's float32 trainable bytes: an `AccumModel` should
  stay within 1.1 P (its accumulators are P);
- per backend, `new` against `baseline` for the configurations both ran;
- the dataset-size sweep of the CNN (`fit` on in-memory arrays).

    python benchmarks/gpu_memory_table.py DIR
    python benchmarks/gpu_memory_table.py benchmarks/results
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MIB = 2**20


def _mib(value):
    return "-" if value is None else f"{value / MIB:.1f}"


def _spread(row, name):
    low, high = row.get(name + "_min"), row.get(name + "_max")
    if low is None or high is None or low == high:
        return ""
    return f"{low / MIB:.1f}-{high / MIB:.1f}"


def _config(row):
    return row["model"], row["variant"], row["k"]


def _rows_table(report):
    lines = []
    rows = report.get("rows", [])
    plain = {
        row["model"]: row
        for row in rows
        if row["variant"] == "plain" and row.get("total_peak_bytes")
    }
    header = (
        f"{'model':<9} {'variant':<9} {'k':>3} {'runs':>4} "
        f"{'state':>8} {'steady':>8} {'total':>8} {'total range':>15} "
        f"{'vs Model(B)':>11} {'in P':>8}  within +1.1P"
    )
    lines += [header, "-" * len(header)]
    for row in rows:
        total = row.get("total_peak_bytes")
        base = plain.get(row["model"])
        versus, in_p, verdict = "", "", ""
        params = row.get("param_bytes")
        if total is not None and base is not None and params:
            excess = (total - base["total_peak_bytes"]) / params
            versus = f"{(total - base['total_peak_bytes']) / MIB:+.1f}"
            in_p = f"{excess:+.2f} P"
            if row["variant"] in ("accum", "keras_ga"):
                verdict = "yes" if excess <= 1.1 else "NO"
        lines.append(
            f"{row['model']:<9} {row['variant']:<9} {row['k']:>3} "
            f"{row.get('runs', 0):>4} {_mib(row.get('state_bytes')):>8} "
            f"{_mib(row.get('peak_bytes')):>8} {_mib(total):>8} "
            f"{_spread(row, 'total_peak_bytes'):>15} {versus:>11} {in_p:>8}"
            f"  {verdict}"
        )
        for error in row.get("errors", [])[:1]:
            last = error.strip().splitlines()[-1] if error.strip() else error
            lines.append(f"    FAILED run: {last[:200]}")
    params = {row["model"]: row.get("param_bytes") for row in rows}
    lines.append(
        "P (float32 trainable bytes): "
        + ", ".join(f"{m} {_mib(p)} MiB" for m, p in params.items())
    )
    return lines


def _sweep_table(report):
    rows = report.get("sweep_rows", [])
    if not rows:
        return []
    header = (
        f"{'n':>6} {'data MiB':>9} {'variant':<7} {'k':>2} {'runs':>4} "
        f"{'state':>8} {'steady':>8} {'total':>8}"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{row['samples']:>6} {_mib(row.get('data_bytes')):>9} "
            f"{row['variant']:<7} {row['k']:>2} {row.get('runs', 0):>4} "
            f"{_mib(row.get('state_bytes')):>8} "
            f"{_mib(row.get('peak_bytes')):>8} "
            f"{_mib(row.get('total_peak_bytes')):>8}"
        )
    return lines


def _compare(new, baseline):
    old = {_config(row): row for row in baseline.get("rows", [])}
    header = (
        f"{'model':<9} {'variant':<9} {'k':>3} {'total new':>10} "
        f"{'baseline':>9} {'change':>8} {'steady new':>11} {'baseline':>9}"
    )
    lines = [header, "-" * len(header)]
    for row in new.get("rows", []):
        before = old.get(_config(row))
        if before is None:
            continue
        total, was = row.get("total_peak_bytes"), before.get("total_peak_bytes")
        change = "-" if total is None or was is None else _mib(total - was)
        lines.append(
            f"{row['model']:<9} {row['variant']:<9} {row['k']:>3} "
            f"{_mib(total):>10} {_mib(was):>9} {change:>8} "
            f"{_mib(row.get('peak_bytes')):>11} "
            f"{_mib(before.get('peak_bytes')):>9}"
        )
    return lines


def _backend_root(path):
    """gpu_memory_jax.json: ("jax", "new"); ..._jax_baseline: "baseline"."""
    backend, _, root = path.stem.removeprefix("gpu_memory_").partition("_")
    return backend, root or "new"


def table(directory):
    directory = Path(directory)
    reports = {}
    for path in sorted(directory.glob("gpu_memory_*.json")):
        backend, root = _backend_root(path)
        try:
            reports[backend, root] = json.loads(path.read_text())
        except json.JSONDecodeError as error:
            reports[backend, root] = {"error": f"{path.name}: {error}"}
    lines = [
        "GPU allocator growth during fit, MiB (median of runs): state = "
        "left allocated by the first fit (optimizer slots, accumulators); "
        "steady = transient peak of the measured fit above that (JAX: peak "
        "since process start); total = peak growth over the built model; "
        "vs Model(B) = total minus Model(B)'s total, in MiB and in P (the "
        "model's float32 trainable bytes; the CNN's P is 0.4 MiB, so there "
        "the MiB say more).",
    ]
    for (backend, root), report in reports.items():
        lines.append("")
        if "error" in report:
            lines.append(f"== {backend} {root}: unreadable {report['error']}")
            continue
        versions = report.get("versions", {})
        devices = {row.get("device") for row in report.get("rows", [])}
        lines.append(
            f"== {backend}, {root}: keras_accum from "
            f"{versions.get('keras_accum')}; versions "
            + ", ".join(
                f"{k} {v}" for k, v in versions.items() if k != "keras_accum"
            )
            + f"; device {', '.join(sorted(map(str, devices)))}; "
            f"XLA_FLAGS {report.get('xla_flags')!r}; "
            f"{report.get('elapsed_s')} s"
        )
        lines += _rows_table(report)
        sweep = _sweep_table(report)
        if sweep:
            lines += ["", f"-- {backend}, {root}: CNN dataset-size sweep"]
            lines += sweep
    for backend in sorted({backend for backend, _ in reports}):
        new, baseline = (reports.get((backend, r)) for r in ("new", "baseline"))
        if new and baseline and "error" not in new and "error" not in baseline:
            lines += ["", f"== {backend}: new against baseline (total, MiB)"]
            lines += _compare(new, baseline)
    text = "\n".join(lines) + "\n"
    (directory / "gpu_memory.txt").write_text(text)
    return text


if __name__ == "__main__":
    print(table(sys.argv[1]), end="")
