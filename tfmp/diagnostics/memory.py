"""Memory estimate per replica, before training: will this model and batch fit?

    total = params + gradients + optimizer state + activations

* params, gradients: every variable is float32 under tfmp's policies (mixed policies
  keep float32 weights), gradients for the trainable ones;
* optimizer state: slots per trainable value (AdamW 2, SGD/LARS momentum 1);
* activations: every leaf layer's output, kept for the backward pass, at the per-replica
  batch, in the layer's *compute* dtype — 2 bytes under mixed_bfloat16/float16, which
  is where mixed precision halves activation memory — plus the float32 copy that
  Keras' own BatchNormalization keeps under 16-bit policies (tfmp's fused
  `BatchNormalization` keeps none), and inside attention the projections, the attended values and the
  heads x queries x keys probabilities (float32 softmax output, plus a 16-bit copy under mixed policies).
  Shapes come from one forward pass on a single example.
  With activation checkpointing (`--remat`), a checkpointed block counts its output,
  and the largest block's activations once (they are recomputed one block at a time).

It does not count framework workspace (oneDNN/cuDNN scratch, XLA buffers), temporaries
of fused ops, or the input pipeline; `measure_step_peak` measures a real step on this
device so the estimate can be checked (BUILD_NOTES.md gives the measured ratio).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmp import precision
from tfmp.diagnostics.flops import attention_lengths
from tfmp.diagnostics.layer_outputs import captured_outputs, display_names, leaf_layers
from tfmp.models.layers import BatchNormalization
from tfmp.models.remat import CheckpointedBlock

OPTIMIZER_SLOTS = {"adamw": 2, "sgd": 1, "lars": 1}


@dataclasses.dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per replica."""

    precision: str
    per_replica_batch: int
    params_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}

    def summary(self) -> str:
        mib = 1 << 20
        return (f"memory per replica ({self.precision}, batch {self.per_replica_batch}): "
                f"params {self.params_bytes / mib:.1f} MiB, gradients {self.gradients_bytes / mib:.1f} MiB, "
                f"optimizer {self.optimizer_bytes / mib:.1f} MiB, activations {self.activations_bytes / mib:.1f} MiB, "
                f"total {self.total_bytes / mib:.1f} MiB")


def activation_bytes_per_example(model: keras.Model, input_shape: tuple[int, ...]) -> int:
    """Bytes of all leaf-layer outputs for one example, in each layer's compute dtype.

    Keras' BatchNormalization computes in float32 under a 16-bit policy (it casts its
    input up and its output back), so the backward pass also keeps a float32 copy of a
    BatchNorm's input: counted here, because it is what erodes bf16's memory saving.
    tfmp's `BatchNormalization` on its fused path keeps the input in its own dtype.
    """
    layers = leaf_layers(model)
    names = display_names(layers)
    batch_norms = {names[layer] for layer in layers if _keeps_float32_copy(layer)}
    with captured_outputs(model) as captured:
        model(np.zeros((1, *input_shape), np.float32), training=False)
    kept = {}
    for name, tensor in captured:
        elements = int(np.prod(tensor.shape[1:]))
        kept[name] = elements * tensor.dtype.size + (elements * 4 if name in batch_norms else 0)
    for attention, (queries, keys) in attention_lengths(model).items():
        kept[attention.name] = _attention_bytes(attention, queries, keys, [kept.get(names[leaf], 0) for leaf in leaf_layers(attention)])
    return _kept_bytes(model, kept)


def _attention_bytes(attention: keras.layers.MultiHeadAttention, queries: int, keys: int, projections: list[int]) -> int:
    """What one `MultiHeadAttention` keeps for the backward pass, per example: its query, key, value and output
    projections, the attended values (the output projection's input, the size of the queries') and the attention
    probabilities — float32 from the softmax (Keras 3.15 takes it in float32) plus their cast to a 16-bit compute
    dtype for the matmul with the values. These grow with the square of the token count."""
    compute_size = np.dtype(attention.compute_dtype).itemsize if attention.compute_dtype != "bfloat16" else 2
    probabilities = attention.num_heads * queries * keys * (4 + (compute_size if compute_size < 4 else 0))
    attended = attention.num_heads * queries * (attention.value_dim or attention.key_dim) * compute_size
    return sum(projections) + attended + probabilities


