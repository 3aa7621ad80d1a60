"""Runs one preset under several precisions, strategies and variants and prints a Markdown table.

This is how the result tables in BUILD_NOTES.md are produced, e.g.

    python experiments/run_matrix.py --flagfile=experiments/digits_supervised.cfg \
        --precisions=float32,mixed_bfloat16,mixed_float16 --strategies=off,mirrored:2 --out=runs/matrix_supervised

Each cell is a separate `python -m tfmp.train` process (a fresh TensorFlow, as a user
would run it) in its own workdir under --out (what it printed goes to `output.txt` there);
rerunning skips finished cells.
`mirrored:2` means `--strategy=mirrored --num_cpu_devices=2`. A sweep over recipes gives each
variant a name and its flags (`--variant="byol_lr3e-3=--task=byol --learning_rate=0.003"`, repeated).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

COLUMNS = ("variant", "task", "precision", "strategy", "num_replicas", "eval_accuracy", "linear_probe_accuracy", "knn_accuracy",
           "supervised_baseline_accuracy", "train_loss", "loss_scale", "skipped_steps", "pretrain_seconds", "wall_seconds")


def strategy_flags(strategy: str) -> list[str]:
    name, _, devices = strategy.partition(":")
    return [f"--strategy={name}"] + ([f"--num_cpu_devices={devices}"] if devices else [])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flagfile", required=True)
    parser.add_argument("--precisions", default="float32,mixed_bfloat16,mixed_float16")
    parser.add_argument("--strategies", default="off")
    parser.add_argument("--out", required=True, help="parent folder of the cells' workdirs")
    parser.add_argument("--variant", action="append", default=[], help="NAME=FLAGS: a named set of extra flags (repeatable)")
    parser.add_argument("extra", nargs="*", help="more tfmp.train flags for every cell, after --")
    args = parser.parse_args()
    variants = [variant.partition("=")[::2] for variant in args.variant] or [("", "")]

    rows = []
    for name, variant_flags in variants:
        for strategy in args.strategies.split(","):
            for precision in args.precisions.split(","):
                cell = "_".join(part for part in (name, precision, strategy.replace(":", "")) if part)
                workdir = os.path.join(args.out, cell)
                command = [sys.executable, "-m", "tfmp.train", f"--flagfile={args.flagfile}", f"--workdir={workdir}",
                           f"--precision={precision}", *strategy_flags(strategy), *args.extra, *variant_flags.split()]
                print("$", " ".join(command[1:]), file=sys.stderr, flush=True)
                result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                if os.path.isdir(workdir):  # what the run printed, kept beside its metrics
                    with open(os.path.join(workdir, "output.txt"), "w", encoding="utf-8") as file:
                        file.write(result.stdout + result.stderr)
                if result.returncode:
                    print(result.stderr[-2000:], file=sys.stderr)
                    rows.append({"variant": name, "precision": precision, "strategy": strategy,
                                 "train_loss": f"failed (exit {result.returncode})"})
                    continue
                with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
                    rows.append({"variant": name, **json.load(file)})

    columns = [column for column in COLUMNS if any(row.get(column) not in (None, "") for row in rows)]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for row in rows:
        timed = ("wall_seconds", "pretrain_seconds")
        cells = [f"{row[column]:.1f}" if column in timed and column in row else row.get(column, "") for column in columns]
        print("| " + " | ".join(f"{cell:.4f}" if isinstance(cell, float) else str(cell) for cell in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
