"""The allocator's peak of a sharded (or unsharded) model's calls on 2 logical CPU replicas: an inference pass, a
forward and backward pass, a whole AdamW training step.

    python experiments/benchmarks/sharded_step_peak.py --model=vit_base_p16 --image_size=32 --batch=32 --remat=blocks \
        --sharding=zero3

Builds `--model`'s classifier under MirroredStrategy with Keras' AdamW (`--sharding=none`) or
`ShardedOptimizer(AdamW, stage=...)`, then measures the TensorFlow allocator's peak above the start of each call
(medians of `--calls` calls after a warm-up). Logical CPU devices share one allocator: the figures are both replicas'
together. With `--no_waits` (zero3) every gather is issued when the call starts, as before the gathers waited for the
unit before (`tfmp.sharding.units.gather_waits`). zero3's units are the encoder's blocks (`--units=blocks`, as tfmp's
CLI declares them) or chosen by size (`--units=size`: the outermost layer call that fits a bucket). Needs
TensorFlow's allocator statistics on the CPU (oneDNN on: `tfmp.tf_environment` turns it on). Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json

from tfmp import tf_environment

tf_environment.prepare()

import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

from tfmp import distribute, models, sharding  # noqa: E402
from tfmp.diagnostics import memory  # noqa: E402
from tfmp.sharding import units  # noqa: E402


def peak_mib(function, batch, calls: int) -> float:
    """Median allocator peak (MiB above the call's start) of `function(batch)` after a warm-up."""
    return round(memory.call_peak_bytes(function, batch, calls=calls) / 2**20, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="vit_base_p16")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=32, help="images per replica")
    parser.add_argument("--remat", default="blocks", choices=["none", "blocks"])
    parser.add_argument("--calls", type=int, default=3)
    parser.add_argument("--sharding", default="zero3", choices=["none", "zero1", "zero2", "zero3"])
    parser.add_argument("--no_waits", action="store_true", help="zero3: issue every gather at the call's start (as before)")
    parser.add_argument("--units", default="blocks", choices=["blocks", "size"],
                        help="zero3: the encoder's blocks as FSDP units (tfmp.models.block_of), or units chosen by size")
    flags = parser.parse_args()
    if flags.no_waits:
        units.gather_waits = lambda device, kept: []
    distribute.split_cpu(2)
    strategy = distribute.get_strategy("mirrored")
    keras.utils.set_random_seed(0)
    shape = (flags.image_size, flags.image_size, 3)
    with strategy.scope():
        model = models.build_classifier(models.build_encoder(flags.model, shape, remat=flags.remat), 10)
        adamw = keras.optimizers.AdamW(1e-4)
        declared = models.block_of if flags.sharding == "zero3" and flags.units == "blocks" else None
        model.optimizer = adamw if flags.sharding == "none" else sharding.ShardedOptimizer(adamw, stage=flags.sharding,
                                                                                            units=declared)
        model.optimizer.build(model.trainable_variables)
    batch = strategy.experimental_distribute_values_from_function(
        lambda context: tf.random.stateless_normal((flags.batch, *shape), seed=[context.replica_id_in_sync_group, 0]))

    def gradients(images):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(images, training=True)))
        return tape.gradient(loss, model.trainable_variables)

    def summed_gradients(images):  # each gradient consumed as it comes, none returned
        return tf.add_n([tf.reduce_sum(gradient) for gradient in gradients(images)])

    def train_step(images):
        model.optimizer.apply_gradients(zip(gradients(images), model.trainable_variables))

    run = lambda step: tf.function(lambda images: strategy.run(step, args=(images,)))
    result = {"model": flags.model, "image_size": flags.image_size, "batch_per_replica": flags.batch,
              "remat": flags.remat, "sharding": flags.sharding, "waits": not flags.no_waits, "units": flags.units,
              "inference_mib": peak_mib(run(lambda images: tf.reduce_sum(model(images, training=False))), batch, flags.calls),
              "forward_backward_mib": peak_mib(run(summed_gradients), batch, flags.calls),
              "train_step_mib": peak_mib(run(train_step), batch, flags.calls)}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
