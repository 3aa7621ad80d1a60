"""What a Keras model owns that tfmp's callbacks watch: its optimizers and the losses it logs.

Users' models are not all `compile(optimizer=...)` + `fit()`: keras-io's contrastive and GAN
examples keep their own optimizers as attributes (`self.contrastive_optimizer`,
`self.probe_optimizer`) and log losses under their own names (`c_loss`, `p_loss`), while the
optimizer `compile()` made never steps. The callbacks find all of them here rather than
assuming `model.optimizer` and `logs["loss"]`.
"""

from __future__ import annotations

import math

import keras

from tfmp import keras_internals


def owned_optimizers(model: keras.Model) -> dict[str, keras.optimizers.Optimizer]:
    """Every optimizer the model holds as an attribute, by attribute name (`optimizer` first), each once."""
    found: dict[str, keras.optimizers.Optimizer] = {}
    candidates = [("optimizer", getattr(model, "optimizer", None)), *sorted(keras_internals.model_attributes(model).items())]
    for name, value in candidates:
        if isinstance(value, keras.optimizers.Optimizer) and all(value is not seen for seen in found.values()):
            found[name] = value
    return found


def optimizer_steps(optimizer: keras.optimizers.Optimizer) -> int:
    """Updates the optimizer has applied (0 before it is built)."""
    return int(keras.ops.convert_to_numpy(optimizer.iterations)) if optimizer.built else 0


def learning_rate(optimizer: keras.optimizers.Optimizer) -> float:
    return float(keras.ops.convert_to_numpy(optimizer.learning_rate))


def logged_losses(logs: dict | None) -> dict[str, float]:
    """The training losses among Keras' batch or epoch logs: every key naming a loss (`loss`,
    `c_loss`, `generator_loss`, ...), validation ones excluded."""
    return {key: float(value) for key, value in (logs or {}).items()
            if "loss" in key and not key.startswith("val_") and _is_number(value)}


def first_non_finite(losses: dict[str, float]) -> str | None:
    """The name of a non-finite loss among `losses`, or None."""
    return next((name for name, value in losses.items() if not math.isfinite(value)), None)


def _is_number(value) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True
