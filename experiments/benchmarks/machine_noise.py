"""How steady is this machine? The same NumPy matmul, timed over and over, no TensorFlow.

    python experiments/benchmarks/machine_noise.py --seconds=120

The spread target of issue 6 (run-to-run spread of the median <= 10%) needs to know how much of
a benchmark's spread is the machine's own. This times one fixed float32 matmul (NumPy's BLAS,
all cores) back to back for `--seconds`, groups the timings into windows as long as one
`tfmp.bench` repeat, and prints one JSON line: the spread of single calls and of window
medians, as (max - min) / median.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=120.0)
    parser.add_argument("--size", type=int, default=1536, help="square matrix size")
    parser.add_argument("--window", type=float, default=5.0, help="seconds per window (about one bench repeat)")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    left, right = rng.random((args.size, args.size), np.float32), rng.random((args.size, args.size), np.float32)
    left @ right  # warm-up: BLAS threads start
    calls, windows, window, window_start = [], [], [], time.perf_counter()
    end = window_start + args.seconds
    while time.perf_counter() < end:
        start = time.perf_counter()
        left @ right
        calls.append(time.perf_counter() - start)
        window.append(calls[-1])
        if time.perf_counter() - window_start >= args.window:
            windows.append(statistics.median(window))
            window, window_start = [], time.perf_counter()
    print(json.dumps({
        "matmul": f"{args.size}x{args.size} float32",
        "calls": len(calls),
        "call_median_ms": round(1000 * statistics.median(calls), 2),
        "call_spread": round(spread(calls), 3),
        "windows": len(windows),
        "window_median_ms": [round(1000 * value, 2) for value in windows],
        "window_spread": round(spread(windows), 3),
    }))


if __name__ == "__main__":
    main()
