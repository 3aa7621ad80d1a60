"""Where SimCLR's augmentations should run: inside the step (on the accelerator) or in the host input pipeline.

    python experiments/benchmarks/augmentation_placement.py --batch=64 --image_size=32 --rounds=3

tfmp draws both views inside the training step (per replica, seeded by (run seed, step,
replica), compiled with the step under XLA). The alternative is the usual TPU recipe: augment
in `tf.data` on the host and feed finished views. This script measures, in one process with
rounds interleaved, on this machine's CPU:

    views_graph_ms     two views of a batch inside a tf.function (what a replica's step does without XLA)
    views_xla_ms       the same compiled with XLA (what a TPU or jit_compile=True runs)
    host_pipeline_ms   per batch, a `tf.data` pipeline doing the same two views on the host
                       (map with AUTOTUNE parallel calls, prefetch), drained for --batches_per_round batches
    step_ms            the whole SimCLR step (`tfmp.bench`'s measurement, float32, no XLA)

and, analytically, the augmentation's share of a step's FLOPs at `--flops_image_size` for
ResNet-50 (bilinear crop as two matrix products per image vs 3 x forward FLOPs per view).
Prints one JSON line with medians over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def crop_flops_per_image(size: int, channels: int = 3) -> int:
    """FLOPs of `resize_crops` for one image: [size, size] x [size, size*channels], twice."""
    return 2 * 2 * size * size * size * channels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches_per_round", type=int, default=10)
    parser.add_argument("--flops_image_size", type=int, default=224)
    args = parser.parse_args()

    from tfmp import tf_environment

    tf_environment.prepare()
    import numpy as np
    import tensorflow as tf

    from tfmp import bench, models
    from tfmp.data import augment

    config = augment.AugmentConfig(blur_probability=0.0)  # what tfmp.bench's SimCLR step draws

    def two_views(images, seed):
        first, second = augment.split_seed(seed, 2)
        return augment.simclr_augment(images, first, config), augment.simclr_augment(images, second, config)

    images = tf.constant(np.random.default_rng(0).random((args.batch, args.image_size, args.image_size, 3), np.float32))
    graph_views = tf.function(two_views)
    xla_views = tf.function(two_views, jit_compile=True)
    host = (tf.data.Dataset.from_tensors(images).repeat()
            .enumerate()
            .map(lambda step, batch: two_views(batch, augment.step_seed(0, step, 0)), num_parallel_calls=tf.data.AUTOTUNE)
            .prefetch(tf.data.AUTOTUNE))

    def time_views(function, count):
        start = time.perf_counter()
        for step in range(count):
            result = function(images, augment.step_seed(0, step, 0))
        float(tf.reduce_sum(result[1][0, 0, 0]))
        return 1000 * (time.perf_counter() - start) / count

    def time_host(count):
        iterator = iter(host)
        next(iterator)  # start the pipeline's threads
        start = time.perf_counter()
        for _ in range(count):
            batch = next(iterator)
        float(tf.reduce_sum(batch[1][0, 0, 0]))
        return 1000 * (time.perf_counter() - start) / count

    for function in (graph_views, xla_views):  # trace and compile outside the timing
        time_views(function, 2)
    samples = {"views_graph_ms": [], "views_xla_ms": [], "host_pipeline_ms": []}
    for _ in range(args.rounds):
        samples["views_graph_ms"].append(time_views(graph_views, args.batches_per_round))
        samples["views_xla_ms"].append(time_views(xla_views, args.batches_per_round))
        samples["host_pipeline_ms"].append(time_host(args.batches_per_round))

    step = bench.run_one(bench.parse([f"--batch={args.batch}", f"--image_size={args.image_size}", "--steps=3",
                                      f"--repeats={args.rounds}", "--warmup=2"]), "float32", "none")
    medians = {name: round(statistics.median(values), 2) for name, values in samples.items()}

    size = args.flops_image_size
    resnet50 = models.build_encoder("resnet50", (size, size, 3), models.NormSettings())
    model_flops = 3 * bench.forward_flops_per_example(resnet50, (size, size, 3))
    print(json.dumps({
        "batch": args.batch, "image_size": args.image_size, "rounds": args.rounds,
        **medians, "samples": samples,
        "step_ms": step["step_time_ms"],
        "views_share_of_step_graph": round(medians["views_graph_ms"] / step["step_time_ms"], 3),
        "resnet50_crop_flops_share": round(crop_flops_per_image(size) / model_flops, 4),
        "flops_image_size": size,
    }))


if __name__ == "__main__":
    main()
