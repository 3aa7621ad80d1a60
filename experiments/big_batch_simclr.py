"""What a big batch buys SimCLR on digits when it does not fit: micro-batches with gradient caching against the largest
batch that fits, and against the big batch run whole (the reference the micro-batches must reproduce).

    python experiments/big_batch_simclr.py --out=runs/big_batch --device_memory=24MiB

Each row is one `python -m tfmp.train --flagfile=experiments/digits_simclr.cfg` process, one after another (finished
rows are skipped on a rerun): the main job's recipe with `--global_batch_size` and `--gradient_accumulation_steps`
changed, `--compare_supervised=false` (the baseline does not depend on the batch of pretraining). The first column
says what the memory plan for `--device_memory` answered (`--dry_run`); the whole big batch is run with
`--ignore_memory_estimate`, as the reference. "pretrain s" is the pretraining phase alone (`pretrain_seconds`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROWS = ((128, 1), (1024, 8), (1024, 1))  # (global batch, micro-batches)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device_memory", default="24MiB", help="the device the plan is asked about")
    parser.add_argument("--epochs", type=int, default=100)
    args = parser.parse_args()
    common = [sys.executable, "-m", "tfmp.train", f"--flagfile={HERE}/digits_simclr.cfg", "--compare_supervised=false",
              f"--epochs={args.epochs}", f"--device_memory={args.device_memory}"]
    print(f"| global batch | micro-batches | plan for {args.device_memory} | steps | linear probe | kNN | pretrain s |")
    print("|---|---|---|---|---|---|---|")
    for batch, steps in ROWS:
        workdir = os.path.join(args.out, f"b{batch}_k{steps}")
        flags = [f"--global_batch_size={batch}", f"--gradient_accumulation_steps={steps}"]
        plan_dir = workdir + "_plan"
        if not os.path.exists(os.path.join(plan_dir, "memory_estimate.json")):
            subprocess.run([*common, *flags, f"--workdir={plan_dir}", "--dry_run"], check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(plan_dir, "memory_estimate.json"), encoding="utf-8") as file:
            plan = json.load(file)["plan"]
        if not os.path.exists(os.path.join(workdir, "metrics.json")):
            subprocess.run([*common, *flags, f"--workdir={workdir}", "--ignore_memory_estimate"], check=True,
                           stdout=subprocess.DEVNULL)
        with open(os.path.join(workdir, "metrics.json"), encoding="utf-8") as file:
            metrics = json.load(file)
        verdict = "fits" if plan["fits"] else "does not fit"
        print(f"| {batch} | {steps} | {verdict} | {metrics['steps']} | {metrics['linear_probe_accuracy']:.3f} | "
              f"{metrics['knn_accuracy']:.3f} | {metrics['pretrain_seconds']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
