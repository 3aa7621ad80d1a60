"""tfmp's overhead in `fit()`: the same model, data and steps with and without tfmp's callbacks.

    python experiments/benchmarks/callback_overhead.py --model=resnet18_cifar --batch=64 --steps=20 --rounds=3

One process, one compiled model. Each round runs one epoch of `--steps` steps with no
callbacks (what plain Keras does) and one with `tfmp.callbacks.default_callbacks` (NaN guard,
replica check, checkpoint at the epoch end, SIGTERM handler, loss-scale telemetry,
history.csv, TensorBoard), in alternating order; a warm-up epoch of each comes first (tracing).
Prints one JSON line: median epoch seconds of each and the overhead ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--precision", default="mixed_bfloat16")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    import keras
    import numpy as np
    import tensorflow as tf

    from tfmp import callbacks, models, precision

    precision.set_policy(args.precision)
    keras.utils.set_random_seed(0)
    shape = (32, 32, 3)
    model = models.build_classifier(models.build_encoder(args.model, shape), 10)
    model.compile(optimizer=precision.wrap_optimizer(keras.optimizers.SGD(0.01, momentum=0.9)),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    rng = np.random.default_rng(0)
    images = rng.random((args.batch, *shape), dtype=np.float32)
    labels = rng.integers(0, 10, args.batch).astype(np.int32)
    dataset = tf.data.Dataset.from_tensors((images, labels)).repeat()

    def epoch_seconds(with_tfmp: bool) -> float:
        with tempfile.TemporaryDirectory() as workdir:  # fresh: nothing to resume from
            extra = callbacks.default_callbacks(workdir) if with_tfmp else []
            start = time.perf_counter()
            model.fit(dataset, epochs=1, steps_per_epoch=args.steps, callbacks=extra, verbose=0)
            return time.perf_counter() - start

    epoch_seconds(False), epoch_seconds(True)  # warm-up: tracing, oneDNN primitive creation
    times = {"keras": [], "tfmp": []}
    for round_index in range(args.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)
        for with_tfmp in order:
            times["tfmp" if with_tfmp else "keras"].append(epoch_seconds(with_tfmp))
    keras_median, tfmp_median = statistics.median(times["keras"]), statistics.median(times["tfmp"])
    print(json.dumps({"model": args.model, "precision": args.precision, "batch": args.batch, "steps": args.steps,
                      "rounds": args.rounds, "keras_epoch_s": round(keras_median, 3), "tfmp_epoch_s": round(tfmp_median, 3),
                      "overhead": round(tfmp_median / keras_median - 1, 4), "keras_all": [round(t, 3) for t in times["keras"]],
                      "tfmp_all": [round(t, 3) for t in times["tfmp"]]}))


if __name__ == "__main__":
    main()
