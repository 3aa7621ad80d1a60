"""Runs every digits SSL preset under each precision and on 2 CPU replicas, and prints the comparison table.

    python experiments/compare_ssl_methods.py --out=runs/compare_ssl

Each cell is one `python -m tfmp.train` process (through `run_matrix.py`, finished cells are skipped on a
rerun). The supervised baseline is trained once per precision and strategy, in the SimCLR cell: it is seeded
per label draw and does not depend on the method (tests/test_presentation.py checks that every preset's
baseline is the same), so the other methods' cells run with `--compare_supervised=false` — but for a preset of
another encoder (MAE's ViT), which trains and compares with its own baseline. "fine-tuned" is the pretrained
encoder fine-tuned on each draw's labels, for presets that ask for it (`--compare_finetune`, MAE's). The table's
"pretrain s" is the pretraining phase alone (`pretrain_seconds`); cells run one after another on the same
cores, but other work on the machine changes them — the accuracies are the comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("simclr", "byol", "vicreg", "barlow_twins", "mocov3", "dino", "mae")
CELLS = (("float32", "off"), ("mixed_bfloat16", "off"), ("float32", "mirrored:2"))


def preset_model(method: str) -> str:
    """The `--model` of the method's digits preset."""
    with open(os.path.join(HERE, f"digits_{method}.cfg"), encoding="utf-8") as file:
        return next(line.strip().split("=", 1)[1] for line in file if line.startswith("--model="))


def cell_metrics(out: str, method: str, precision: str, strategy: str) -> dict | None:
    path = os.path.join(out, method, f"{precision}_{strategy.replace(':', '')}", "metrics.json")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as file:
        return json.load(file)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--cells", default=",".join(f"{p}@{s}" for p, s in CELLS), help="precision@strategy,...")
    parser.add_argument("--table_only", action="store_true", help="print the table of the cells already run")
    args = parser.parse_args()
    cells = [tuple(cell.split("@")) for cell in args.cells.split(",")]
    methods = args.methods.split(",")
    if not args.table_only:
        # SimCLR's cells first: they hold the baseline the other presets of the same encoder compare with.
        shares_baseline = any(preset_model(name) == preset_model("simclr") for name in methods)
        for method in (["simclr"] if shares_baseline else []) + [name for name in methods if name != "simclr"]:
            for precision, strategy in cells:
                own_baseline = method == "simclr" or preset_model(method) != preset_model("simclr")
                extra = [] if own_baseline else ["--", "--compare_supervised=false"]
                subprocess.run([sys.executable, os.path.join(HERE, "run_matrix.py"), f"--flagfile={HERE}/digits_{method}.cfg",
                                f"--precisions={precision}", f"--strategies={strategy}", f"--out={os.path.join(args.out, method)}",
                                *extra], check=True, stdout=subprocess.DEVNULL)

    print("| method | precision | replicas | linear probe | kNN | fine-tuned | supervised baseline | probe − baseline | pretrain s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for method in methods:
        for precision, strategy in cells:
            metrics = cell_metrics(args.out, method, precision, strategy)
            if metrics is None:
                continue
            baseline = metrics if "supervised_baseline_accuracy" in metrics else cell_metrics(args.out, "simclr", precision, strategy)
            base = (baseline or {}).get("supervised_baseline_accuracy")
            gain = f"{metrics['linear_probe_accuracy'] - base:+.3f}" if base is not None else "n/a"
            finetuned = f"{metrics['finetune_accuracy']:.3f}" if "finetune_accuracy" in metrics else "—"
            print(f"| {method} | {precision} | {metrics['num_replicas']} | {metrics['linear_probe_accuracy']:.3f} | "
                  f"{metrics['knn_accuracy']:.3f} | {finetuned} | {base if base is None else f'{base:.3f}'} | {gain} | "
                  f"{metrics['pretrain_seconds']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
