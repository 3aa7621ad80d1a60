"""What each `--sharding` stage costs and saves on 2 CPU replicas: step time side by side, the bytes each replica holds
from where the variables are placed, and the bytes each replica moves through collectives per step (computed).

    python experiments/benchmarks/sharding_step_time.py --model=resnet18_cifar --batch=64 --steps=5 --rounds=3 \
        --stages=none,zero1,zero2 --gradient_accumulation_steps=4

Every stage is built once in this process (2 logical CPU devices, MirroredStrategy, AdamW, float32, each step's batch
in `--gradient_accumulation_steps` micro-batches through `tfmp.accumulation`) and timed in interleaved rounds of
`--steps` `train_on_batch` calls after a warm-up (the order rotates each round); prints one JSON line with the median
step time of each stage and its ratio to the first.

Bytes moved are counted per replica as ring collectives move them (N replicas, B bytes: an all-reduce moves
2(N-1)/N * B, a reduce-scatter or an all-gather (N-1)/N * B): `none` all-reduces the float32 gradients once a step;
zero1 reduces them (a reduce-scatter on GPUs, an all-reduce off them) and all-gathers the updated weights; zero2 does
so once per micro-batch; zero3 all-gathers every weight where the forward pass reads it and reduces its gradient in
the backward pass, once per micro-batch (under --remat the recomputed forward gathers again: not counted here). The
small all-reduces of flags and norms are left out.
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

from tfmp import accumulation, distribute, models, sharding  # noqa: E402


def bytes_moved(stage: str, parameters: int, replicas: int, micro_batches: int, reduce_scatter: bool) -> int:
    """Bytes one replica sends through collectives in one optimizer step (float32 gradients and weights)."""
    gradient_bytes = 4 * parameters
    share = (replicas - 1) / replicas
    all_reduce, one_way = 2 * share * gradient_bytes, share * gradient_bytes
    if stage == "none":
        return round(all_reduce)
    reduce = one_way if reduce_scatter else all_reduce
    if stage == "zero3":  # each micro-batch gathers the weights once (float32 here; bf16 halves it) and reduces
        return round(micro_batches * (reduce + one_way))
    reductions = micro_batches if stage == "zero2" else 1
    return round(reductions * reduce + one_way)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet18_cifar")
    parser.add_argument("--image_size", type=int, default=32)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--stages", default="none,zero1", help="comma-separated: none, zero1, zero2, zero3")
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    args = parser.parse_args()
    stages = args.stages.split(",")

    strategy = distribute.get_strategy("mirrored", num_cpu_devices=2)
    shape = (args.image_size, args.image_size, 3)
    rng = np.random.default_rng(0)
    images, labels = rng.random((args.batch, *shape), dtype=np.float32), rng.integers(0, 10, args.batch)
    built = {}
    for stage in stages:
        keras.utils.set_random_seed(0)
        with strategy.scope():
            encoder = models.build_encoder(args.model, shape, models.NormSettings(synchronized=True))
            model = models.build_classifier(encoder, 10)
            optimizer = keras.optimizers.AdamW(1e-3)
            model.compile(optimizer=optimizer if stage == "none" else sharding.ShardedOptimizer(optimizer, stage=stage),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        accumulation.accumulate_gradients(model, args.gradient_accumulation_steps)
        for _ in range(2):
            model.train_on_batch(images, labels)
        built[stage] = model
    times = {stage: [] for stage in built}
    for round_index in range(args.rounds):
        shift = round_index % len(stages)
        for stage in stages[shift:] + stages[:shift]:
            start = time.perf_counter()
            for _ in range(args.steps):
                built[stage].train_on_batch(images, labels)
            times[stage].append((time.perf_counter() - start) / args.steps)
    parameters = sum(int(np.prod(v.shape)) for v in built[stages[0]].trainable_weights)
    medians = {stage: statistics.median(values) for stage, values in times.items()}
    weights_mb = {stage: [round(sum(int(np.prod(chunk.shape)) * 4 for v in model.trainable_weights
                                    for chunk in [strategy.experimental_local_results(v.sharded.storage)[replica]]) / 1e6, 2)
                          for replica in range(2)] if stage == "zero3" else round(4 * parameters / 1e6, 2)
                  for stage, model in built.items()}
    state = {}
    for stage, model in built.items():
        if stage == "none":
            state[stage] = round(sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables if len(v.shape)) / 1e6, 2)
        else:
            state[stage] = [round(b / 1e6, 2) for b in model.optimizer.state_bytes_per_replica()]
    micro = args.gradient_accumulation_steps
    print(json.dumps({
        "model": args.model, "global_batch": args.batch, "replicas": 2, "gradient_accumulation_steps": micro,
        "steps": args.steps, "rounds": args.rounds, "parameters": parameters,
        "step_ms": {stage: round(1000 * value, 1) for stage, value in medians.items()},
        "step_ms_all": {stage: [round(1000 * value, 1) for value in values] for stage, values in times.items()},
        "over_first": {stage: round(value / medians[stages[0]], 3) for stage, value in medians.items()},
        "optimizer_state_mb_per_replica": state,
        "weights_mb_per_replica": weights_mb,
        "accumulated_gradient_mb_per_replica": {stage: round(4 * parameters / (2 if stage in ("zero2", "zero3") else 1) / 1e6, 2)
                                                for stage in stages} if micro > 1 else {},
        "mb_moved_per_replica_per_step": {
            stage: {"cpu_all_reduce": round(bytes_moved(stage, parameters, 2, micro, False) / 1e6, 1),
                    "gpu_reduce_scatter": round(bytes_moved(stage, parameters, 2, micro, True) / 1e6, 1)}
            for stage in stages},
    }))


if __name__ == "__main__":
    main()
