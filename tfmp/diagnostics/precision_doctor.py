"""The precision doctor: which layers would overflow or underflow in float16 or bfloat16.

`precision_report(model, data, steps=2)` runs a few training-like steps in float32
(forward, loss, backward; no update), and records for every leaf layer the largest
absolute activation and activation gradient, and the fraction of values that would
overflow (above the format's largest finite value) or be flushed to zero (non-zero
but below its smallest subnormal) in float16 and in bfloat16. Activations and their
gradients are what a mixed policy computes in the low precision; weights stay float32.

Layer outputs are captured with `layer_outputs.captured_outputs`, so nested models
(an encoder inside a classifier) are seen layer by layer.
"""

from __future__ import annotations

import dataclasses

import keras
import numpy as np
import tensorflow as tf

from tfmp.diagnostics.layer_outputs import captured_outputs

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


def precision_report(model: keras.Model, data, steps: int = 2, loss_fn=None, batch_loss=None) -> PrecisionReport:
    """Runs `steps` batches of `data` through `model` in float32 and reports per layer.

    Args:
        model: a Keras model built under the float32 policy (what the report measures
            is what float16/bfloat16 *would* do with these values).
        data: an iterable of `(inputs, targets)` batches (e.g. a `tf.data.Dataset`).
        steps: batches to run.
        loss_fn: loss(targets, outputs); sparse categorical cross-entropy on logits by default.
        batch_loss: instead of calling `model` and `loss_fn`, the loss of a batch's inputs computed by running `model`
            as its training step does (an SSL method's `batch_loss`: its views, heads, decoder, targets).

    Returns:
        A `PrecisionReport`.
    """
    loss_fn = loss_fn or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    accumulators: dict[str, _Accumulator] = {}
    all_gradients = []
    with captured_outputs(model) as captured:
        for step, (inputs, targets) in enumerate(data):
            if step >= steps:
                break
            captured.clear()
            with tf.GradientTape() as tape:
                loss = batch_loss(inputs) if batch_loss else loss_fn(targets, model(inputs, training=True))
            gradients = tape.gradient(loss, [tensor for _, tensor in captured])
            for (name, activation), gradient in zip(captured, gradients):
                accumulator = accumulators.setdefault(name, _Accumulator())
                accumulator.add(activation.numpy(), is_gradient=False)
                if gradient is not None:
                    gradient_values = gradient.numpy()
                    accumulator.add(gradient_values, is_gradient=True)
                    nonzero = np.abs(gradient_values[gradient_values != 0])
                    if nonzero.size:
                        all_gradients.append(nonzero.astype(np.float64))

    layers = [LayerStats(name, a.max_activation, a.max_gradient,
                         overflow={f: a.counts[f]["over"] / max(a.total, 1) for f in FORMATS},
                         underflow={f: a.counts[f]["flush"] / max(a.total, 1) for f in FORMATS})
              for name, a in accumulators.items()]
    typical_small = float(np.percentile(np.concatenate(all_gradients), 1)) if all_gradients else None
    return PrecisionReport(layers, typical_small)
