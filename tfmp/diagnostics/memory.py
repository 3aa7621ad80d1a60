"""Memory estimate per replica, before training: will this model and batch fit?

    total = params + gradients + accumulator + optimizer state + activations

* params, gradients: every variable is float32 under tfmp's policies (mixed policies
  keep float32 weights), gradients for the trainable ones;
* accumulator: with `--gradient_accumulation_steps=K` > 1, two gradient sizes beside one micro-batch's own: the
  running sum and the next sum formed from it (measured: ResNet-18 at batch 256 with K=4 peaks two gradient sizes
  above the batch-64 step, BUILD_NOTES.md); the activations are then one micro-batch's. Under `--sharding=zero2`
  both sums are this replica's chunks (1/N of a gradient each);
* optimizer state: slots per trainable value (AdamW 2, SGD/LARS momentum 1);
* activations: what the backward pass keeps, read from the training step's own graph. The
  forward and backward pass of the model are traced (never run) at a batch of 1 and of 2, and
  every tensor of the forward pass that an op of the backward pass reads is counted once, in
  its own dtype — convolution and matmul inputs, ReLU and softmax outputs, BatchNorm inputs, the
  float32 copies Keras' BatchNormalization makes under 16-bit policies, GELU's intermediates,
  attention probabilities (heads x tokens^2), the 16-bit copies of the weights under mixed
  policies — while tensors read only for their shape, variables, and views of another tensor
  (reshapes, identities) are not. The difference of the two traces is the per-example figure,
  the rest is fixed (the 16-bit weight copies).
  On top of what is kept, the backward pass's working set: the gradient flowing into and out of
  the largest kept tensor. With activation checkpointing (`--remat`) the traced graph keeps each
  checkpointed block's input only; the backward pass recomputes one block at a time, so the
  working set is the largest block's own figure (traced alone) when that is larger.

It does not count framework workspace (oneDNN/cuDNN scratch, XLA buffers), the gradient
temporaries of the backward pass, or the input pipeline; `measure_step_peak` measures a real step
on this device so the estimate can be checked (BUILD_NOTES.md gives the measured ratios).
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmp import precision
from tfmp.diagnostics import layer_outputs
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
    activations_bytes: int  # one micro-batch's with gradient accumulation
    accumulator_bytes: int = 0  # the running sum of the micro-batches' gradients and the next (0 without accumulation)
    gradient_accumulation_steps: int = 1
    fixed_activations_bytes: int = 0  # the part of the activations no batch size changes (16-bit weight copies)
    gradient_shards: int = 1  # replicas the accumulated gradients are sharded over (`--sharding=zero2`)

    @property
    def total_bytes(self) -> int:
        return self.params_bytes + self.gradients_bytes + self.accumulator_bytes + self.optimizer_bytes + self.activations_bytes

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "total_bytes": self.total_bytes}

    def summary(self) -> str:
        mib = 1 << 20
        steps = self.gradient_accumulation_steps
        batch = f"batch {self.per_replica_batch}" + (f" in {steps} micro-batches" if steps > 1 else "")
        accumulator = f", accumulator {self.accumulator_bytes / mib:.1f} MiB" if self.accumulator_bytes else ""
        return (f"memory per replica ({self.precision}, {batch}): "
                f"params {self.params_bytes / mib:.1f} MiB, gradients {self.gradients_bytes / mib:.1f} MiB{accumulator}, "
                f"optimizer {self.optimizer_bytes / mib:.1f} MiB, activations {self.activations_bytes / mib:.1f} MiB, "
                f"total {self.total_bytes / mib:.1f} MiB")


# Backward-pass ops that read a tensor's shape only: the tensor need not stay alive for them.
SHAPE_READERS = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Forward-pass tensors that are not activations: variables, their reads, constants, the input batch.
NOT_ACTIVATIONS = frozenset({"ReadVariableOp", "VarHandleOp", "Const", "Placeholder"})
# Ops whose output is a view of their input's buffer in TensorFlow: kept once, under the tensor viewed.
VIEWS = frozenset({"Identity", "Reshape", "Squeeze", "ExpandDims"})


def _viewed(tensor: tf.Tensor) -> tf.Tensor:
    while tensor.op.type in VIEWS and tensor.op.inputs:
        tensor = tensor.op.inputs[0]
    return tensor


def saved_for_backward(model: keras.Model, input_shape: tuple[int, ...], batch: int) -> dict[str, int]:
    """Bytes by tensor name of the forward pass's tensors that the backward pass reads, for one training step of
    `model` at `batch` (traced into a graph, not run). The loss is the sum of the outputs: a loss adds only its own
    few tensors to what the model keeps."""
    forward_ops: set[str] = set()

    @tf.function
    def step(images):
        with tf.GradientTape() as tape:
            outputs = [output for output in tf.nest.flatten(model(images, training=True)) if output.dtype.is_floating]
            loss = tf.add_n([tf.reduce_sum(tf.cast(output, tf.float32)) for output in outputs])
        forward_ops.update(op.name for op in tf.compat.v1.get_default_graph().get_operations())
        return tape.gradient(loss, model.trainable_variables)

    graph = step.get_concrete_function(tf.TensorSpec((batch, *input_shape), tf.float32)).graph
    kept: dict[str, int] = {}
    for op in graph.get_operations():
        if op.name in forward_ops or op.type in SHAPE_READERS:
            continue
        for tensor in op.inputs:
            tensor = _viewed(tensor)
            source = tensor.op
            if (source.name in forward_ops and source.type not in NOT_ACTIVATIONS and tensor.dtype.is_floating
                    and tensor.shape.is_fully_defined()):
                kept[tensor.name] = tensor.shape.num_elements() * tensor.dtype.size
    return kept


def _outermost_checkpointed(layer: keras.layers.Layer) -> list[CheckpointedBlock]:
    """The checkpointed blocks (`--remat`) inside `layer` that are not inside another one."""
    found = []
    for child in getattr(layer, "layers", []) or []:
        if isinstance(child, CheckpointedBlock) and child.remat:
            found.append(child)
        elif isinstance(child, CheckpointedBlock):
            found += _outermost_checkpointed(child.block)
        elif isinstance(child, keras.Model):
            found += _outermost_checkpointed(child)
    return found


def _kept_and_working(model: keras.Model, input_shape: tuple[int, ...], batch: int) -> tuple[int, int]:
    """(bytes the step keeps for the backward pass, the most the backward pass adds to them at any moment): the
    gradient flowing into and out of the largest kept tensor, or a checkpointed block recomputed with its own."""
    blocks = _outermost_checkpointed(model)
    block_input_shapes = {}  # a ViT block's token count follows the image: read in the traced step

    def record(block, args, output):
        block_input_shapes[block] = tuple(args[0].shape[1:])

    with layer_outputs.observed_calls(blocks, record):
        kept = saved_for_backward(model, input_shape, batch)
    working = [2 * max(kept.values(), default=0)]
    for block in blocks:
        block_kept, block_working = _kept_and_working(block.block, block_input_shapes[block], batch)
        working.append(block_kept + block_working)
    return sum(kept.values()), max(working)


def activation_bytes(model: keras.Model, input_shape: tuple[int, ...]) -> tuple[int, int]:
    """(bytes per example, fixed bytes) of the activations one training step keeps (see the module docstring)."""
    one, two = (sum(_kept_and_working(model, input_shape, batch)) for batch in (1, 2))
    return two - one, max(0, 2 * one - two)


def estimate_memory(model: keras.Model, input_shape: tuple[int, ...], per_replica_batch: int, optimizer: str = "adamw",
                    views: float = 1, optimizer_shards: int = 1, accumulation_steps: int = 1,
                    gradient_shards: int = 1, weight_shards: int = 1) -> MemoryEstimate:
    """Estimates one replica's training memory.

    Args:
        model: the model as it will train (built under the run's policy).
        input_shape: one example's shape.
        per_replica_batch: examples per replica per step.
        optimizer: name in `OPTIMIZER_SLOTS`.
        views: forward passes per example, in full-size images (2 for SimCLR's two views; DINO's local crops count
            by their share of the pixels).
        optimizer_shards: replicas the optimizer state is sharded over (`--sharding=zero1`): each holds
            its share (an equal chunk of every variable, the last padded).
        accumulation_steps: micro-batches per step (`--gradient_accumulation_steps`): the activations are one
            micro-batch's, plus two gradient sizes (the running sum and the next).
        gradient_shards: replicas the accumulated gradients are sharded over (`--sharding=zero2`): the running sum
            and the next are each replica's chunks.
        weight_shards: replicas the trainable weights are sharded over (`--sharding=zero3`): each holds a chunk of
            every weight and receives a chunk of every gradient; the gathered copies a layer's backward pass needs stay
            until it runs (counted with the activations: the 16-bit copies under a mixed policy already are, in
            float32 the gathered float32 weights are added). A layer's whole gradient before its reduce-scatter is
            transient and not counted.
    """
    whole_trainable = sum(int(np.prod(v.shape)) * 4 for v in model.trainable_weights)
    trainable = -(-whole_trainable // weight_shards)
    params = sum(int(np.prod(v.shape)) * 4 for v in model.weights) - whole_trainable + trainable
    per_example, fixed = activation_bytes(model, input_shape)
    if weight_shards > 1 and precision.global_policy_name() == "float32":
        fixed += whole_trainable
    activations = round(per_example * (per_replica_batch // accumulation_steps) * views) + fixed
    return MemoryEstimate(
        precision=precision.global_policy_name(),
        per_replica_batch=per_replica_batch,
        params_bytes=params,
        gradients_bytes=trainable,
        optimizer_bytes=-(-whole_trainable * OPTIMIZER_SLOTS.get(optimizer, 2) // optimizer_shards),
        activations_bytes=activations,
        accumulator_bytes=2 * -(-whole_trainable // gradient_shards) if accumulation_steps > 1 else 0,
        gradient_accumulation_steps=accumulation_steps,
        fixed_activations_bytes=fixed,
        gradient_shards=gradient_shards,
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


def call_peak_bytes(function, *args, calls: int = 1, device: str = "CPU:0") -> float:
    """Peak bytes allocated on `device` while `function(*args)` runs, above what was allocated when it started: after
    one call outside the measurement (tracing, warm-up), the median over `calls` measured calls. Logical CPU devices
    (`tfmp.distribute.split_cpu`) share one allocator: on them it counts every replica of the process."""
    function(*args)
    peaks = []
    for _ in range(calls):
        if not reset_peak_memory(device):
            raise RuntimeError(
                f"TensorFlow keeps no allocation statistics for {device} in this process: with oneDNN off (TF's default "
                "on CPUs without AVX512_VNNI/AVX512_BF16/AMX) the CPU allocator does not count; "
                "set TF_ENABLE_ONEDNN_OPTS=1 before TensorFlow starts")
        before = tf.config.experimental.get_memory_info(device)["current"]
        function(*args)
        peaks.append(tf.config.experimental.get_memory_info(device)["peak"] - before)
    return float(np.median(peaks))


def measure_step_peak(model: keras.Model, images: np.ndarray, labels: np.ndarray, device: str = "CPU:0",
                      keep_gradients: bool = True) -> int:
    """Peak bytes allocated on `device` during one forward + backward pass, above what was
    allocated before it (variables and the batch itself excluded). With `keep_gradients=False` each
    weight gradient is summed away as soon as it exists, so the peak is the activations and the
    backward pass's working set, without the gradients piling up (the estimate's activations)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    images, labels = tf.constant(images), tf.constant(labels)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        if keep_gradients:
            return gradients
        return tf.add_n([tf.reduce_sum(tf.cast(gradient, tf.float32)) for gradient in gradients])

    return int(call_peak_bytes(step, device=device))
