"""The README's main job at two commits, interleaved: wall time and the three accuracies of each.

    python experiments/benchmarks/main_job_speedup.py --before=92545a8 --after=HEAD --rounds=3 --out=runs/main_job_speedup

Each commit is exported with `git archive` into OUT/source/<commit> (a clean tree: no
uncommitted edits leak in) and run from there as its own fresh process
(`python -m tfmp.train --flagfile=experiments/digits_simclr.cfg`, with PYTHONPATH pointing at
that tree so its `tfmp` is the one imported). Each round runs both commits once, the order
alternating between rounds so slow drift of the machine hits both alike. Prints one row per
run, then the medians, the wall-time ratio after/before, and the accuracy differences; writes
OUT/results.json. Extra arguments after `--` go to both runs (e.g. `-- --precision=float32`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ACCURACIES = ("linear_probe_accuracy", "knn_accuracy", "supervised_baseline_accuracy")
REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def export(commit: str, out: str) -> tuple[str, str]:
    """`commit`'s tree in OUT/source/<full hash>; returns (full hash, directory)."""
    full = subprocess.run(["git", "rev-parse", commit], cwd=REPO, check=True, capture_output=True, text=True).stdout.strip()
    directory = os.path.join(out, "source", full[:12])
    if not os.path.isdir(directory):
        os.makedirs(directory)
        archive = subprocess.run(["git", "archive", full], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return full, directory


def run_once(source: str, flagfile: str, workdir: str, extra: list[str]) -> dict:
    """One fresh `tfmp.train` process from `source`; its wall seconds and metrics.json."""
    environment = dict(os.environ, PYTHONPATH=source)
    command = [sys.executable, "-m", "tfmp.train", f"--flagfile={flagfile}", f"--workdir={workdir}", *extra]
    started = time.perf_counter()
    result = subprocess.run(command, cwd=source, env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seconds = time.perf_counter() - started
    if result.returncode != 0:
        raise SystemExit(f"{source}: exit {result.returncode}:\n{result.stderr[-3000:]}")
    with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
        metrics = json.load(file)
    return {"wall_seconds": round(seconds, 2), **{key: metrics[key] for key in ACCURACIES},
            **{key: metrics.get(key) for key in ("precision", "pretrain_seconds", "evaluation_seconds", "baseline_seconds")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="92545a8", help="the commit to compare against")
    parser.add_argument("--after", default="HEAD")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--flagfile", default="experiments/digits_simclr.cfg", help="relative to each commit's tree")
    parser.add_argument("--out", default="runs/main_job_speedup")
    parser.add_argument("extra", nargs="*", help="flags for both runs, after `--`")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    commits = dict([export(args.before, out), export(args.after, out)])
    names = {full: name for full, name in zip(commits, ("before", "after"))}
    if len(commits) != 2:
        raise SystemExit("--before and --after are the same commit")

    rows = []
    for round_index in range(args.rounds):
        order = list(commits) if round_index % 2 == 0 else list(commits)[::-1]
        for full in order:
            workdir = os.path.join(out, "runs", f"{names[full]}_{full[:12]}_round{round_index}")
            if os.path.exists(workdir):
                raise SystemExit(f"{workdir} exists: choose a new --out (a rerun would resume, not measure)")
            row = {"commit": full[:12], "which": names[full], "round": round_index,
                   **run_once(commits[full], args.flagfile, workdir, args.extra)}
            rows.append(row)
            print(json.dumps(row), flush=True)

    summary = {}
    for which in ("before", "after"):
        mine = [row for row in rows if row["which"] == which]
        summary[which] = {"commit": mine[0]["commit"], "wall_seconds_median": statistics.median(row["wall_seconds"] for row in mine),
                          **{f"{key}_median": statistics.median(row[key] for row in mine) for key in ACCURACIES}}
    summary["wall_ratio_after_over_before"] = round(summary["after"]["wall_seconds_median"] / summary["before"]["wall_seconds_median"], 3)
    summary["accuracy_difference_points"] = {
        key: round(100 * (summary["after"][f"{key}_median"] - summary["before"][f"{key}_median"]), 2) for key in ACCURACIES}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as file:
        json.dump({"rows": rows, "summary": summary, "extra_flags": args.extra}, file, indent=2)

    print(f"\n{'':8} {'commit':13} {'wall s':>8} " + " ".join(f"{key.split('_accuracy')[0]:>22}" for key in ACCURACIES))
    for which in ("before", "after"):
        line = summary[which]
        print(f"{which:8} {line['commit']:13} {line['wall_seconds_median']:8.1f} "
              + " ".join(f"{line[f'{key}_median']:22.4f}" for key in ACCURACIES))
    print(f"wall-time ratio after/before (medians of {args.rounds} rounds): {summary['wall_ratio_after_over_before']:.3f}")
    print("accuracy after - before (points): " + ", ".join(f"{key} {value:+.2f}"
                                                            for key, value in summary["accuracy_difference_points"].items()))


if __name__ == "__main__":
    main()
