"""Writes docs/benchmarks.md tables and the throughput plot from results/."""

from __future__ import annotations

import json
from pathlib import Path

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
LABELS = {
    "plain": "Model(B)",
    "accum": "AccumModel(B, k)",
    "keras_ga": "Model(B), Keras GA k",
    "large": "Model(B·k)",
}


def throughput_table(result):
    m = result["machine"]
    clock = "CPU" if result["rows"][0].get("clock") == "cpu" else "wall"
    lines = [
        f"Machine: {m['processor']}, {m['cpu_count']} CPU cores"
        + (f", GPU {', '.join(m['gpu'])}" if m["gpu"] else ", no GPU")
        + f"; Python {m['python']}, TensorFlow {m['tensorflow']}, Keras "
        f"{m['keras']}, keras-accum {m['keras_accum']}; {m['date']}. "
        f"Median of {result['rounds']} interleaved rounds (min–max in "
        f"brackets); samples per {clock} second; time ratio = {clock} time "
        "per sample / that of Model(B) in the same setting.",
        "",
        f"| model | jit | spe | variant | k | samples per {clock} s "
        "| time ratio |",
        "| --- | --- | --- | --- | ---: | --- | ---: |",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['model']} | {'on' if r['jit_compile'] else 'off'} | "
            f"{r['steps_per_execution']} | {LABELS[r['variant']]} | {r['k']} | "
            f"{r['samples_per_s']:.0f} ({r['samples_per_s_min']:.0f}–"
            f"{r['samples_per_s_max']:.0f}) | {r['time_ratio_to_plain']:.3f} |"
        )
    return "\n".join(lines)


def memory_table(result):
    rows = result["rows"]
    lines = [
        f"Median of {result['repeats']} fresh processes; device "
        f"{rows[0]['device']}; micro-batch B = {rows[0]['micro_batch']}. "
        "Growth of peak memory during `fit`, and the excess over Model(B) "
        "in units of the parameter size P.",
        "",
        "| model | variant | k | peak growth (MiB) | min–max | P (MiB) "
        "| (peak − Model(B)) / P |",
        "| --- | --- | ---: | ---: | --- | ---: | ---: |",
    ]
    base = {
        r["model"]: r["peak_bytes"] for r in rows if r["variant"] == "plain"
    }
    mib = 2**20
    for r in rows:
        excess = (r["peak_bytes"] - base[r["model"]]) / r["param_bytes"]
        lines.append(
            f"| {r['model']} | {LABELS[r['variant']]} | {r['k']} | "
            f"{r['peak_bytes'] / mib:.1f} | {r['peak_bytes_min'] / mib:.1f}–"
            f"{r['peak_bytes_max'] / mib:.1f} | {r['param_bytes'] / mib:.1f} "
            f"| {excess:+.2f} |"
        )
    return "\n".join(lines)


def sweep_table(results):
    """The dataset-size sweep, one column pair per backend measured."""
    backends = [r["backend"] for r in results]
    header = " | ".join(
        f"{b}: Model(B) | {b}: AccumModel(B, k)" for b in backends
    )
    lines = [
        f"Median of {results[0]['repeats']} fresh processes; CPU; the CNN "
        "at B = 32, k = 4, `fit` on in-memory NumPy arrays of n images. "
        "Growth of the peak resident set during `fit`, MiB (min–max).",
        "",
        f"| n | data (MiB) | {header} |",
        "| ---: | ---: |" + " ---: |" * (2 * len(backends)),
    ]
    mib = 2**20
    by = {
        (r["backend"], row["samples"], row["variant"]): row
        for r in results
        for row in r["rows"]
    }
    for n in sorted({row["samples"] for r in results for row in r["rows"]}):
        cells = []
        for b in backends:
            for variant in ("plain", "accum"):
                row = by.get((b, n, variant))
                cells.append(
                    "–"
                    if row is None
                    else f"{row['peak_bytes'] / mib:.0f} "
                    f"({row['peak_bytes_min'] / mib:.0f}–"
                    f"{row['peak_bytes_max'] / mib:.0f})"
                )
        data = next(
            row["data_bytes"]
            for r in results
            for row in r["rows"]
            if row["samples"] == n
        )
        lines.append(f"| {n} | {data / mib:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(result, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4))
    if len(models) == 1:
        axes = [axes]
    for ax, model in zip(axes, models, strict=True):
        for jit, spe, style in [
            (False, 1, "-"),
            (True, 1, "--"),
            (False, 8, ":"),
        ]:
            sub = [
                r
                for r in rows
                if r["model"] == model
                and r["jit_compile"] == jit
                and r["steps_per_execution"] == spe
            ]
            if not sub:
                continue
            for variant, color in [("accum", "C0"), ("keras_ga", "C1")]:
                pts = sorted(
                    (r["k"], r["time_ratio_to_plain"])
                    for r in sub
                    if r["variant"] == variant
                )
                if pts:
                    ks, ratios = zip(*pts, strict=True)
                    ax.plot(
                        ks,
                        ratios,
                        style,
                        color=color,
                        marker="o",
                        label=(
                            f"{LABELS[variant]}, jit {'on' if jit else 'off'}"
                            f", spe {spe}"
                        ),
                    )
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.axhline(1.03, color="grey", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("accumulation steps k")
        ax.set_ylabel("time per sample / Model(B)'s")
        ax.set_title(model)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_docs(root: Path):
    results = root / "benchmarks" / "results"
    parts = []
    tp = results / "throughput.json"
    if tp.exists():
        result = json.loads(tp.read_text())
        parts += ["### Throughput", "", throughput_table(result), ""]
        plot(result, root / "docs" / "images" / "throughput.png")
        parts += [
            "![Time per sample relative to Model(B) against k]"
            "(images/throughput.png)",
            "",
        ]
    mem = results / "memory.json"
    if mem.exists():
        parts += [
            "### Peak memory",
            "",
            memory_table(json.loads(mem.read_text())),
            "",
        ]
    sweeps = [
        json.loads(path.read_text())
        for name in ("", "_jax", "_torch")
        if (path := results / f"data_memory{name}.json").exists()
    ]
    if sweeps:
        parts += [
            "### Peak memory against the size of in-memory data",
            "",
            sweep_table(sweeps),
            "",
        ]
    page = root / "docs" / "benchmarks.md"
    text = page.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    page.write_text(text[:start] + "\n" + "\n".join(parts) + text[stop:])


if __name__ == "__main__":
    write_docs(Path(__file__).resolve().parents[1])
