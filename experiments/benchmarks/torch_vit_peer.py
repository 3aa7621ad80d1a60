"""PyTorch peer for tfmp's supervised ViT step (CPU): what `python -m tfmp.bench --method=supervised --model=vit_*` times.

    python experiments/benchmarks/torch_vit_peer.py --model=vit_small_p16 --image_size=224 --precision=bf16 --batch=8

The same network as `tfmp/models/vit.py` (the sizes are read from there by file, without importing tfmp or
TensorFlow): a stride-`patch` convolution as the patch projection, a learned position embedding, pre-norm blocks
(LayerNorm, multi-head self-attention through `F.scaled_dot_product_attention`, LayerNorm, GELU MLP), a final
LayerNorm, mean pooling and a linear layer to 10 classes. The step is cross-entropy on synthetic images and labels
with AdamW (tfmp.bench's supervised step), in float32 or under `torch.autocast(bfloat16)`. Prints one JSON line
shaped like the other peers'. PyTorch is never a tfmp dependency: this file is run only by `run_benchmarks.py`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
VIT_MODULE = os.path.join(HERE, "..", "..", "tfmp", "models", "vit.py")


def vit_sizes() -> dict[str, dict[str, int]]:
    """`SIZES` of tfmp/models/vit.py, read from its source: {"vit_small_p16": {"patch": 16, "width": 384, ...}}."""
    with open(VIT_MODULE, encoding="utf-8") as file:
        tree = ast.parse(file.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "SIZES":
            return {key.value: {keyword.arg: keyword.value.value for keyword in value.keywords}
                    for key, value in zip(node.value.keys, node.value.values)}
    raise RuntimeError(f"no SIZES in {VIT_MODULE}")


def build(torch, size: dict[str, int], image_size: int, channels: int = 3, classes: int = 10):
    nn, functional = torch.nn, torch.nn.functional
    width, heads = size["width"], size["heads"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.mlp_norm = nn.LayerNorm(width, eps=1e-6), nn.LayerNorm(width, eps=1e-6)
            self.qkv, self.output = nn.Linear(width, 3 * width), nn.Linear(width, width)
            self.mlp = nn.Sequential(nn.Linear(width, size["mlp_width"]), nn.GELU(), nn.Linear(size["mlp_width"], width))

        def forward(self, x):
            batch, tokens, _ = x.shape
            q, k, v = self.qkv(self.attention_norm(x)).view(batch, tokens, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
            attended = functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(batch, tokens, width)
            x = x + self.output(attended)
            return x + self.mlp(self.mlp_norm(x))

    class ViT(nn.Module):
        def __init__(self):
            super().__init__()
            self.patches = nn.Conv2d(channels, width, size["patch"], stride=size["patch"])
            self.position = nn.Parameter(torch.randn(1, (image_size // size["patch"]) ** 2, width) * 0.02)
            self.blocks = nn.Sequential(*[Block() for _ in range(size["depth"])])
            self.norm, self.head = nn.LayerNorm(width, eps=1e-6), nn.Linear(width, classes)

        def forward(self, images):
            x = self.patches(images).flatten(2).transpose(1, 2) + self.position
            return self.head(self.norm(self.blocks(x)).mean(dim=1))

    return ViT()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_small_p16", choices=sorted(vit_sizes()))
    parser.add_argument("--image_size", type=int, default=224)
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="bf16")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5, help="timed steps, after 2 warm-up steps")
    args = parser.parse_args()

    import torch
    sys.path.insert(0, HERE)  # run_benchmarks.py runs this file through runpy, where sys.path[0] is not its folder
    from torch_step import time_supervised_steps  # beside this file

    torch.manual_seed(0)
    model = build(torch, vit_sizes()[args.model], args.image_size)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4)
    images = torch.rand(args.batch, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.batch,))

    seconds, loss = time_supervised_steps(torch, model, optimizer, images, labels, args.precision, args.steps, warmup=2)
    print(json.dumps({
        "framework": f"torch {torch.__version__}",
        "model": args.model,
        "method": "supervised",
        "precision": args.precision,
        "batch": args.batch,
        "steps": args.steps,
        "parameters": sum(parameter.numel() for parameter in model.parameters()),
        "step_time_ms": round(1000 * seconds / args.steps, 2),
        "images_per_second": round(args.batch * args.steps / seconds, 2),
        "final_loss": round(loss, 4),
    }))


if __name__ == "__main__":
    main()
