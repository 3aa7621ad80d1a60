"""A zero3 checkpoint saved by two workers: whole in the chief's checkpoint, never whole in a worker's memory.

    python -m tfmp.launch --num_workers=2 tests/scripts/zero3_worker_save.py DIR

Each worker trains a model of four 2048-wide Dense layers (64 MiB of float32 kernels, one 16 MiB kernel per bucket of
the sharded layout, and a 1-element PReLU slope of which worker 1 holds nothing) 3 steps under
MultiWorkerMirroredStrategy with `ShardedOptimizer(stage="zero3")` — beside it a copy of two layers that follows them as
a momentum target does (`weights.follow`, averaged after each step) — then saves twice: the model with its optimizer
and the follower (what tfmp's checkpoints hold: the optimizer's registered saver streams the weights and their
followers to the chief bucket by bucket) to DIR/with_optimizer, and the model alone (no stream: TensorFlow's own save
gathers each weight whole) to DIR/model_only. Only the chief's checkpoints are kept; the other worker writes under
DIR/worker1. While each save runs, the bytes of whole weights alive at once in the process are counted (each whole
weight `weights.whole_weights` returns, until it is freed). Prints "peak whole bytes: with optimizer A, model only B of C"
(`tfmp.launch` prefixes each worker's lines), and the chief writes the weights it trained (gathered; the model's, then
the follower's) to DIR/weights.npz for tests/test_zero3.py to compare with what a model on one device restores from
either checkpoint. Then both workers restore the chief's checkpoint into their zeroed model and follower, reading only
their replicas' slices (`weights.reading_own_slices()`, as tfmp's checkpoints restore) and then each weight whole, and
print the allocator's peak above the start of each, whether the weights came back exactly, the bytes read and which weights still
carry a save's key after the own-slices restore (none may); and try a save inside `reading_own_slices()`, which
several workers refuse.
"""

import contextlib
import json
import os
import sys
import weakref

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import distribute, sharding  # noqa: E402
from tfmp.diagnostics import memory  # noqa: E402
from tfmp.sharding import weights  # noqa: E402

WIDTH = 2048


def build():
    """The same network unsharded (tests/test_zero3.py restores into it on one device)."""
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((64,)), keras.layers.Dense(WIDTH, name="first"),
                             *[keras.layers.Dense(WIDTH, name=f"wide{index}") for index in range(4)],
                             keras.layers.Dense(10, name="logits"),
                             keras.layers.PReLU(shared_axes=[1], name="slope")])  # a 1-element weight: worker 1 holds none


FOLLOWED = ("wide0", "wide1")  # two buckets' kernels: saved at once (TensorFlow's own save) they exceed a bucket


def build_average():
    """A copy of the layers `FOLLOWED`, which follows them as a momentum target does (`weights.follow`)."""
    return keras.Sequential([keras.Input((WIDTH,)), *[keras.layers.Dense(WIDTH, name=f"average_{name}") for name in FOLLOWED]])


def followed(model) -> list:
    return [weight for name in FOLLOWED for weight in model.get_layer(name).trainable_weights]


class LiveWholeBytes:
    """Bytes of the whole weights `weights.whole_weights` returned that are still alive, and their peak since `reset`."""

    def __init__(self):
        self.now = self.peak = 0
        original = weights.whole_weights

        def counted(members):
            tensors = original(members)
            for tensor in tensors:
                size = tensor.shape.num_elements() * 4
                self.now += size
                weakref.finalize(tensor, self._freed, size)
            self.peak = max(self.peak, self.now)
            return tensors

        weights.whole_weights = counted

    def _freed(self, size):
        self.now -= size

    def reset(self):
        self.peak = self.now


class RestoredBytes:
    """Bytes TensorFlow's restores hand the sharded weights (`Chunks.restore_slices`), since `reset`."""

    def __init__(self):
        self.total = 0
        original = weights.Chunks.restore_slices

        def counted(chunks, tensors, whole):
            self.total += sum(tensor.shape.num_elements() * 4 for tensor in tensors)
            return original(chunks, tensors, whole)

        weights.Chunks.restore_slices = counted

    def reset(self):
        self.total = 0


