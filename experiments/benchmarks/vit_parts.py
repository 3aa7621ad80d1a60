"""Where a ViT step's time goes, part by part, tfmp (Keras layers as `tfmp/models/vit.py` builds them) against PyTorch.

    python experiments/benchmarks/vit_parts.py --rounds=3          # both frameworks, float32 and bf16, interleaved
    python experiments/benchmarks/vit_parts.py --framework=tf --precision=bf16 --rounds=1   # one process's figures

Each part runs forward and backward (gradients of a sum of its output with respect to its input and weights) at
ViT-S/16's shapes — 8 images x 197 tokens, width 384, 6 heads, MLP 1536 — and is timed as the median of `--repeats`
calls after `--warmup` calls, in a process of its own per (framework, precision), the frameworks interleaved round by
round. tfmp's parts run as a `tf.function` under the Keras policy (`mixed_bfloat16` for bf16); PyTorch's in eager mode
under `torch.autocast("cpu", torch.bfloat16)` (as the peer benchmark `torch_vit_peer.py` steps). Parts:

    layer_norm        tfmp's LayerNormalization (`tfmp.models.fused`) / nn.LayerNorm
    layer_norm_keras  Keras' own LayerNormalization / nn.LayerNorm
    attention         MultiHeadAttention (q, k, v, output projections) / Linear qkv + scaled_dot_product_attention + Linear
    mlp               tfmp's Dense(1536, gelu) + Dense(384) / Linear + GELU + Linear
    mlp_keras         Keras' own Dense(1536, gelu) + Dense(384) / Linear + GELU + Linear
    mlp_no_gelu       the MLP with its activation removed
    gelu              the exact GELU alone on the (8, 197, 1536) hidden tensor: `tfmp.models.fused.gelu` / F.gelu
    gelu_keras        the same with TensorFlow's `tf.nn.gelu` (Keras' own) / F.gelu
    gelu_tanh         its tanh approximation (a different function)
    gelu_float32      the exact GELU of the bf16 tensor computed by TensorFlow in float32 and cast back
    block             one pre-norm transformer block as tfmp builds it (all of the above and the residuals)
    block_keras       the same block from Keras' own LayerNormalization and Dense
    adamw_update      AdamW's apply over ViT-S/16's 21.7M parameters as one matrix (one update, gradients given)

PyTorch's figure for a `_keras` part is its figure for the part without the suffix (the same PyTorch module).

Prints one JSON line per (framework, precision, part, round), then a table of medians over rounds. PyTorch is never a
tfmp dependency: it is imported only in the child processes that time it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH, TOKENS, WIDTH, HEADS, MLP = 8, 197, 384, 6, 1536
VIT_S16_PARAMETERS = 21_664_512  # tfmp's vit_small_p16 encoder (tests/test_vit.py derives it from timm's count)
PARTS = ("layer_norm", "layer_norm_keras", "attention", "mlp", "mlp_keras", "mlp_no_gelu", "gelu", "gelu_keras", "gelu_tanh",
         "gelu_float32", "block", "block_keras", "adamw_update")


def _median_ms(call, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def time_tf(precision: str, warmup: int, repeats: int) -> dict[str, float]:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np
    import tensorflow as tf

    keras.mixed_precision.set_global_policy("mixed_bfloat16" if precision == "bf16" else "float32")
    layers = keras.layers
    compute = tf.bfloat16 if precision == "bf16" else tf.float32
    # The tokens a block receives are in the compute dtype (the patch embedding's output), as in tfmp's ViT.
    x = tf.cast(np.random.default_rng(0).normal(size=(BATCH, TOKENS, WIDTH)).astype("float32"), compute)
    hidden = tf.constant(np.random.default_rng(1).normal(size=(BATCH, TOKENS, MLP)).astype("float32"))

    from tfmp.models import fused

    def mlp(activation, dense=fused.Dense):
        dense_in, dense_out = dense(MLP, activation=activation), layers.Dense(WIDTH)
        return lambda inputs: dense_out(dense_in(inputs))

    def block(norm=fused.LayerNormalization, dense=fused.Dense):
        attention_norm, mlp_norm = norm(epsilon=1e-6), norm(epsilon=1e-6)
        attention = layers.MultiHeadAttention(HEADS, key_dim=WIDTH // HEADS)
        feed_forward = mlp("gelu", dense)

        def call(inputs):
            y = attention_norm(inputs)
            inputs = inputs + attention(y, y)
            return inputs + feed_forward(mlp_norm(inputs))
        return call

    attention_layer = layers.MultiHeadAttention(HEADS, key_dim=WIDTH // HEADS)
    builders = {"layer_norm": lambda: fused.LayerNormalization(epsilon=1e-6),
                "layer_norm_keras": lambda: layers.LayerNormalization(epsilon=1e-6),
                "attention": lambda: lambda y: attention_layer(y, y), "mlp": lambda: mlp("gelu"),
                "mlp_keras": lambda: mlp("gelu", layers.Dense), "mlp_no_gelu": lambda: mlp(None), "block": block,
                "block_keras": lambda: block(layers.LayerNormalization, layers.Dense)}
    results = {}
    for part, build in builders.items():
        layer = build()
        layer(x)  # creates the weights

        @tf.function
        def step(layer=layer):
            with tf.GradientTape() as tape:
                tape.watch(x)
                loss = tf.reduce_sum(tf.cast(layer(x), tf.float32))
            watched = [x] + [variable for variable in tape.watched_variables() if variable.trainable]
            return tape.gradient(loss, watched)

        results[part] = _median_ms(step, warmup, repeats)

    gelus = {"gelu": fused.gelu, "gelu_keras": lambda t: tf.nn.gelu(t, approximate=False),
             "gelu_tanh": lambda t: tf.nn.gelu(t, approximate=True),
             "gelu_float32": lambda t: tf.cast(tf.nn.gelu(tf.cast(t, tf.float32), approximate=False), t.dtype)}
    source = tf.cast(hidden, compute)
    for part, gelu in gelus.items():

        @tf.function
        def gelu_step(gelu=gelu):
            with tf.GradientTape() as tape:
                tape.watch(source)
                loss = tf.reduce_sum(tf.cast(gelu(source), tf.float32))
            return tape.gradient(loss, source)

        results[part] = _median_ms(gelu_step, warmup, repeats)

    variables = [keras.Variable(np.zeros((VIT_S16_PARAMETERS // 1000, 1000), "float32"))]
    gradients = [tf.ones_like(variables[0].value)]
    optimizer = keras.optimizers.AdamW(1e-3, weight_decay=0.05)
    optimizer.build(variables)
    apply = tf.function(lambda: optimizer.apply(gradients, variables))
    results["adamw_update"] = _median_ms(apply, warmup, repeats)
    return results


def time_torch(precision: str, warmup: int, repeats: int) -> dict[str, float]:
    import torch

    torch.manual_seed(0)
    nn, functional = torch.nn, torch.nn.functional
    x = torch.randn(BATCH, TOKENS, WIDTH, requires_grad=True)
    hidden = torch.randn(BATCH, TOKENS, MLP)
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if precision == "bf16" else None

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.output = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)

        def forward(self, y):
            q, k, v = self.qkv(y).view(BATCH, TOKENS, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
            return self.output(functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(BATCH, TOKENS, WIDTH))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention_norm, self.mlp_norm = nn.LayerNorm(WIDTH, eps=1e-6), nn.LayerNorm(WIDTH, eps=1e-6)
            self.attention = Attention()
            self.mlp = nn.Sequential(nn.Linear(WIDTH, MLP), nn.GELU(), nn.Linear(MLP, WIDTH))

        def forward(self, y):
            y = y + self.attention(self.attention_norm(y))
            return y + self.mlp(self.mlp_norm(y))

    modules = {"layer_norm": nn.LayerNorm(WIDTH, eps=1e-6), "attention": Attention(),
               "mlp": nn.Sequential(nn.Linear(WIDTH, MLP), nn.GELU(), nn.Linear(MLP, WIDTH)),
               "mlp_no_gelu": nn.Sequential(nn.Linear(WIDTH, MLP), nn.Linear(MLP, WIDTH)), "block": Block()}

    def forward_backward(function, inputs):
        def call():
            if autocast:
                with autocast():
                    loss = function(inputs).float().sum()
            else:
                loss = function(inputs).float().sum()
            loss.backward()
        return call

    results = {part: _median_ms(forward_backward(module, x), warmup, repeats) for part, module in modules.items()}
    source = (hidden.to(torch.bfloat16) if precision == "bf16" else hidden).requires_grad_(True)
    gelus = {"gelu": functional.gelu, "gelu_tanh": lambda t: functional.gelu(t, approximate="tanh"),
             "gelu_float32": lambda t: functional.gelu(t.float()).to(t.dtype)}
    for part, gelu in gelus.items():
        results[part] = _median_ms(forward_backward(gelu, source), warmup, repeats)
    parameters = [nn.Parameter(torch.zeros(VIT_S16_PARAMETERS // 1000, 1000))]
    parameters[0].grad = torch.ones_like(parameters[0])
    optimizer = torch.optim.AdamW(parameters, lr=1e-3, weight_decay=0.05)
    results["adamw_update"] = _median_ms(optimizer.step, warmup, repeats)
    return results


def child(framework: str, precision: str, warmup: int, repeats: int) -> None:
    results = (time_tf if framework == "tf" else time_torch)(precision, warmup, repeats)
    print(json.dumps({"framework": framework, "precision": precision, "milliseconds": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framework", choices=("tf", "torch"), help="time one framework in this process (a child run)")
    parser.add_argument("--precision", default="float32,bf16", help="comma-separated: float32, bf16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    precisions = args.precision.split(",")
    if args.framework:
        for precision in precisions:
            child(args.framework, precision, args.warmup, args.repeats)
        return
    figures: dict[tuple[str, str, str], list[float]] = {}
    for round_index in range(args.rounds):
        for precision in precisions:
            for framework in ("tf", "torch"):
                output = subprocess.run([sys.executable, __file__, f"--framework={framework}", f"--precision={precision}",
                                         f"--warmup={args.warmup}", f"--repeats={args.repeats}"], capture_output=True, text=True,
                                        check=True).stdout.strip().splitlines()[-1]
                record = json.loads(output)
                print(json.dumps({"round": round_index, **record}), flush=True)
                for part, milliseconds in record["milliseconds"].items():
                    figures.setdefault((precision, part, framework), []).append(milliseconds)
                    if framework == "torch" and f"{part}_keras" in PARTS:
                        figures.setdefault((precision, f"{part}_keras", framework), []).append(milliseconds)
    print(f"\nmedians of {args.rounds} rounds, ms per call (forward + backward; the update alone for adamw_update)")
    print(f"{'precision':<10}{'part':<18}{'tfmp':>9}{'PyTorch':>9}{'tfmp/PyTorch':>14}")
    for precision in precisions:
        for part in PARTS:
            tf_ms = statistics.median(figures[(precision, part, "tf")])
            torch_ms = statistics.median(figures[(precision, part, "torch")])
            print(f"{precision:<10}{part:<18}{tf_ms:>9.2f}{torch_ms:>9.2f}{tf_ms / torch_ms:>13.2f}x")


if __name__ == "__main__":
    main()
