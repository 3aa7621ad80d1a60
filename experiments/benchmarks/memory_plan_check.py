"""The memory plan's components, predicted against measured, per replica (one device, float32, AdamW):

    python experiments/benchmarks/memory_plan_check.py

weights, gradients and optimizer state measured from the variables placed on the device (the model's, the
gradients a step returns, AdamW's slots once built); activations measured as the allocator's peak during one
forward + backward step above what was allocated before it, with each weight gradient summed away as it comes (so
the gradients do not pile up in the figure); and the whole step's peak (every gradient kept, as training keeps
them) against the estimate's activations + gradients. For ResNet-18 (CIFAR) and the largest encoder tfmp has
(ViT-B/16 at 224x224), each at two batch sizes.

    python experiments/benchmarks/memory_plan_check.py --replica_table

prints instead the estimate's bytes per replica for 1, 2, 4 and 8 replicas with `--sharding=zero1`, with
and without `--remat=blocks` (computed, nothing measured), the table in BUILD_NOTES.md.
"""

import sys

from tfmp import tf_environment

tf_environment.prepare()  # oneDNN on: TensorFlow's CPU allocator counts only then

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tfmp import models  # noqa: E402
from tfmp.diagnostics import memory  # noqa: E402

CASES = (("resnet18_cifar", (32, 32, 3), (32, 64)), ("vit_base_p16", (224, 224, 3), (2, 4)))
MIB = 2 ** 20


def nbytes(variables) -> int:
    return sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in variables)


def main() -> None:
    rng = np.random.default_rng(0)
    print("| model | batch | component | predicted MiB | measured MiB | measured / predicted |")
    print("|---|---|---|---|---|---|")
    for name, shape, batches in CASES:
        for batch in batches:
            keras.utils.set_random_seed(0)
            model = models.build_classifier(models.build_encoder(name, shape), 10)
            optimizer = keras.optimizers.AdamW(1e-3)
            optimizer.build(model.trainable_variables)
            estimate = memory.estimate_memory(model, shape, batch, "adamw")
            images, labels = rng.random((batch, *shape), dtype=np.float32), rng.integers(0, 10, batch)
            gradients = nbytes(model.trainable_variables)  # one float32 gradient per trainable value, as returned
            measured = {"weights": nbytes(model.weights), "gradients": gradients,
                        "optimizer": nbytes([v for v in optimizer.variables if len(v.shape)]),
                        "activations": memory.measure_step_peak(model, images, labels, keep_gradients=False),
                        "step peak (activations + gradients)": memory.measure_step_peak(model, images, labels)}
            predicted = {"weights": estimate.params_bytes, "gradients": estimate.gradients_bytes,
                         "optimizer": estimate.optimizer_bytes, "activations": estimate.activations_bytes,
                         "step peak (activations + gradients)": estimate.activations_bytes + estimate.gradients_bytes}
            for component in predicted:
                print(f"| {name} | {batch} | {component} | {predicted[component] / MIB:.1f} | {measured[component] / MIB:.1f} | "
                      f"{measured[component] / predicted[component]:.2f} |")


def replica_table() -> None:
    print("| model | images/replica | remat | replicas (zero1) | weights | gradients | optimizer | activations | total |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape, batch in (("resnet18_cifar", (32, 32, 3), 256), ("vit_base_p16", (224, 224, 3), 32)):
        for remat, replica_counts in (("none", (1, 2, 4, 8)), ("blocks", (1, 8))):
            model = models.build_classifier(models.build_encoder(name, shape, remat=remat), 10)
            for replicas in replica_counts:
                estimate = memory.estimate_memory(model, shape, batch, "adamw", optimizer_shards=replicas)
                parts = (estimate.params_bytes, estimate.gradients_bytes, estimate.optimizer_bytes, estimate.activations_bytes,
                         estimate.total_bytes)
                print(f"| {name} | {batch} | {remat} | {replicas} | " + " | ".join(f"{part / MIB:.0f}" for part in parts) + " |")


if __name__ == "__main__":
    if "--replica_table" in sys.argv[1:]:
        replica_table()
    else:
        main()
