"""The precision doctor: which layers would overflow or underflow in float16 or bfloat16.

`precision_report(model, data, steps=2)` runs a few training-like steps in float32
(forward, loss, backward; no update), and records for every leaf layer the largest
absolute activation and activation gradient, and the fraction of values that would
overflow (above the format's largest finite value) or be flushed to zero (non-zero
but below its smallest subnormal) in float16 and in bfloat16. Activations and their
gradients are what a mixed policy computes in the low precision; weights stay float32.

Layer outputs are captured as each leaf layer's call returns (`layer_outputs.observed_calls`), so nested models
(an encoder inside a classifier) are seen layer by layer.

Given a strategy with several replicas, each batch is split over them (`strategy.run`, eagerly: a thread per
replica, each capturing its own layers' outputs): what `tfmp.doctor --sharding=zero3` does, where no replica holds
the weights whole. Each replica's loss is divided by the number of replicas (Keras' convention), so the gradients
are those of the global batch's mean loss and the statistics those of the global batch — up to BatchNorm's
statistics, which are per replica unless synchronised.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading

import keras
import numpy as np
import tensorflow as tf

from tfmp.diagnostics.layer_outputs import display_names, leaf_layers, observed_calls

# Largest finite value and smallest positive subnormal of each format.
FORMATS = {
    "float16": (65504.0, 2.0**-24),
    "bfloat16": (float(tf.bfloat16.max), 2.0**-133),
}


@dataclasses.dataclass
class LayerStats:
    """What one leaf layer produced over the report's steps."""

    name: str
    max_activation: float
    max_gradient: float
    overflow: dict[str, float]  # format -> fraction of activation or gradient values above its max
    underflow: dict[str, float]  # format -> fraction of non-zero values below its smallest subnormal


@dataclasses.dataclass
class PrecisionReport:
    """Per-layer statistics, in the order the layers ran.

    Attributes:
        layers: one entry per leaf layer.
        typical_small_gradient: 1st percentile of the non-zero |activation gradients|.
    """

    layers: list[LayerStats]
    typical_small_gradient: float | None = None

    def overflowing_layers(self, dtype: str = "float16") -> list[str]:
        """Names of layers with any activation or gradient value out of `dtype`'s range."""
        return [layer.name for layer in self.layers if layer.overflow[dtype] > 0]

    def underflowing_layers(self, dtype: str = "float16", threshold: float = 0.01) -> list[str]:
        """Names of layers where more than `threshold` of the values would flush to zero in `dtype`."""
        return [layer.name for layer in self.layers if layer.underflow[dtype] > threshold]

    def loss_scale_range(self) -> tuple[float, float]:
        """(lowest, highest) power-of-two fp16 loss scale: the highest keeps the largest
        activation gradient finite; the lowest lifts the smallest typical (1st percentile)
        gradients above fp16's subnormal floor."""
        float16_max, float16_tiny = FORMATS["float16"]
        largest = max((layer.max_gradient for layer in self.layers), default=1.0) or 1.0
        highest = 2.0 ** np.floor(np.log2(float16_max / largest))
        lowest = 2.0 ** np.ceil(np.log2(float16_tiny / self.typical_small_gradient)) if self.typical_small_gradient else 1.0
        return float(min(max(lowest, 1.0), highest)), float(highest)

    def table(self) -> str:
        width = max([28, *(len(layer.name) for layer in self.layers)])  # a ViT's block3_attention/attention_output
        header = (f"{'layer':<{width}} {'max |act|':>10} {'max |grad|':>10} {'fp16 over':>9} {'fp16 flush':>10} "
                  f"{'bf16 over':>9} {'bf16 flush':>10}")
        rows = [header, "-" * len(header)]
        for layer in self.layers:
            rows.append(f"{layer.name:<{width}} {layer.max_activation:>10.3g} {layer.max_gradient:>10.3g} "
                        f"{layer.overflow['float16']:>9.2%} {layer.underflow['float16']:>10.2%} "
                        f"{layer.overflow['bfloat16']:>9.2%} {layer.underflow['bfloat16']:>10.2%}")
        return "\n".join(rows)

    def __str__(self) -> str:
        return self.table()


class _Accumulator:
    def __init__(self):
        self.max_activation = self.max_gradient = 0.0
        self.counts = {name: {"over": 0, "flush": 0} for name in FORMATS}
        self.total = 0

    def add(self, values: np.ndarray, is_gradient: bool) -> None:
        magnitude = np.abs(values.astype(np.float64)).ravel()
        largest = float(magnitude.max()) if magnitude.size else 0.0
        if is_gradient:
            self.max_gradient = max(self.max_gradient, largest)
        else:
            self.max_activation = max(self.max_activation, largest)
        self.total += magnitude.size
        for name, (biggest, smallest) in FORMATS.items():
            self.counts[name]["over"] += int(np.count_nonzero(magnitude > biggest))
            self.counts[name]["flush"] += int(np.count_nonzero((magnitude > 0) & (magnitude < smallest)))


