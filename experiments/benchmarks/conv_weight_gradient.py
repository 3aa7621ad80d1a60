"""One convolution, forward + weight gradient, in TensorFlow and (if installed) PyTorch: where tfmp's bf16 time goes.

    python experiments/benchmarks/conv_weight_gradient.py            # add ONEDNN_VERBOSE=1 to see oneDNN's kernel
    python experiments/benchmarks/conv_weight_gradient.py --shape=128,4,4,512 --out_channels=512   # stage 4

Weight gradient of a 3x3 convolution, by default 256->256 on a 128x8x8 NHWC batch (ResNet-18's third
stage at batch 64 x 2 views), float32 and bf16, median of --repeats timed calls after warm-up. Both frameworks
call the same oneDNN kernel here (`jit_bf16:avx512_core_bf16`, backward_weights); BUILD_NOTES.md
("Performance") records the figures and what they say about TF's threadpool.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SHAPE, CHANNELS = (128, 8, 8, 256), 256


def tensorflow_milliseconds(dtype_name: str, repeats: int) -> float:
    """Median ms of forward + weight gradient of SHAPE's convolution in TensorFlow."""
    import tensorflow as tf

    dtype = tf.bfloat16 if dtype_name == "bf16" else tf.float32
    inputs = tf.cast(tf.random.normal(SHAPE), dtype)
    kernel = tf.Variable(tf.random.normal((3, 3, SHAPE[-1], CHANNELS)))

    @tf.function
    def weight_gradient():
        with tf.GradientTape() as tape:
            outputs = tf.nn.conv2d(inputs, tf.cast(kernel, dtype), 1, "SAME")
            loss = tf.reduce_sum(tf.cast(outputs, tf.float32))
        return loss, tape.gradient(loss, kernel)  # the loss too, or graph pruning drops the forward pass

    times = []
    for index in range(repeats + 3):
        start = time.perf_counter()
        weight_gradient()[1].numpy()
        if index >= 3:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def torch_milliseconds(dtype_name: str, repeats: int) -> float:
    """The same in PyTorch (channels-last, autocast for bf16)."""
    import torch

    inputs = torch.randn(SHAPE[0], SHAPE[3], SHAPE[1], SHAPE[2]).to(memory_format=torch.channels_last)
    convolution = torch.nn.Conv2d(SHAPE[3], CHANNELS, 3, 1, 1, bias=False).to(memory_format=torch.channels_last)
    times = []
    for index in range(repeats + 3):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype_name == "bf16"):
            outputs = convolution(inputs)
        outputs.float().sum().backward()
        if index >= 3:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    global SHAPE, CHANNELS  # the two timing functions read them
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--shape", default=",".join(map(str, SHAPE)), help="input batch, N,H,W,C (NHWC)")
    parser.add_argument("--out_channels", type=int, default=CHANNELS)
    args = parser.parse_args()
    SHAPE, CHANNELS = tuple(int(size) for size in args.shape.split(",")), args.out_channels
    result = {"shape_nhwc": SHAPE, "out_channels": CHANNELS, "note": "both: forward convolution + weight gradient"}
    for dtype_name in ("float32", "bf16"):
        result[f"tensorflow_{dtype_name}_ms"] = round(tensorflow_milliseconds(dtype_name, args.repeats), 2)
        if importlib.util.find_spec("torch") is not None:
            result[f"torch_{dtype_name}_ms"] = round(torch_milliseconds(dtype_name, args.repeats), 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
