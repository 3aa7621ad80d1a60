"""XLA: whether tfmp compiles its steps (`--jit_compile=auto|true|false`), decided per device with a reason;
`CompiledOnce`, one traced training step for several trainings of one recipe; and the optimizer built before the
first trace on one device (`build_optimizer_before_tracing`), so the step is traced once.

TPUs compile every step with XLA whatever Keras is told, and Keras' own `jit_compile="auto"`
turns XLA on by itself on a machine with one GPU and no `tf.distribute` strategy; so every
step tfmp runs (supervised, SimCLR with its augmentations, the probes' feature extraction
and linear probe) is written to compile, and `tests/test_xla.py` compiles each on the CPU,
whose XLA op set is the check for TPU readiness here.

`auto` picks what is fastest and safe where it was measured or is the platform's rule:

| where | auto | why |
|---|---|---|
| TPU | on | TPUs run XLA only |
| one GPU, no multi-replica strategy | on | what Keras' `jit_compile="auto"` does there |
| several GPUs | off | Keras turns XLA off under `tf.distribute`; not measured by tfmp (no GPU on its machines) |
| CPU | off | XLA measured slower than TF's oneDNN graphs on tfmp's CPUs, and erases the bf16 gain (BUILD_NOTES.md) |

What "on" compiles depends on the strategy (`scope`). XLA compiles one device's program.
Keras' `jit_compile=True` compiles the function that calls `strategy.run`, which under
`MirroredStrategy` spans every replica's device and fails ("Trying to access resource ...
located in device CPU:1 from device CPU:0"; Keras' own `auto` turns XLA off under
tf.distribute for this reason). A replica's step cannot be compiled on its own either: it
holds synchronisation points (gradient all-reduce, synchronized BatchNorm, NT-Xent's
all-gather) that `merge_call` cannot enter from inside XLA. So:

| strategy | what XLA compiles |
|---|---|
| one replica | the whole training step (Keras' `jit_compile=True`) |
| TPUStrategy | each replica's whole step, collectives included (TPUStrategy does it; Keras is told False) |
| several mirrored replicas | each replica's augmentations (the views: op-heavy, free of collectives); the rest TF graphs |
"""

from __future__ import annotations

from tfmp import distribute, hardware
from tfmp.config import JIT_COMPILE_CHOICES, UsageError

WHOLE_STEP = "whole step"
TPU_REPLICA_STEP = "each replica's whole step (TPUStrategy)"
REPLICA_AUGMENTATIONS = "each replica's augmentations"
OFF = "off"


def resolve(setting: str | bool = "auto", num_replicas: int = 1) -> tuple[bool, str]:
    """Whether to compile training steps with XLA here, and why (one line).

    Args:
        setting: `auto`, `true` or `false` (or a bool).
        num_replicas: replicas of the strategy the steps run under.

    Raises:
        UsageError: an unknown setting; the message lists the valid ones.
    """
    if isinstance(setting, bool):
        return setting, "explicit choice"
    setting = str(setting).strip().lower()
    if setting not in JIT_COMPILE_CHOICES:
        raise UsageError(f"unknown jit_compile {setting!r}; valid: {', '.join(JIT_COMPILE_CHOICES)}")
    if setting != "auto":
        return setting == "true", "explicit choice"
    if hardware.tpu_present():
        return True, "TPU: every step is compiled with XLA"
    gpus = hardware.gpu_compute_capabilities()
    if gpus and num_replicas == 1:
        return True, "one GPU: XLA fuses the step (Keras' own jit_compile='auto' does the same)"
    if gpus:
        return False, f"{num_replicas} GPU replicas: Keras turns XLA off under tf.distribute (not measured by tfmp)"
    return False, "CPU: XLA measured slower than TensorFlow's oneDNN graphs here"


def scope(jit_compile: bool, strategy) -> str:
    """What XLA compiles of a training step under `strategy` with `jit_compile` (see the module docstring)."""
    import tensorflow as tf

    if not jit_compile:
        return OFF
    if isinstance(strategy, tf.distribute.TPUStrategy):
        return TPU_REPLICA_STEP
    return WHOLE_STEP if strategy.num_replicas_in_sync == 1 else REPLICA_AUGMENTATIONS


def for_keras(jit_compile, strategy) -> bool | str:
    """The `jit_compile` to hand `model.compile` under `strategy`: Keras' own `"auto"` passes through,
    and True only where Keras can compile the whole step (one replica, not a TPU)."""
    if jit_compile == "auto":
        return "auto"
    return scope(bool(jit_compile), strategy) == WHOLE_STEP


def build_optimizer_before_tracing(model) -> None:
    """Builds `model`'s compiled optimizer now if it runs under TensorFlow's default strategy (one device). There Keras
    skips its build before tracing ("for backwards compatibility") and creates the optimizer's variables inside the
    first trace of the training step, and TensorFlow traces a function that created variables a second time: tracing
    paid twice (BUILD_NOTES, "Found on a Zen 3"). Under any other strategy Keras builds it before tracing itself.
    The caller vouches that every trainable variable of `model` exists (a built model; an SSL method, whose layers
    are built when it is made)."""
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built and distribute.strategy_name(model.distribute_strategy) == "off":
        optimizer.build(model.trainable_variables)


class CompiledOnce:
    """One compiled Keras model for several trainings of one recipe from fresh starts (the
    supervised baseline's and the linear probe's label draws).

    Keras traces and optimises a model's training step on its first `fit()`, and again for every
    new model: for the small CNN that took about as long as a baseline draw's 200 steps. Each
    training here still builds its own model (same seed, so the same initial weights as a model of
    its own), but trains in the first one's compiled model: the new model's weights are copied in
    and the optimizer's variables (step count, moments, loss scale) put back to their values before
    any step, so it trains exactly as its own model would (tests/test_tasks.py, tests/test_ssl.py).
    Every model given to one holder must have the same architecture, compile arguments and batch shape.
    """

    def __init__(self):
        self.model = None
        self._optimizer_start: list | None = None

    def compile(self, fresh, compile_model):
        """`fresh` compiled by `compile_model(fresh)` the first time; afterwards the compiled model,
        holding `fresh`'s weights and an optimizer that has taken no step."""
        if self.model is not None:
            return self.start_from(fresh)
        compile_model(fresh)
        self.keep(fresh)
        return fresh

    def keep(self, model) -> None:
        """Holds `model` (compiled, not yet trained) and its optimizer's starting state."""
        model.optimizer.build(model.trainable_variables)
        self.model = model
        self._optimizer_start = [variable.numpy() for variable in model.optimizer.variables]

    def start_from(self, fresh):
        """The compiled model, holding `fresh`'s weights and an optimizer that has taken no step."""
        self.model.set_weights(fresh.get_weights())
        for variable, value in zip(self.model.optimizer.variables, self._optimizer_start):
            variable.assign(value)
        return self.model