class _EagerMirroredWarningFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "Using MirroredStrategy eagerly" not in record.getMessage()


@contextlib.contextmanager
def _eager_replicas_on_purpose():
    """TensorFlow warns that `strategy.run` outside a `tf.function` is slow and to wrap it in one; the report runs it
    eagerly on purpose (each replica's statistics in NumPy, a few batches), so the advice is dropped while it runs."""
    tensorflow_logger, dropped = logging.getLogger("tensorflow"), _EagerMirroredWarningFilter()
    tensorflow_logger.addFilter(dropped)
    try:
        yield
    finally:
        tensorflow_logger.removeFilter(dropped)


def _mean_cross_entropy(targets, logits):
    return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(targets, logits, from_logits=True))


def precision_report(model: keras.Model, data, steps: int = 2, loss_fn=None, batch_loss=None,
                     strategy: tf.distribute.Strategy | None = None) -> PrecisionReport:
    """Runs `steps` batches of `data` through `model` in float32 and reports per layer.

    Args:
        model: a Keras model built under the float32 policy (what the report measures
            is what float16/bfloat16 *would* do with these values).
        data: an iterable of `(inputs, targets)` batches (e.g. a `tf.data.Dataset`; with `strategy`, one it can
            distribute, or already distributed).
        steps: batches to run.
        loss_fn: loss(targets, outputs), the mean over the batch given; sparse categorical cross-entropy on logits by
            default. With several replicas a function, not a `keras.losses.Loss` object: Keras' losses divide
            themselves by the number of replicas inside `strategy.run` (where reduced to a mean), which the report
            does itself.
        batch_loss: instead of calling `model` and `loss_fn`, the loss of a batch's inputs computed by running `model`
            as its training step does (an SSL method's `batch_loss`: its views, heads, decoder, targets).
        strategy: the strategy `model` was built under; with several replicas each batch is split over them (see
            the module docstring). None: the strategy in scope.

    Returns:
        A `PrecisionReport`.
    """
    strategy = strategy or tf.distribute.get_strategy()
    replicas = strategy.num_replicas_in_sync
    if replicas > 1 and isinstance(loss_fn, keras.losses.Loss):
        raise ValueError("precision_report on several replicas takes loss_fn as a function (e.g. lambda targets, "
                         "outputs: keras.ops.mean(keras.losses.sparse_categorical_crossentropy(targets, outputs)))"
                         f", not a {type(loss_fn).__name__} object: those divide themselves by the replicas")
    loss_fn = loss_fn or _mean_cross_entropy
    if replicas > 1 and isinstance(data, tf.data.Dataset):
        data = strategy.experimental_distribute_dataset(data)
    accumulators: dict[str, _Accumulator] = {}
    all_gradients = []
    layers = leaf_layers(model)
    names = display_names(layers)
    captured_by_thread: dict[int, list] = {}  # each replica runs in a thread of its own
    lock = threading.Lock()

    def capture(layer, args, output):
        if isinstance(output, tf.Tensor) and output.dtype.is_floating:
            captured_by_thread.setdefault(threading.get_ident(), []).append((names[layer], output))

    def measured_step(inputs, targets):
        captured = captured_by_thread.setdefault(threading.get_ident(), [])
        captured.clear()
        with tf.GradientTape() as tape:
            loss = batch_loss(inputs) if batch_loss else loss_fn(targets, model(inputs, training=True))
            loss = loss / replicas  # the gradients of the global batch's mean loss, on every replica
        gradients = tape.gradient(loss, [tensor for _, tensor in captured])
        measured = [(name, activation.numpy(), None if gradient is None else gradient.numpy())
                    for (name, activation), gradient in zip(captured, gradients)]
        captured.clear()
        with lock:
            for name, activation, gradient in measured:
                accumulator = accumulators.setdefault(name, _Accumulator())
                accumulator.add(activation, is_gradient=False)
                if gradient is not None:
                    accumulator.add(gradient, is_gradient=True)
                    nonzero = np.abs(gradient[gradient != 0])
                    if nonzero.size:
                        all_gradients.append(nonzero.astype(np.float64))

    with observed_calls(layers, capture), _eager_replicas_on_purpose():
        for step, (inputs, targets) in enumerate(data):
            if step >= steps:
                break
            if replicas > 1:
                strategy.run(measured_step, args=(inputs, targets))
            else:
                measured_step(inputs, targets)
    layers = [LayerStats(name, a.max_activation, a.max_gradient,
                         overflow={f: a.counts[f]["over"] / max(a.total, 1) for f in FORMATS},
                         underflow={f: a.counts[f]["flush"] / max(a.total, 1) for f in FORMATS})
              for name, a in accumulators.items()]
    typical_small = float(np.percentile(np.concatenate(all_gradients), 1)) if all_gradients else None
    return PrecisionReport(layers, typical_small)
