"""Memory estimate vs measured step peak, as the table in BUILD_NOTES.md.

    python experiments/benchmarks/memory_estimate_check.py

For small_cnn (batch 128) and resnet18_cifar (batch 64), float32 and mixed_bfloat16, with and
without activation checkpointing: the estimate's activations + gradients next to the peak
bytes TensorFlow's CPU allocator held during one forward + backward step.
"""

import keras
import numpy as np

from tfmp import models, precision
from tfmp.diagnostics import memory

CASES = (("small_cnn", (8, 8, 1), 128), ("resnet18_cifar", (32, 32, 3), 64))
MIB = 2**20


def main() -> None:
    rng = np.random.default_rng(0)
    print("| model | precision | remat | estimated act. + grad. MiB | measured peak MiB | peak / estimate |")
    print("|---|---|---|---|---|---|")
    for name, shape, batch in CASES:
        for policy in ("float32", "mixed_bfloat16"):
            for remat in ("none", "blocks"):
                precision.set_policy(policy)
                keras.utils.set_random_seed(0)
                model = models.build_classifier(models.build_encoder(name, shape, remat=remat), 10)
                estimate = memory.estimate_memory(model, shape, batch)
                images, labels = rng.random((batch, *shape), dtype=np.float32), rng.integers(0, 10, batch)
                peak = memory.measure_step_peak(model, images, labels) / MIB
                estimated = (estimate.activations_bytes + estimate.gradients_bytes) / MIB
                print(f"| {name} | {policy} | {remat} | {estimated:.1f} | {peak:.1f} | {peak / estimated:.2f} |", flush=True)


if __name__ == "__main__":
    main()
