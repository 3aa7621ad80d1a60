"""What `--sharding=zero1` costs and saves on 2 CPU replicas: step time side by side, and optimizer-state
bytes per replica from where the variables are placed.

    python experiments/benchmarks/zero1_step_time.py --model=resnet18_cifar --batch=64 --steps=5 --rounds=3

Both configurations are built once in this process (2 logical CPU devices, MirroredStrategy, AdamW, float32) and
timed in interleaved rounds of `--steps` `train_on_batch` calls after a warm-up; prints one JSON line with the
median step time of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp import distribute, models, sharding  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    strategy = distribute.get_strategy("mirrored", num_cpu_devices=2)
    shape = (args.image_size, args.image_size, 3)
    rng = np.random.default_rng(0)
    images, labels = rng.random((args.batch, *shape), dtype=np.float32), rng.integers(0, 10, args.batch)
    built = {}
    for mode in ("none", "zero1"):
        keras.utils.set_random_seed(0)
        with strategy.scope():
            encoder = models.build_encoder(args.model, shape, models.NormSettings(synchronized=True))
            model = models.build_classifier(encoder, 10)
            optimizer = keras.optimizers.AdamW(1e-3)
            model.compile(optimizer=sharding.ZeroOneOptimizer(optimizer) if mode == "zero1" else optimizer,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        for _ in range(2):
            model.train_on_batch(images, labels)
        built[mode] = model
    times = {mode: [] for mode in built}
    for round_index in range(args.rounds):
        for mode in (("none", "zero1") if round_index % 2 == 0 else ("zero1", "none")):
            start = time.perf_counter()
            for _ in range(args.steps):
                built[mode].train_on_batch(images, labels)
            times[mode].append((time.perf_counter() - start) / args.steps)
    plain = built["none"].optimizer
    unsharded = sum(int(np.prod(v.shape)) * 4 for v in plain.variables if len(v.shape))
    medians = {mode: statistics.median(values) for mode, values in times.items()}
    print(json.dumps({
        "model": args.model, "global_batch": args.batch, "replicas": 2, "steps": args.steps, "rounds": args.rounds,
        "step_ms": {mode: round(1000 * value, 1) for mode, value in medians.items()},
        "step_ms_all": {mode: [round(1000 * value, 1) for value in values] for mode, values in times.items()},
        "zero1_over_none": round(medians["zero1"] / medians["none"], 3),
        "optimizer_state_mb_per_replica": {"none": round(unsharded / 1e6, 2),
                                           "zero1": [round(b / 1e6, 2) for b in built["zero1"].optimizer.state_bytes_per_replica()]},
    }))


if __name__ == "__main__":
    main()
