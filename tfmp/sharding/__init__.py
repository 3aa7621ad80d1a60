"""Sharding training state across replicas (ZeRO) on tf.distribute's own collectives.

One module per concern:

* `layout` — which replica holds what: every variable cut into equal chunks, one per replica, taken in buckets;
* `collectives` — how each replica receives the summed gradients of its chunks (NCCL reduce-scatter on GPUs, an
  all-reduce elsewhere);
* `optimizer` — `ShardedOptimizer`, the step: each replica updates its chunks with the rules of `tfmp.update_rules`
  and the updated weights are gathered to every replica, bucket by bucket; under zero2 the accumulated gradients
  are held as chunks too (`owned_gradients`, summed by `tfmp.accumulation`);
* `checkpoint_state` — the sharded state in checkpoints, written from where it lives, read into any layout;
* `weights` — zero3 / FSDP: each trainable weight held as per-replica chunks, gathered where a layer reads it (in
  the compute dtype), its gradient arriving as the replica's chunk; checkpointed as slices under Keras' own keys;
* `units` — FSDP's units: which weights one all-gather brings together (a block, a layer, or the units the optimizer
  was given) and when it runs.

`--sharding` takes ZeRO's stage names (`tfmp.config.SHARDING_STAGES`): `zero1` (optimizer state), `zero2`
(gradients too, where they outlive a micro-batch) and `zero3` / FSDP (the weights too).
"""

from tfmp.sharding.collectives import (GRADIENT_REDUCTIONS, AllReduceShares, NcclReduceScatter,
                                       choose_gradient_reduction)
from tfmp.sharding import units, weights
from tfmp.sharding.layout import Layout
from tfmp.sharding.optimizer import ShardedOptimizer, ZeroOneOptimizer

__all__ = ["GRADIENT_REDUCTIONS", "AllReduceShares", "NcclReduceScatter", "Layout", "ShardedOptimizer",
           "ZeroOneOptimizer", "choose_gradient_reduction", "units", "weights"]