def main() -> int:
    directory = sys.argv[1]
    strategy = distribute.get_strategy("multi_worker_mirrored")
    worker = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with strategy.scope():
        model = build()
        average = build_average()  # a momentum target of one layer: sharded in its layout, streamed after its bucket
        weights.follow(average.trainable_weights, followed(model))
        optimizer = sharding.ShardedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9), stage="zero3")
        optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    images, labels = rng.normal(size=(16, 64)).astype(np.float32), np.arange(16) % 10

    def replica_step(images, labels):
        with tf.GradientTape() as tape:
            logits = model(images, training=True)
            loss = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(labels, logits, from_logits=True))
            scaled = loss / strategy.num_replicas_in_sync
        optimizer.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    def replica_average():
        for follower, leader in zip(average.trainable_weights, followed(model)):
            weights.average_chunks(follower, leader, tf.constant(0.5))

    step = tf.function(lambda: strategy.run(replica_step, args=(images[worker::2], labels[worker::2])))
    average_step = tf.function(lambda: strategy.run(replica_average))
    for _ in range(3):
        step()
        average_step()
    trained = [np.asarray(weight) for weight in model.get_weights() + average.get_weights()]  # gathered whole
    live = LiveWholeBytes()
    peaks = {}
    target = directory if strategy.extended.should_checkpoint else os.path.join(directory, f"worker{worker}")
    allocator = {}  # peak bytes TensorFlow's CPU allocator held during the save, above its start (where it counts)
    for name, checkpoint in (("with_optimizer", tf.train.Checkpoint(model=model, optimizer=optimizer, average=average)),
                             ("model_only", tf.train.Checkpoint(model=model))):
        live.reset()
        counts = memory.reset_peak_memory("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"] if counts else 0
        checkpoint.write(os.path.join(target, name, "ckpt"))
        peaks[name] = live.peak
        allocator[name] = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before if counts else None
    total = sum(weight.nbytes for weight in trained[:len(model.weights)])  # the model's (a model-only save's)
    if strategy.extended.should_checkpoint:
        np.savez(os.path.join(directory, "weights.npz"), *trained)
    print(f"peak whole bytes: with optimizer {peaks['with_optimizer']}, model only {peaks['model_only']} "
          f"of {total}; allocator peak above the start: with optimizer {allocator['with_optimizer']}, model only "
          f"{allocator['model_only']}", flush=True)
    # Both workers restore the chief's checkpoint into the model, its weights zeroed first: reading only their own
    # replicas' slices (as tfmp's checkpoints restore), then each weight whole (a plain tf.train.Checkpoint.restore);
    # the allocator's peak is read for the model's weights alone (the figures of BUILD_NOTES), the follower restored
    # before it. Gathering the weights is a collective, so the chief has finished writing before either worker reads.
    np.asarray(model.weights[0])
    path = os.path.join(directory, "with_optimizer", "ckpt")
    reads, restored_bytes = {}, RestoredBytes()
    for mode, context in (("own slices", weights.reading_own_slices), ("whole", contextlib.nullcontext)):
        for weight in model.weights + average.weights:
            weight.assign(tf.zeros(weight.shape))
        with context():
            tf.train.Checkpoint(average=average).read(path).expect_partial().assert_existing_objects_matched()
        counts = memory.reset_peak_memory("CPU:0")
        before = tf.config.experimental.get_memory_info("CPU:0")["current"] if counts else 0
        restored_bytes.reset()
        with context():
            tf.train.Checkpoint(model=model, optimizer=optimizer).read(path).expect_partial().assert_existing_objects_matched()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"] - before if counts else None
        read = restored_bytes.total
        if mode == "own slices":  # a save's key left on a weight would make this worker alone gather it at the next save
            left = [weight.path for weight in model.weights + average.weights
                    if weights.is_sharded(weight) and weight.sharded.checkpoint_key]
            print(f"keys left after restoring own slices: {left}", flush=True)
        restored = model.get_weights() + average.get_weights()
        exact = all(np.array_equal(got, expected) for got, expected in zip(restored, trained, strict=True))
        reads[mode] = (peak, exact, read)
    print("restore, allocator peak above the start, exact and bytes read: " +
          "; ".join(f"{mode} {peak} {exact} {read}" for mode, (peak, exact, read) in reads.items()), flush=True)
    try:  # several workers: a save inside reading_own_slices() would keep only the chief's slices, so it is refused
        with weights.reading_own_slices():
            tf.train.Checkpoint(model=model).write(os.path.join(target, "refused", "ckpt"))
        print("save inside reading_own_slices: written", flush=True)
    except RuntimeError as error:
        print(f"save inside reading_own_slices: refused ({error})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