def _kept_bytes(model: keras.Model, leaf_bytes: dict[str, int]) -> int:
    """Activation bytes alive at the backward pass's peak, with activation checkpointing.

    Without it, every leaf output is kept. A checkpointed block (`--remat`) keeps only its
    output during the forward pass; in the backward pass its activations come back one
    block at a time, so the largest block's own (recursive) figure is added once.
    """
    kept, largest_recomputed = 0, 0
    for layer in model.layers:
        if isinstance(layer, CheckpointedBlock) and layer.remat:
            kept += leaf_bytes.get(layer.block.layers[-1].name, 0)
            largest_recomputed = max(largest_recomputed, _kept_bytes(layer.block, leaf_bytes))
        elif isinstance(layer, CheckpointedBlock):
            kept += _kept_bytes(layer.block, leaf_bytes)
        elif isinstance(layer, keras.Model):
            kept += _kept_bytes(layer, leaf_bytes)
        else:
            kept += leaf_bytes.get(layer.name, 0)
    return kept + largest_recomputed


def _keeps_float32_copy(layer: keras.layers.Layer) -> bool:
    if not isinstance(layer, keras.layers.BatchNormalization) or layer.compute_dtype not in ("float16", "bfloat16"):
        return False
    return not (isinstance(layer, BatchNormalization) and layer.uses_fused_kernel)


def estimate_memory(model: keras.Model, input_shape: tuple[int, ...], per_replica_batch: int, optimizer: str = "adamw",
                    views: int = 1, optimizer_shards: int = 1) -> MemoryEstimate:
    """Estimates one replica's training memory.

    Args:
        model: the model as it will train (built under the run's policy).
        input_shape: one example's shape.
        per_replica_batch: examples per replica per step.
        optimizer: name in `OPTIMIZER_SLOTS`.
        views: forward passes per example (2 for SimCLR's two views).
        optimizer_shards: replicas the optimizer state is sharded over (`--optimizer_sharding=zero1`): each holds
            its share (whole variables, so up to the largest variable's state more than an even share).
    """
    params = sum(int(np.prod(v.shape)) * 4 for v in model.weights)
    trainable = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    activations = activation_bytes_per_example(model, input_shape) * per_replica_batch * views
    return MemoryEstimate(
        precision=precision.global_policy_name(),
        per_replica_batch=per_replica_batch,
        params_bytes=params,
        gradients_bytes=trainable,
        optimizer_bytes=-(-trainable * OPTIMIZER_SLOTS.get(optimizer, 2) // optimizer_shards),
        activations_bytes=activations,
    )


def reset_peak_memory(device: str = "CPU:0") -> bool:
    """Resets `device`'s peak-bytes counter; False where TensorFlow keeps no statistics for it.

    On a CPU, TF counts allocations only when its oneDNN kernels are on, which is its default
    only on CPUs with AVX512_VNNI, AVX512_BF16 or AMX (`TF_ENABLE_ONEDNN_OPTS=1` forces it).
    """
    try:
        tf.config.experimental.reset_memory_stats(device)
    except ValueError:  # "Cannot reset memory stats for device 'CPU:0'"
        return False
    return True


def measure_step_peak(model: keras.Model, images: np.ndarray, labels: np.ndarray, device: str = "CPU:0") -> int:
    """Peak bytes allocated on `device` during one forward + backward pass, above what was
    allocated before it (variables and the batch itself excluded)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images, labels = tf.constant(images), tf.constant(labels)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        return tape.gradient(loss, model.trainable_variables)

    step()  # trace and warm up outside the measurement
    if not reset_peak_memory(device):
        raise RuntimeError(
            f"TensorFlow keeps no allocation statistics for {device} in this process: with oneDNN off (TF's default "
            "on CPUs without AVX512_VNNI/AVX512_BF16/AMX) the CPU allocator does not count; "
            "set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow starts")
    before = tf.config.experimental.get_memory_info(device)["current"]
    step()
    return tf.config.experimental.get_memory_info(device)["peak"] - before
