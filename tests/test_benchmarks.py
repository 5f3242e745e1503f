"""The benchmark scripts run (tiny sizes); no test asserts a timing."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_throughput_script_smoke(tmp_path):
    out = tmp_path / "throughput.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_throughput.py"),
            "--models=mlp",
            "--ks=1,4",
            "--jit=off",
            "--spe=1",
            "--rounds=1",
            "--samples-per-run=256",
            f"--out={out}",
        ],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert {(r["variant"], r["k"]) for r in rows} == {
        ("plain", 1),
        ("accum", 1),
        ("accum", 4),
        ("keras_ga", 4),
        ("large", 4),
    }
    assert all(r["samples_per_s"] > 0 for r in rows)


def test_noise_overhead_script_smoke(tmp_path):
    out = tmp_path / "noise_overhead.json"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_noise_overhead.py"),
            "--models=mlp",
            "--ks=4",
            "--jit=off",
            "--every=1,2",
            "--rounds=3",
            "--samples-per-run=256",
            f"--out={out}",
        ],
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["rows"]
    assert [r["noise_scale_every"] for r in rows] == [0, 1, 2]
    assert all(len(r["ratios"]) == 3 for r in rows)
    assert all(
        r["ratio_q1"] <= r["ratio_median"] <= r["ratio_q3"] for r in rows
    )
    assert set(report["median_over_settings"]) == {"0", "1", "2"}
