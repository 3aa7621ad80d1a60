"""The one config schema of a tfmp run: defaults, the check of every setting, absl flags.

This module imports no TensorFlow, so the CLI can refuse bad input (one line, exit
code 2) before TensorFlow starts and prints its own start-up lines. Plug-in names
(tasks, SSL methods, encoders, dataset sources) are checked against `tfmp.registry`,
also TensorFlow-free; the other vocabularies live here.

Defaults live in `Config` and nowhere else: `define_flags()` turns each field into an
absl flag with the same name, default and help, so a flagfile (`--flagfile=...`)
changes only what differs from the defaults and later command-line flags override
the flagfile. The resolved config is written to `WORKDIR/config.json`.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re

from absl import flags

from tfmp import registry as tfmp_registry



class Precision(str, enum.Enum):
    """The precisions tfmp runs, by their Keras policy names (`auto`: chosen from the hardware).

    A `str` enum, so a member compares equal to its name and serialises as it.
    """

    FLOAT32 = "float32"
    MIXED_FLOAT16 = "mixed_float16"
    MIXED_BFLOAT16 = "mixed_bfloat16"
    AUTO = "auto"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: "str | Precision") -> "Precision":
        """The member for a name or alias (`fp32`, `fp16`, `bf16`; any case).

        Raises:
            UsageError: not a known precision; the message lists the valid ones.
        """
        key = str(name).strip().lower()
        key = PRECISION_ALIASES.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise UsageError(f"unknown precision {name!r}; valid: {', '.join(PRECISION_NAMES)}") from None


PRECISIONS = tuple(member.value for member in Precision if member is not Precision.AUTO)  # the concrete policies
PRECISION_ALIASES = {"fp32": "float32", "fp16": "mixed_float16", "bf16": "mixed_bfloat16"}
PRECISION_NAMES = PRECISIONS + tuple(PRECISION_ALIASES) + ("auto",)
JIT_COMPILE_CHOICES = ("auto", "true", "false")
STRATEGIES = ("auto", "off", "one_device", "mirrored", "multi_worker_mirrored", "tpu")
OPTIMIZERS = ("adamw", "sgd", "lars")
LEARNING_RATE_SCALINGS = ("none", "linear", "sqrt")
# What is sharded across replicas, by ZeRO's stage names (tfmp.sharding).
SHARDING_STAGES = ("none", "zero1", "zero2", "zero3")
# Stages whose checkpoints hold the same state (the weights under Keras' own keys, the optimizer state per variable in
# `tfmp.sharding.checkpoint_state`): a run may resume under another of them. `none` keeps Keras' optimizer slots.
SHARED_CHECKPOINT_STAGES = ("zero1", "zero2", "zero3")
# Settings renamed: old name -> (new name, the values the old name took). Old config.json files and flags still work.
RENAMED_SETTINGS = {"optimizer_sharding": ("sharding", ("none", "zero1"))}
REMAT_MODES = ("none", "blocks", "full")
MAX_IMAGE_SIZE = 1024  # --image_size above this: a decoded data set of many GB, not what tfmp's encoders are for
MIN_LOGICAL_DEVICES_ALLOWED = 4
CONV_WEIGHT_GRADIENTS = ("auto", "tf", "tap_matmul")
# Fields that say where things are or how a run is looked after, not what is trained:
# they may change between a run and its resumption without making the two incompatible. The devices are among
# them: --global_batch_size is global, so a run resumes on another number of replicas with the same batches in the
# same order (the checkpoint's optimizer state, ZeRO-1's included, is laid out anew; a warning says so).
CHANGEABLE_ON_RESUME = ("verbose", "data_dir", "strategy", "num_cpu_devices", "tpu", "worker_hosts", "task_index", "dry_run",
                        "device_memory", "ignore_memory_estimate", "jit_compile", "conv_weight_gradient", "steps_per_execution",
                        "checkpoint_every_steps", "checkpoint_every_seconds", "keep_checkpoints",
                        "nan_retries", "max_skipped_steps", "loss_explosion_factor", "replica_check_every_steps")


# Numerics a failed (diverged) run may be rerun with, in the same workdir: the rerun resumes from the last good
# checkpoint (the newest one: a state that is not finite is never saved) with the new values.
CHANGEABLE_AFTER_FAILURE = ("learning_rate", "warmup_epochs", "weight_decay", "float32_layers", "initial_loss_scale",
                            "loss_scale_growth_steps", "probe_learning_rate", "baseline_learning_rate")


class UsageError(ValueError):
    """Bad input from the user: the CLI prints the message as one line and exits 2."""


def canonical_precision(name: str) -> str:
    """Maps a precision name or alias to its canonical spelling (`auto` stays `auto`).

    Raises:
        UsageError: not a known precision; the message lists the valid ones.
    """
    return Precision.parse(name).value


# ------------------------------------------------------------------ per-setting checks
# Each returns what is wrong with a value (the rest of the one-line error), or None.

def one_of(*choices):
    return lambda name, value: None if value in choices else f"unknown {name} {value!r}; valid: {', '.join(choices)}"


def unset_or(check):
    """A renamed setting's check: empty (not given) or what `check` accepts."""
    return lambda name, value: None if value == "" else check(name, value)


