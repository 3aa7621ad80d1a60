"""Runs the throughput/memory matrix of the SimCLR (or supervised) step and draws it.

    python experiments/benchmarks/run_benchmarks.py --precisions=float32,mixed_bfloat16 --batches=64,256 \
        --rounds=3 --out=runs/bench

Each round runs every configuration once (a fresh `python -m tfmp.bench` process each),
in an order that rotates between rounds, so slow drift of the machine hits all
configurations alike. Runners: `tfmp` (the step tfmp trains), `keras` (the same network
with Keras' own BatchNormalization: what plain Keras gives), and, when PyTorch is
importable, the peer benchmark `shared/bench/torch_simclr_peer.py` (same model, batch and
step; its peak RSS is read by a wrapper, the peer itself prints only images/s). With
`--method=supervised` every runner times the supervised step instead (ResNet-18 + a linear
layer to 10 classes, cross-entropy); the peer is then `torch_supervised_peer.py` beside this
file, built on the SimCLR peer's own ResNet-18; with a ViT `--model` (supervised only) it is `torch_vit_peer.py`, the
same ViT written in PyTorch. MFU: tfmp's own figure, and for the other runners the same FLOPs per image at their
speed over the same peak (the formula is in tfmp's JSON lines).
Writes OUT/results.json (every measurement), OUT/summary.json (median per configuration)
and OUT/benchmark.png (images/s and peak memory), and prints the summary as a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PEER = os.path.join(HERE, "..", "..", "..", "shared", "bench", "torch_simclr_peer.py")
SUPERVISED_PEER = os.path.join(HERE, "torch_supervised_peer.py")
VIT_PEER = os.path.join(HERE, "torch_vit_peer.py")


PEER_WITH_PEAK_RSS = ("import json, resource, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
                      "print(json.dumps({'peak_rss_mb': round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}))")


def tfmp_command(precision, batch, steps, model="resnet18_cifar", method="simclr", image_size=0, keras_batchnorm=False):
    return [sys.executable, "-m", "tfmp.bench", f"--model={model}", f"--method={method}", f"--batch={batch}",
            f"--steps={steps}", "--repeats=1", f"--precision={precision}", "--allow_emulated_bf16"] + (
                [f"--image_size={image_size}"] if image_size else []) + (
                ["--keras_batchnorm"] if keras_batchnorm else [])  # this script warns about emulated bf16 itself


def keras_command(precision, batch, steps, model="resnet18_cifar", method="simclr", image_size=0):
    return tfmp_command(precision, batch, steps, model, method, image_size, keras_batchnorm=True)


def peer_command(precision, batch, steps, peer=PEER, method="simclr", model="resnet18_cifar", image_size=0):
    short = {"float32": "fp32", "mixed_bfloat16": "bf16"}[precision]
    # The supervised peers are this folder's scripts; the ResNet one takes the SimCLR peer's ResNet-18 from `peer`.
    if model.startswith("vit_"):
        script, extra = VIT_PEER, [f"--model={model}"] + ([f"--image_size={image_size}"] if image_size else [])
    else:
        script, extra = (peer, []) if method == "simclr" else (SUPERVISED_PEER, [f"--peer={peer}"])
    return [sys.executable, "-c", PEER_WITH_PEAK_RSS, script, f"--precision={short}", f"--batch={batch}", f"--steps={steps}", *extra]


def has_peer(model: str, method: str) -> bool:
    """Whether a PyTorch peer times this step: ResNet-18 (SimCLR, supervised) and the ViTs (supervised)."""
    return model == "resnet18_cifar" or (model.startswith("vit_") and method == "supervised")


COMMANDS = {"tfmp": tfmp_command, "keras": keras_command}


def measure(command) -> dict:
    """Runs one benchmark process; merges the JSON lines it prints (the peer's wrapper adds one)."""
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    row = {}
    for line in result.stdout.strip().splitlines():
        if line.startswith("{"):
            row.update(json.loads(line))
    return row


def run_matrix(args) -> list[dict]:
    """Every configuration once per round, in an order that rotates between rounds."""
    have_torch = importlib.util.find_spec("torch") is not None and os.path.exists(args.peer)
    if "torch" in args.runners and not have_torch:
        print(f"torch runner skipped: torch not importable or no peer at {args.peer}", file=sys.stderr)
    runners = [r for r in args.runners.split(",") if r != "torch" or (have_torch and has_peer(args.model, args.method))]
    configs = [(runner, p, int(b)) for runner in runners for b in args.batches.split(",") for p in args.precisions.split(",")
               if runner != "torch" or p in ("float32", "mixed_bfloat16")]
    results = []
    for round_index in range(args.rounds):
        shift = round_index % len(configs)
        for framework, precision, batch in configs[shift:] + configs[:shift]:
            if framework == "torch":
                command = peer_command(precision, batch, args.steps, args.peer, args.method, args.model, args.image_size)
            else:
                command = COMMANDS[framework](precision, batch, args.steps, args.model, args.method, args.image_size)
            print("$", " ".join(command[1:]), file=sys.stderr, flush=True)
            row = measure(command)
            row.update(runner=framework, precision=precision, round=round_index)
            results.append(row)
    return results


def summarize(results: list[dict]) -> list[dict]:
    """Median, min and max images/s and median peak RSS per (runner, precision, batch), in first-seen order."""
    configs = list(dict.fromkeys((r["runner"], r["precision"], r["batch"]) for r in sorted(results, key=lambda r: r["round"])))
    summary = []
    for framework, precision, batch in configs:
        rows = [r for r in results if (r["runner"], r["precision"], r["batch"]) == (framework, precision, batch)]
        speeds = [r["images_per_second"] for r in rows]
        summary.append({"runner": framework, "precision": precision, "batch": batch,
                        "images_per_second": statistics.median(speeds), "min": min(speeds), "max": max(speeds),
                        "spread": (max(speeds) - min(speeds)) / statistics.median(speeds),
                        "peak_rss_mb": statistics.median(r["peak_rss_mb"] for r in rows) if "peak_rss_mb" in rows[0] else None})
    for row in summary:  # MFU: tfmp's FLOPs per image and peak for this precision, at each runner's speed
        measured = [r for r in results if r["runner"] == "tfmp" and r["precision"] == row["precision"] and r.get("mfu")]
        if measured:
            flops_per_image = statistics.median(r["gflops_per_second"] / r["images_per_second"] for r in measured)
            peak = statistics.median(r["gflops_per_second"] / r["mfu"] for r in measured)
            row["mfu"] = round(flops_per_image * row["images_per_second"] / peak, 3)
    return summary


def draw(summary: list[dict], title: str, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['runner']}\n{r['precision'].replace('mixed_', '')}\nB={r['batch']}" for r in summary]
    figure, (speed_axis, memory_axis) = plt.subplots(1, 2, figsize=(max(6, 1.6 * len(summary)), 4))
    medians = [r["images_per_second"] for r in summary]
    spans = [[m - r["min"] for m, r in zip(medians, summary)], [r["max"] - m for m, r in zip(medians, summary)]]
    speed_axis.bar(labels, medians, yerr=spans, capsize=3, color="tab:blue")
    speed_axis.set_title(f"{title}: images/s (median; bars: min-max over rounds)", fontsize=9)
    memory_axis.bar(labels, [r["peak_rss_mb"] or 0 for r in summary], color="tab:orange")
    memory_axis.set_title("peak RSS (MB)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precisions", default="float32,mixed_bfloat16")
    parser.add_argument("--batches", default="64")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--method", default="simclr", choices=("simclr", "supervised"), help="the step every runner times")
    parser.add_argument("--model", default="resnet18_cifar", help="tfmp/keras runners' encoder (peers: ResNet-18, and the ViTs "
                                                                   "for --method=supervised)")
    parser.add_argument("--image_size", type=int, default=0, help="image side (0: the model's usual: 32, or tfmp.bench's)")
    parser.add_argument("--runners", default="tfmp,keras,torch", help="tfmp, keras (plain Keras BatchNorm), torch (when installed)")
    parser.add_argument("--peer", default=PEER, help="path of torch_simclr_peer.py (default: the shared/ folder beside the repo)")
    parser.add_argument("--from_results", default="", help="re-summarise and redraw an earlier results.json instead of measuring")
    parser.add_argument("--no_chart", action="store_true", help="write results and summary only (no matplotlib needed)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    # Checked before minutes of measuring, not at the chart after them.
    if not args.no_chart and importlib.util.find_spec("matplotlib") is None:
        print("run_benchmarks: error: the chart needs matplotlib, which is not installed; "
              "pip install -e \".[bench]\", or pass --no_chart", file=sys.stderr)
        return 2
    if not args.from_results and "mixed_bfloat16" in args.precisions.split(","):
        from tfmp import bench

        if bench.bf16_emulated():
            print("run_benchmarks: warning: mixed_bfloat16 is emulated on this CPU (no AVX512_BF16 or AMX): its runs take many "
                  "times float32's; its figures say nothing about bf16 hardware", file=sys.stderr, flush=True)
    os.makedirs(args.out, exist_ok=True)

    if args.from_results:
        with open(args.from_results, encoding="utf-8") as file:
            results = json.load(file)
    else:
        results = run_matrix(args)
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as file:
        json.dump(results, file, indent=1)
    summary = summarize(results)
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as file:
        json.dump(summary, file, indent=1)
    print("| runner | precision | batch | images/s (median) | spread | MFU | peak RSS MB |")
    print("|---|---|---|---|---|---|---|")
    for row in summary:
        print(f"| {row['runner']} | {row['precision']} | {row['batch']} | {row['images_per_second']:.1f} | {row['spread']:.1%} | "
              f"{row.get('mfu', 'n/a')} | {row['peak_rss_mb'] if row['peak_rss_mb'] is not None else 'n/a'} |")
    model = results[0].get("model", args.model) if results else args.model
    if not args.no_chart:
        method = results[0].get("method", args.method) if results else args.method
        draw(summary, f"{'SimCLR' if method == 'simclr' else 'supervised'} {model} step", os.path.join(args.out, "benchmark.png"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
