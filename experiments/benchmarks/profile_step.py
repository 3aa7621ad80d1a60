"""Where the SimCLR step's time goes, by TensorFlow op type (the table in BUILD_NOTES.md).

    python experiments/benchmarks/profile_step.py --precision=mixed_bfloat16 --batch=64

Builds the step `python -m tfmp.bench` times, warms it up, traces `--steps` steps with the
TF profiler (trace viewer files under --logdir, for TensorBoard's profile plugin), then reads
the trace's XSpace protobuf directly and prints milliseconds per step by op type, summed over
TensorFlow's compute threads (so a step on 2 busy cores sums to about 2x its wall time).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def op_milliseconds(logdir: str) -> collections.Counter:
    """Total duration per op type over all TF compute threads of the newest trace in `logdir`."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = sorted(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))[-1]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as file:
        space.ParseFromString(file.read())
    # Executor bookkeeping events that carry a "name:Type" label but are not ops.
    bookkeeping = {"Process", "Start", "Root", "DoCompute"}
    totals = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_"):  # TF's executor threads (tf_Compute, tf_numa_*_Eigen, ...)
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                op_type = name.rsplit(":", 1)[-1]
                if ":" in name and op_type not in bookkeeping:  # "scope/op_name:OpType"
                    totals[op_type] += event.duration_ps / 1e9
    return totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--logdir", default="runs/profile")
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    from tfmp import models, precision
    from tfmp.data.augment import AugmentConfig
    from tfmp.ssl.simclr import SimCLR

    precision.set_policy(args.precision)
    keras.utils.set_random_seed(0)
    encoder = models.build_encoder("resnet18_cifar", (32, 32, 3))
    model = SimCLR(encoder, projection_dim=128, temperature=0.5, augment_config=AugmentConfig(blur_probability=0.0))
    model.build((None, 32, 32, 3))
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.1, momentum=0.9, weight_decay=5e-4)))
    images = np.random.default_rng(0).random((args.batch, 32, 32, 3), dtype=np.float32)
    iterator = iter(tf.data.Dataset.from_tensors((images, np.zeros(args.batch, np.int32))).repeat())
    model.make_train_function()

    def run(steps):
        logs = None
        for _ in range(steps):
            logs = model.train_function(iterator)
        float(logs["loss"])  # wait for the last step

    run(3)
    logdir = os.path.join(args.logdir, args.precision)
    tf.profiler.experimental.start(logdir)
    start = time.perf_counter()
    run(args.steps)
    wall = (time.perf_counter() - start) / args.steps
    tf.profiler.experimental.stop()
    totals = op_milliseconds(logdir)
    print(f"{args.precision}, batch {args.batch}: wall {1000 * wall:.0f} ms/step; op time per step (both threads):")
    for op_type, milliseconds in totals.most_common(args.top):
        print(f"  {milliseconds / args.steps:8.1f} ms  {op_type}")


if __name__ == "__main__":
    main()