def registered(registry: tfmp_registry.Registry):
    def check(name, value):
        return None if value in registry else f"unknown {name} {value!r}; valid: {', '.join(registry.spellings())}"
    return check


def positive_integer(name, value):
    return None if value >= 1 else f"{name} must be a positive integer, got {value}"


def at_least_zero(name, value):
    return None if value >= 0 else f"{name} must be >= 0, got {value}"


def above_zero(name, value):
    return None if value > 0 else f"{name} must be > 0, got {value}"


def fraction(name, value):
    return None if 0 < value <= 1 else f"{name} must be in (0, 1], got {value}"


def open_fraction(name, value):
    return None if 0 < value < 1 else f"{name} must be in (0, 1), got {value}"


def probability(name, value):
    return None if 0 <= value <= 1 else f"{name} must be in [0, 1], got {value}"


def momentum(name, value):
    return None if 0 <= value < 1 else f"{name} must be in [0, 1), got {value}"


def at_least_one(name, value):
    return None if value >= 1 else f"{name} must be >= 1, got {value}"


MEMORY_UNITS = {"": 1, "b": 1, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9, "tb": 10 ** 12,
                "kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "tib": 2 ** 40}


def parse_memory_size(text: str) -> int:
    """Bytes in `text`: `16GiB`, `15.5GB`, `512MiB`, `1073741824`.

    Raises:
        ValueError: naming the forms it reads.
    """
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in MEMORY_UNITS or float(match.group(1)) <= 0:
        raise ValueError(f"device_memory must be a size such as 16GiB, 15.5GB or 512MiB, got {text!r}")
    return int(float(match.group(1)) * MEMORY_UNITS[unit])


def memory_size(name, value):
    if not value:
        return None
    try:
        parse_memory_size(value)
    except ValueError as error:
        return str(error)
    return None


def image_side(name, value):
    if not 0 <= value <= MAX_IMAGE_SIZE:
        return f"{name} must be 0 (the data set's own size) or a side of at most {MAX_IMAGE_SIZE}px, got {value}"
    return None


def logical_cpu_devices(name, value):
    most = max(MIN_LOGICAL_DEVICES_ALLOWED, 2 * (os.cpu_count() or 1))
    if not 0 <= value <= most:
        return (f"{name} must be in [0, {most}] here (2 per core, {os.cpu_count()} cores: logical devices share the cores, "
                f"and more of them only slow the run), got {value}")
    return None


def off_or_above_one(name, value):
    return None if value == 0 or value > 1 else f"{name} must be 0 (off) or > 1, got {value}"


MAX_SEED = 2 ** 32 - 1  # NumPy's and TensorFlow's seeds are 32-bit


def seed_range(name, value):
    return None if 0 <= value <= MAX_SEED else f"{name} must be in [0, {MAX_SEED}], got {value}"


def regular_expression(name, value):
    try:
        re.compile(value)
    except re.error as error:
        return f"{name} {value!r} is not a valid regular expression: {error}"
    return None


def loss_scale_value(name, value):
    try:
        if value == "dynamic" or float(value) > 0:
            return None
    except ValueError:
        pass
    return f"{name} must be 'dynamic' or a positive number, got {value!r}"


def _field(default, help_text: str, check=None):
    return dataclasses.field(default=default, metadata={"help": help_text, "check": check})


def _method_field(methods: str, default, help_text: str, check=None):
    """A setting of the SSL methods `methods` names ("byol, mocov3, dino"; each method's class lists it in its
    `settings`, tests/test_registry.py checks both agree): its help starts with them and `--help` groups it with them."""
    return dataclasses.field(default=default, metadata={"help": f"{methods}: {help_text}", "check": check,
                                                        "methods": tuple(name.strip() for name in methods.split(","))})


TWO_VIEW_HEADS = "simclr, byol, vicreg, barlow_twins, mocov3, dino"  # the methods with a projection head


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything that defines a run. Field names are also the CLI flag names, and each field
    carries its own check (`validate` applies them all)."""

    task: str = _field("supervised", f"What to run: {', '.join(tfmp_registry.TASKS.names())}, or an SSL method "
                                     f"({', '.join(tfmp_registry.SSL_METHODS.names())}): pretraining, probes, baseline.")
    dataset: str = _field("digits", f"Data set: {', '.join(tfmp_registry.DATASET_SOURCES.spellings())}.")
    data_dir: str = _field("", "tensorflow-datasets data directory (tfds:NAME only).")
    unlabeled_split: str = _field("", "tfds split of extra unlabeled images to pretrain on (e.g. 'unlabelled' for tfds:stl10).")
    skip_unreadable_images: bool = _field(False, "folder: datasets: train without image files that do not decode "
                                           "(default: name them and exit 2).")
    encoder: str = _field("", "Pretrained encoder (.keras) for --task=linear_eval and --task=finetune.")
    model: str = _field("small_cnn", f"Encoder: {', '.join(tfmp_registry.ENCODERS.names())}.",
                        registered(tfmp_registry.ENCODERS))
    image_size: int = _field(0, "Resize images to this side length; 0 keeps the data set's own size.", image_side)
    precision: str = _field("auto", f"Precision: {', '.join(PRECISION_NAMES)}.")
    jit_compile: str = _field("auto", f"Compile training steps with XLA: {', '.join(JIT_COMPILE_CHOICES)} (auto: on TPUs, and on "
                                      "a single GPU as Keras does; off on CPUs, where XLA measured slower).",
                              one_of(*JIT_COMPILE_CHOICES))
    steps_per_execution: int = _field(0, "Training steps per compiled call (Keras' steps_per_execution): the largest divisor of "
                                         "an epoch's steps up to N (0: up to 64 and up to --checkpoint_every_steps; 1: one step a "
                                         "call). Callbacks then see one batch end per call.", at_least_zero)
    strategy: str = _field("auto", f"Distribution strategy: {', '.join(STRATEGIES)}.", one_of(*STRATEGIES))
    num_cpu_devices: int = _field(0, "Split the CPU into this many logical devices (0: leave it whole).", logical_cpu_devices)
    tpu: str = _field("", "TPU for --strategy=tpu: 'local' on a TPU VM, empty on Colab, else a name or grpc:// address.")
    worker_hosts: str = _field("", "multi_worker_mirrored: host:port of every worker, comma-separated (else TF_CONFIG is read).")
    task_index: int = _field(0, "multi_worker_mirrored: this worker's index in --worker_hosts (0 is the chief).", at_least_zero)
    global_batch_size: int = _field(128, "Examples per step, summed over all replicas.", positive_integer)
    epochs: int = _field(15, "Training epochs.", positive_integer)
    learning_rate: float = _field(3e-3, "Base learning rate (peak after warmup, then cosine decay; see --learning_rate_scaling).",
                                  above_zero)
    learning_rate_scaling: str = _field("none", f"Scale the learning rate with the global batch B: {', '.join(LEARNING_RATE_SCALINGS)} "
                                                "(linear: x B/256, sqrt: x sqrt(B)).", one_of(*LEARNING_RATE_SCALINGS))
    warmup_epochs: float = _field(1.0, "Linear learning-rate warmup, in epochs.", at_least_zero)
    optimizer: str = _field("adamw", f"Optimizer: {', '.join(OPTIMIZERS)}.", one_of(*OPTIMIZERS))
    weight_decay: float = _field(1e-4, "Decoupled weight decay.", at_least_zero)
    global_clipnorm: float = _field(0.0, "Clip the gradient to this global norm (Keras' name), of the true gradient: summed "
                                         "over the replicas and unscaled under fp16, alike on every replica (0: off).",
                                    at_least_zero)
    clipnorm: float = _field(0.0, "Clip each variable's gradient to this norm (Keras' name; DINO's clip_grad), after the "
                                  "replicas' sum and unscaled, as --global_clipnorm (0: off; not with it, nor with "
                                  "--sharding).", at_least_zero)
    layer_decay: float = _field(1.0, "finetune (or --compare_finetune) on a ViT: layer-wise learning-rate decay (BEiT/MAE), "
                                     "block i of d learning at "
                                     "decay^(d - i), the patch embedding at decay^(d + 1), the head at 1 (1: off).", probability)
    ema_momentum: float = _field(0.0, "Keep an exponential moving average of the weights with this momentum (Keras' name, "
                                      "e.g. 0.999; 0: off): evaluated and exported beside the trained weights.", momentum)
    gradient_accumulation_steps: int = _field(1, "Take each step's batch in this many micro-batches per replica (Keras' name; "
                                                 "one optimizer step per batch, as without): a loss that couples the "
                                                 "batch (simclr, mocov3, vicreg, barlow_twins) gets the whole batch's "
                                                 "gradient by gradient caching.", positive_integer)
    remat: str = _field("none", f"Activation checkpointing: {', '.join(REMAT_MODES)} (blocks: recompute each residual "
                                "or transformer block in the backward pass; full: also each ResNet stage around its blocks).",
                        one_of(*REMAT_MODES))
    sharding: str = _field("none", f"What is sharded across replicas (ZeRO's stages): {', '.join(SHARDING_STAGES)} (zero1: "
                                   "each replica keeps and updates the optimizer state of its chunk of the weights; zero2: "
                                   "also sums only its chunk of the accumulated gradients, with "
                                   "--gradient_accumulation_steps > 1; zero3 (FSDP): also holds only its chunk of the "
                                   "weights, gathered where a layer reads them).", one_of(*SHARDING_STAGES))
    optimizer_sharding: str = _field("", "The previous name of --sharding (none or zero1), still accepted.",
                                     unset_or(one_of(*RENAMED_SETTINGS["optimizer_sharding"][1])))
    drop_path_rate: float = _field(0.0, "ViT encoders: stochastic depth of the last block (DeiT's drop path), rising "
                                        "linearly from 0 at the first.", momentum)
    conv_weight_gradient: str = _field("auto", f"Convolution weight gradient: {', '.join(CONV_WEIGHT_GRADIENTS)} (auto: one bf16 "
                                               "matmul per kernel tap where measured faster, on CPUs with bf16 units; tf: "
                                               "TensorFlow's kernel everywhere; tap_matmul: the matmuls wherever the shape rule holds).",
                                       one_of(*CONV_WEIGHT_GRADIENTS))
    bn_momentum: float = _field(0.9, "BatchNorm momentum (0.9 suits small data sets; Keras' default is 0.99).", momentum)
    float32_layers: str = _field("", "Regular expression: layers whose names match stay float32 under a mixed policy.",
                                 regular_expression)
    loss_scale: str = _field("dynamic", "mixed_float16 loss scale: 'dynamic' or a fixed number.", loss_scale_value)
    initial_loss_scale: float = _field(2.0**15, "Starting dynamic loss scale (mixed_float16; at least its floor, 1).", at_least_one)
    loss_scale_growth_steps: int = _field(2000, "Finite steps before the dynamic loss scale doubles.", positive_integer)
    seed: int = _field(0, "Seed for initialisation, shuffling and augmentation.", seed_range)
    # Self-supervised pretraining (--task=<an SSL method>) and its evaluation.
    pretrain_examples: int = _field(0, "Pretrain on a seeded sample of this many images (0: all; for data-size sweeps).", at_least_zero)
    temperature: float = _method_field("simclr, mocov3", 0.2, "softmax temperature (NT-Xent, InfoNCE).", above_zero)
    projection_dim: int = _method_field(TWO_VIEW_HEADS, 128, "output size of the projection head (and of the byol/mocov3 "
                                                             "predictor; dino: its bottleneck).", positive_integer)
    projection_hidden_dim: int = _method_field(TWO_VIEW_HEADS, 0, "hidden size of the projection head and predictor (0: the "
                                                                  "encoder's feature size).",
                                        at_least_zero)
    target_momentum: float = _method_field("byol, mocov3, dino", 0.99, "momentum of the EMA target at step 0 (rises to 1 "
                                                                       "on a cosine).", probability)
    invariance_weight: float = _method_field("vicreg", 25.0, "weight of the invariance (MSE) term.", at_least_zero)
    variance_weight: float = _method_field("vicreg", 25.0, "weight of the variance (hinge on standard deviation) term.", at_least_zero)
    covariance_weight: float = _method_field("vicreg", 1.0, "weight of the covariance term.", at_least_zero)
    redundancy_weight: float = _method_field("barlow_twins", 0.0051, "weight of the off-diagonal cross-correlation terms.", at_least_zero)
    local_crops: int = _method_field("dino", 6, "local crops per image beside the 2 global ones (multi-crop; 0: the 2 global only).",
                              at_least_zero)
    local_crop_size: int = _method_field("dino", 0, "side of the local crops in pixels (0: 96/224 of the image side, rounded to the "
                                     "ViT's patch, at least one patch).", at_least_zero)
    local_crop_min_scale: float = _method_field("dino", 0.05, "smallest area fraction of a local crop (the largest is --crop_min_scale, "
                                               "the global crops' smallest).", fraction)
    prototypes: int = _method_field("dino", 4096, "output size of the DINO head (K; 65536 in the paper).", positive_integer)
    student_temperature: float = _method_field("dino", 0.1, "softmax temperature of the student.", above_zero)
    teacher_temperature: float = _method_field("dino", 0.04, "softmax temperature of the teacher after its warmup.", above_zero)
    warmup_teacher_temperature: float = _method_field("dino", 0.04, "the teacher's temperature at step 0 (linear to "
                                                     "--teacher_temperature).", above_zero)
    warmup_teacher_temperature_epochs: float = _method_field("dino", 0.0, "epochs of the teacher temperature's warmup.", at_least_zero)
    center_momentum: float = _method_field("dino", 0.9, "momentum of the centre subtracted from the teacher's outputs.", momentum)
    freeze_last_layer_epochs: float = _method_field("dino", 1.0, "epochs during which the head's last layer takes no gradient.",
                                             at_least_zero)
    mask_ratio: float = _method_field("mae", 0.75, "fraction of each image's patches hidden from the encoder.", open_fraction)
    decoder_width: int = _method_field("mae", 512, "token width of the decoder.", positive_integer)
    decoder_depth: int = _method_field("mae", 8, "transformer blocks of the decoder.", positive_integer)
    decoder_heads: int = _method_field("mae", 16, "attention heads of the decoder (dividing --decoder_width).", positive_integer)
    norm_pixel_loss: bool = _method_field("mae", True, "reconstruct each patch's pixels normalised to mean 0, variance 1 "
                                         "(the paper's better setting), else raw.")
    stop_on_plateau: bool = _field(False, "Stop pretraining when the kNN monitor plateaus (the small-data guard).")
    crop_min_scale: float = _field(0.08, "Smallest area fraction of the random resized crop.", fraction)
    flip: bool = _field(True, "Random horizontal flips (turn off for digits and text).")
    color_jitter: float = _field(0.5, "Colour jitter strength (0: off).", at_least_zero)
    blur_probability: float = _field(0.5, "Probability of Gaussian blur (images of 16px and more).", probability)
    noise_stddev: float = _field(0.0, "Additive Gaussian pixel noise (0: off).", at_least_zero)
    label_fraction: float = _field(1.0, "Fraction of the train labels the probes, fine-tuning and baseline may use (class balanced).",
                                   fraction)
    label_draws: int = _field(1, "Repeat the probes and the baseline on this many seeded label subsets; report the mean.",
                              positive_integer)
    probe_epochs: int = _field(200, "Epochs of the linear probe on frozen features.", positive_integer)
    probe_learning_rate: float = _field(0.01, "Learning rate of the linear probe.", above_zero)
    knn_every_epochs: int = _field(10, "Measure kNN accuracy every N pretraining epochs.", positive_integer)
    compare_supervised: bool = _field(False, "After pretraining, also train the encoder from scratch on the labeled subset.")
    compare_finetune: bool = _field(False, "After pretraining, also fine-tune the pretrained encoder + a linear head on each "
                                           "label draw with the baseline's recipe (--baseline_epochs, "
                                           "--baseline_learning_rate; --layer_decay for a ViT): finetune_accuracy, how "
                                           "MAE is evaluated.")
    baseline_epochs: int = _field(200, "Epochs of the supervised baseline over the labeled subset.", positive_integer)
    baseline_learning_rate: float = _field(3e-3, "AdamW learning rate of the supervised baseline.", above_zero)
    dry_run: bool = _field(False, "Build model and input pipeline, write WORKDIR/memory_estimate.json (with the memory plan "
                                  "when --device_memory is known), and train nothing.")
    device_memory: str = _field("", "Memory of one device, e.g. 16GiB or 15.5GB: the memory plan names the cheapest --remat "
                                    "that fits, and a run predicted not to fit is refused (empty: the GPU's own, where "
                                    "nvidia-smi reports it; no plan on CPUs).", memory_size)
    ignore_memory_estimate: bool = _field(False, "Run even where the memory plan predicts the run does not fit.")
    smoke: bool = _field(False, "Smoke variant of the preset: the whole pipeline on a few steps per phase (first contact, CI; "
                                "about 20 s on 2 cores for the digits presets).")
    verbose: bool = _field(False, "Show TensorFlow's start-up lines, other libraries' INFO logs and the inner stages' epochs "
                                  "(probe, baseline).")
    keep_checkpoints: int = _field(3, "How many checkpoints to keep under WORKDIR/checkpoints.", positive_integer)
    checkpoint_every_steps: int = _field(0, "Also checkpoint every N optimizer steps (0: at epoch ends only).", at_least_zero)
    checkpoint_every_seconds: float = _field(10.0, "At epoch ends, checkpoint once N seconds have passed since the last checkpoint "
                                             "(0: every epoch end). The first and last epoch, --checkpoint_every_steps, SIGTERM and "
                                             "Ctrl-C always checkpoint; multi_worker_mirrored runs checkpoint every epoch end.",
                                             at_least_zero)
    nan_retries: int = _field(2, "On a non-finite loss, restore the last good checkpoint this many times before failing.",
                              at_least_zero)
    max_skipped_steps: int = _field(20, "fp16 steps skipped in a row (loss-scale overflow) that count as a failure once the "
                                        "loss scale is at its floor (while it can still halve, skips are it finding its scale).",
                                    at_least_zero)
    loss_explosion_factor: float = _field(1000.0, "A finite training loss this many times the best finished epoch's counts as "
                                          "divergence, like a non-finite one (0: off).", off_or_above_one)
    replica_check_every_steps: int = _field(100, "Check that all replicas hold identical variables every N steps "
                                                 "(0: epoch ends only).", at_least_zero)

    def replace(self, **changes) -> "Config":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def differences(self, other: "Config", *, after_failure: bool = False) -> list[str]:
        """Fields whose values differ, as `name: theirs -> mine`, but those a resumed run may change
        (`CHANGEABLE_ON_RESUME`; after a failed run, also `CHANGEABLE_AFTER_FAILURE`)."""
        mine, theirs = self.to_dict(), other.to_dict()
        free = CHANGEABLE_ON_RESUME + (CHANGEABLE_AFTER_FAILURE if after_failure else ())
        if {mine["sharding"], theirs["sharding"]} <= set(SHARED_CHECKPOINT_STAGES):
            free += ("sharding",)
        return [f"{key}: {theirs[key]!r} -> {mine[key]!r}" for key in mine if key not in free and mine[key] != theirs[key]]


def _check_fields(config: Config) -> None:
    for field in dataclasses.fields(Config):
        value = getattr(config, field.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{field.name} must be a finite number, got {value}")
        check = field.metadata["check"]
        problem = check(field.name, value) if check else None
        if problem:
            raise UsageError(problem)


def _check_task_and_dataset(config: Config) -> None:
    try:
        tfmp_registry.task_entry(config.task)
        source, argument = tfmp_registry.dataset_source(config.dataset)
    except tfmp_registry.UnknownName as error:
        raise UsageError(str(error)) from None
    if source.name == "folder" and not os.path.isdir(argument):
        raise UsageError(f"dataset {config.dataset}: no such directory")
    # data_dir is a location, harmless elsewhere
    _check_plugin_settings(config, tfmp_registry.DATASET_SOURCES, source, ("unlabeled_split", "skip_unreadable_images"),
                           "data sets", config.dataset)
    _check_plugin_settings(config, tfmp_registry.ENCODERS, tfmp_registry.ENCODERS.entry(config.model), ("drop_path_rate",),
                           "models", config.model)
    if config.task in ("linear_eval", "finetune"):
        if not config.encoder:
            raise UsageError(f"--task={config.task} needs --encoder=PATH (an encoder.keras written by --task="
                             f"{'|'.join(tfmp_registry.SSL_METHODS.names())})")
        if not os.path.isfile(config.encoder):
            raise UsageError(f"encoder {config.encoder}: no such file")


def _check_plugin_settings(config: Config, registry: tfmp_registry.Registry, chosen: tfmp_registry.Entry,
                           names: tuple[str, ...], kind: str, spelling: str) -> None:
    """Refuses a setting changed from its default that the chosen plug-in does not read."""
    defaults = Config()
    for name in names:
        if getattr(config, name) != getattr(defaults, name) and name not in chosen.settings:
            readers = [entry.spelling for entry in map(registry.entry, registry.names()) if name in entry.settings]
            raise UsageError(f"--{name} applies to {', '.join(readers)} {kind} only, not {spelling}")


def _check_workers(config: Config) -> None:
    if config.worker_hosts:
        hosts = config.worker_hosts.split(",")
        if config.strategy != "multi_worker_mirrored":
            raise UsageError(f"--worker_hosts needs --strategy=multi_worker_mirrored, not {config.strategy}")
        if any(":" not in host for host in hosts):
            raise UsageError(f"--worker_hosts must be host:port,host:port,..., got {config.worker_hosts!r}")
        if not 0 <= config.task_index < len(hosts):
            raise UsageError(f"--task_index must be in [0, {len(hosts) - 1}] for {len(hosts)} worker hosts, got {config.task_index}")
    if config.num_cpu_devices and config.global_batch_size % config.num_cpu_devices:
        raise UsageError(
            f"global_batch_size {config.global_batch_size} is not divisible by num_cpu_devices {config.num_cpu_devices}; "
            f"use a multiple of {config.num_cpu_devices}"
        )


def resolve_renamed(config: Config) -> Config:
    """The config with each renamed setting (`RENAMED_SETTINGS`) moved to its new name and the old one cleared;
    both names given with different values are refused in one line."""
    for old, (new, _) in RENAMED_SETTINGS.items():
        value = getattr(config, old)
        if not value:
            continue
        if getattr(config, new) not in (value, getattr(Config(), new)):
            raise UsageError(f"--{old}={value} and --{new}={getattr(config, new)} disagree; give --{new} only")
        config = config.replace(**{old: "", new: value})
    return config


def renamed_settings_given(config: Config) -> list[str]:
    """One note per renamed setting the config still spells the old way (said where the run starts)."""
    return [f"--{old}={getattr(config, old)} is now --{new}={getattr(config, old)} (the old name still works)"
            for old, (new, _) in RENAMED_SETTINGS.items() if getattr(config, old)]


def validate(config: Config) -> Config:
    """Checks a config without touching TensorFlow devices or the disk; returns it with
    the precision name made canonical (and capped to `SMOKE_LIMITS` with `--smoke`).

    Raises:
        UsageError: naming the bad value and the valid choices.
    """
    precision = canonical_precision(config.precision)
    _check_fields(config)
    config = resolve_renamed(config)
    _check_task_and_dataset(config)
    _check_workers(config)
    if config.global_batch_size % config.gradient_accumulation_steps:
        raise UsageError(f"gradient_accumulation_steps {config.gradient_accumulation_steps} does not divide global_batch_size "
                         f"{config.global_batch_size}; use a divisor of the per-replica batch")
    if config.clipnorm and config.global_clipnorm:
        raise UsageError("--clipnorm (per variable) cannot be combined with --global_clipnorm; use one clipping")
    fine_tunes = config.task == "finetune" or (config.compare_finetune and config.task in tfmp_registry.SSL_METHODS)
    if config.layer_decay != 1.0 and (not fine_tunes or config.layer_decay <= 0):
        raise UsageError(f"--layer_decay={config.layer_decay:g} is for --task=finetune or --compare_finetune of a ViT encoder, "
                         f"above 0 (got --task={config.task})")
    if config.compare_finetune and config.task not in tfmp_registry.SSL_METHODS:
        raise UsageError(f"--compare_finetune is for pretraining tasks ({', '.join(tfmp_registry.SSL_METHODS.names())}), "
                         f"not --task={config.task}")
    if config.warmup_epochs > config.epochs:
        raise UsageError(f"warmup_epochs {config.warmup_epochs:g} exceeds epochs {config.epochs}: the learning rate would never "
                         f"reach --learning_rate; use at most {config.epochs}")
    config = config.replace(precision=precision)
    return smoke_variant(config) if config.smoke else config


# What --smoke caps: every phase runs, each for a few steps (big_vision's `runlocal` idea).
SMOKE_LIMITS = {"epochs": 2, "probe_epochs": 10, "baseline_epochs": 5, "label_draws": 2, "knn_every_epochs": 1,
                "pretrain_examples": 512}


def smoke_variant(config: Config) -> Config:
    """The config capped to `SMOKE_LIMITS` (a value already below its cap stays)."""
    changes = {}
    for name, limit in SMOKE_LIMITS.items():
        value = getattr(config, name)
        changes[name] = limit if (name == "pretrain_examples" and value == 0) else min(value, limit)
    changes["warmup_epochs"] = min(config.warmup_epochs, changes["epochs"])  # within the epochs it runs
    return config.replace(**changes)


def load_json(path: str) -> Config:
    """Reads a config written by `save_json`; unknown keys are refused."""
    with open(path, encoding="utf-8") as file:
        values = json.load(file)
    known = {field.name for field in dataclasses.fields(Config)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise UsageError(f"{path}: unknown config keys {', '.join(unknown)}")
    return resolve_renamed(Config(**values))


def save_json(config: Config, path: str) -> None:
    with open(path, "w", encoding="utf-8") as file:
        json.dump(config.to_dict(), file, indent=2, sort_keys=True)
        file.write("\n")


# ------------------------------------------------------------------------------- flags

_DEFINERS = {str: flags.DEFINE_string, int: flags.DEFINE_integer, float: flags.DEFINE_float, bool: flags.DEFINE_bool}


def define_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines one absl flag per `Config` field (same name, default and help); `--help` lists the SSL methods' own
    settings under a heading per method (or group of methods sharing them), after the run's."""
    types = {"str": str, "int": int, "float": float, "bool": bool}
    for field in dataclasses.fields(Config):
        if field.name in flag_values:
            continue
        methods = field.metadata.get("methods")
        group = f"settings of --task={'|'.join(methods)}" if methods else "run settings (tfmp.config)"
        _DEFINERS[types[field.type]](field.name, field.default, field.metadata["help"], flag_values=flag_values,
                                     module_name=group)


def flag_error_message(error: flags.Error) -> str:
    """absl's flag-parsing error as one line (absl prefixes some with "ERROR::")."""
    return f"{str(error).splitlines()[0].removeprefix('ERROR::').strip()} (see --help for the flags)"


def from_flags(flag_values: flags.FlagValues = flags.FLAGS) -> Config:
    """The `Config` given by parsed flags."""
    return Config(**{field.name: flag_values[field.name].value for field in dataclasses.fields(Config)})
