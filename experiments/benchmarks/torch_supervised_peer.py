"""PyTorch peer for tfmp's supervised ResNet-18 step (CPU): what `python -m tfmp.bench --method=supervised` times.

    python experiments/benchmarks/torch_supervised_peer.py --peer=../shared/bench/torch_simclr_peer.py \
        --precision=bf16 --batch=64 --steps=5

The network is the SimCLR peer's own `CifarResNet18` (loaded from that file, so the two peers cannot
drift apart), followed by a linear layer to 10 classes; the step is cross-entropy on synthetic 32x32x3
images and labels, SGD with momentum and weight decay (the SimCLR peer's optimizer), channels-last, in
float32 or under `torch.autocast(bfloat16)`. Prints one JSON line shaped like the SimCLR peer's.
PyTorch is never a tfmp dependency: this file is run only by `run_benchmarks.py --method=supervised`.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SIMCLR_PEER = os.path.join(HERE, "..", "..", "..", "shared", "bench", "torch_simclr_peer.py")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", default=SIMCLR_PEER, help="path of torch_simclr_peer.py, whose CifarResNet18 is used")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20, help="timed steps, after 3 warm-up steps")
    args = parser.parse_args()

    import torch
    sys.path.insert(0, HERE)  # run_benchmarks.py runs this file through runpy, where sys.path[0] is not its folder
    from torch_step import time_supervised_steps  # beside this file

    resnet = runpy.run_path(args.peer)["CifarResNet18"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(resnet(), torch.nn.Linear(512, 10)).to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
    images = torch.rand(args.batch, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    labels = torch.randint(0, 10, (args.batch,))

    seconds, loss = time_supervised_steps(torch, model, optimizer, images, labels, args.precision, args.steps, warmup=3)
    print(json.dumps({
        "framework": f"torch {torch.__version__}",
        "method": "supervised",
        "precision": args.precision,
        "batch": args.batch,
        "steps": args.steps,
        "images_per_second": round(args.batch * args.steps / seconds, 2),
        "final_loss": round(loss, 4),
    }))


if __name__ == "__main__":
    main()
