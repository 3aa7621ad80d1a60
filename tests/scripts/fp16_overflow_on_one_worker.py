"""A user's script run by `python -m tfmp.launch --num_workers=2 THIS_FILE --overflowing_worker=1 --out=DIR`.

Each worker feeds its own half of the global batch (4 examples); the chosen worker's are
multiplied by 1e5, so only its float16 gradients overflow. Writes DIR/worker<i>.txt with
what it saw after one `fit()` step: replicas, weights unchanged, finite, skipped steps, scale.
"""

import argparse
import json
import os

import keras
import numpy as np
import tensorflow as tf

import tfmp

parser = argparse.ArgumentParser()
parser.add_argument("--overflowing_worker", type=int, required=True)
parser.add_argument("--out", required=True)
args = parser.parse_args()

strategy = tfmp.distribute.get_strategy("multi_worker_mirrored")  # the cluster comes from TF_CONFIG (set by tfmp.launch)
worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
tfmp.precision.set_policy("mixed_float16")
keras.utils.set_random_seed(0)
with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4), keras.layers.Dense(1, dtype="float32")])
    model.compile(optimizer=tfmp.precision.wrap_optimizer(keras.optimizers.SGD(0.01), hysteresis=1), loss="mse")


def dataset_fn(input_context):
    x = np.ones((4, 4), np.float32) * (1e5 if input_context.input_pipeline_id == args.overflowing_worker else 1.0)
    return tf.data.Dataset.from_tensors((x, np.zeros((4, 1), np.float32)))


before = model.get_weights()
model.fit(strategy.distribute_datasets_from_function(dataset_fn), epochs=1, steps_per_epoch=1, verbose=0)
after = model.get_weights()
facts = {
    "replicas": strategy.num_replicas_in_sync,
    "weights_unchanged": all(np.array_equal(a, b) for a, b in zip(before, after)),
    "finite": all(np.isfinite(w).all() for w in after),
    "skipped_steps": tfmp.precision.skipped_steps(model.optimizer),
    "loss_scale": tfmp.precision.current_loss_scale(model.optimizer),
}
with open(os.path.join(args.out, f"worker{worker}.txt"), "w", encoding="utf-8") as file:
    file.write("\n".join(f"{key}={value}" for key, value in facts.items()) + "\n")
