"""A zero1 checkpoint written under one replica layout, restored under another.

    python tests/scripts/zero1_layouts.py save DIR                                  # 2 replicas on one machine
    python -m tfmp.launch --num_workers=2 tests/scripts/zero1_layouts.py restore DIR   # 2 workers, 1 replica each

`save` trains a small model 5 steps with `tfmp.sharding.ZeroOneOptimizer(AdamW)` under MirroredStrategy on 2 logical
CPU devices, writes a checkpoint and the optimizer state it holds (whole, per variable) to DIR/state.npz. `restore`
builds the same model under the strategy it runs in (MultiWorkerMirroredStrategy when launched as workers), restores
the checkpoint, and checks that the sharded state it now holds, gathered again, equals the saved one: prints
"zero1 state restored: N arrays equal" and exits 0, or exits 1 naming the first difference.
"""

import os
import sys

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import distribute, sharding  # noqa: E402


def build(strategy):
    keras.utils.set_random_seed(0)
    with strategy.scope():
        model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, name="conv"), keras.layers.Flatten(),
                                  keras.layers.Dense(10, name="logits")])
        model.optimizer = sharding.ZeroOneOptimizer(keras.optimizers.AdamW(1e-3))
        model.optimizer.build(model.trainable_variables)
    return model


def train(model, strategy, images, labels, steps=5):
    """`steps` steps of a custom `strategy.run` loop, each replica on its slice of a batch that moves with the step
    (tests/test_sharding.py trains with it too)."""
    per_replica = images.shape[0] // strategy.num_replicas_in_sync

    def replica_step(step):
        replica = tf.distribute.get_replica_context().replica_id_in_sync_group
        rows = (tf.range(per_replica) + replica * per_replica + step * 7) % images.shape[0]
        with tf.GradientTape() as tape:
            logits = model(tf.gather(images, rows), training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(tf.gather(labels, rows), logits, from_logits=True))
            scaled = loss / strategy.num_replicas_in_sync
        gradients = tape.gradient(scaled, model.trainable_variables)
        model.optimizer.apply(gradients, model.trainable_variables)

    step_function = tf.function(lambda step: strategy.run(replica_step, args=(step,)))
    for step in range(steps):
        step_function(tf.constant(step))


def main() -> int:
    mode, directory = sys.argv[1], sys.argv[2]
    if mode == "save":
        strategy = distribute.get_strategy("mirrored", num_cpu_devices=2)
        model = build(strategy)
        rng = np.random.default_rng(0)
        train(model, strategy, rng.normal(size=(32, 8, 8, 1)).astype(np.float32), np.arange(32) % 10)
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(os.path.join(directory, "ckpt"))
        np.savez(os.path.join(directory, "state.npz"), **model.optimizer.gathered_state())
        print(f"zero1 state saved from {strategy.num_replicas_in_sync} replicas")
        return 0
    strategy = distribute.get_strategy("multi_worker_mirrored" if "TF_CONFIG" in os.environ else "mirrored")
    model = build(strategy)
    tf.train.Checkpoint(model=model, optimizer=model.optimizer).read(os.path.join(directory, "ckpt")).expect_partial()
    restored = model.optimizer.gathered_state()
    with np.load(os.path.join(directory, "state.npz")) as saved:
        if not any(np.abs(saved[key]).max() > 0 for key in saved.files):
            print("the saved state is all zeros: nothing to tell a restore from a fresh start")
            return 1
        if sorted(saved.files) != sorted(restored):
            print(f"different variables: {sorted(saved.files)} vs {sorted(restored)}")
            return 1
        for key in saved.files:
            if not np.array_equal(saved[key], restored[key]):
                print(f"{key} differs: max {np.abs(saved[key] - restored[key]).max()}")
                return 1
    print(f"zero1 state restored on {strategy.num_replicas_in_sync} replicas: {len(restored)} arrays equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
