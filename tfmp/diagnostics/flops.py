"""FLOPs of a training step and the peak FLOP/s of this CPU, for model FLOP/s utilisation (MFU).

    MFU = achieved FLOP/s / peak FLOP/s
    achieved = training FLOPs per example x examples per second
    training FLOPs per example = 3 x forward FLOPs (forward + backward) x views (SimCLR & co: 2)
    forward FLOPs = 2 x multiply-accumulates of every Conv2D, Dense and EinsumDense layer and of attention's two
                    matmuls (query x key, probabilities x value); element-wise ops, normalisation, softmax
                    and the loss are not counted
    peak = cores x clock x FLOPs per cycle per core (for the precision's vector units)

FLOPs per cycle per core, from the CPU's flags and family (`/proc/cpuinfo`):

| units | float32 | bf16 |
|---|---|---|
| AVX2 + FMA (Intel since Haswell, AMD Zen 2/3): 2 x 256-bit FMA | 32 | 32 (emulated through float32) |
| AMD Zen 4 (family 25 with AVX-512): 2 x 256-bit FMA, 512-bit ops in two halves | 32 | 64 (AVX512_BF16 dot products) |
| AMD Zen 5 (family 26): 2 x 512-bit FMA | 64 | 128 |
| Intel with AVX-512: 2 x 512-bit FMA (server parts) | 64 | 128 with AVX512_BF16 |
| Intel AMX (AMX_BF16) | 64 | 1024 (the tile unit) |

The clock is `TFMP_CPU_GHZ` when set, else /proc/cpuinfo's `cpu MHz`. In a VM that is usually the
nominal clock while the cores boost above it, so MFU can read above 1: the formula is reported with
every figure so that the assumption is visible.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from tfmp import hardware


def forward_flops_per_example(model, input_shape) -> int:
    """2 x MACs of the Conv2D, Dense and EinsumDense layers and of attention in `model`, for one example (see the
    module docstring)."""
    import keras

    from tfmp.diagnostics.layer_outputs import captured_outputs, display_names, leaf_layers

    from tfmp.models.vit import PatchEmbedding

    layers = leaf_layers(model)
    names = display_names(layers)
    kinds = {name: layer for layer, name in names.items()
             if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense, keras.layers.EinsumDense, PatchEmbedding))}
    with captured_outputs(model) as captured:
        model(np.zeros((1, *input_shape), np.float32), training=False)
    macs = 0
    for name, output in captured:
        layer = kinds.get(name)
        if layer is None:
            continue
        kernel = layer.kernel.shape  # Conv2D: (kh, kw, c_in, c_out); Dense, PatchEmbedding: (in, out)
        if isinstance(layer, keras.layers.EinsumDense):  # the kernel's axes that the output does not have are summed
            kernel_axes, output_axes = layer.equation.split(",")[1].split("->")
            summed = [size for axis, size in zip(kernel_axes, kernel) if axis not in output_axes]
            macs += int(np.prod(summed)) * int(np.prod(output.shape[1:]))
        else:
            macs += int(np.prod(kernel[:-1])) * int(np.prod(output.shape[1:]))
    layer_named = {name: layer for layer, name in names.items()}
    output_of = {layer_named[name]: output for name, output in captured}
    for attention, (queries, keys) in attention_lengths(model, output_of).items():
        # logits: queries x keys per head over key_dim; output: queries x value_dim per head over the keys
        value_dim = attention.value_dim or attention.key_dim
        macs += attention.num_heads * queries * keys * (attention.key_dim + value_dim)
    return 2 * macs


def attention_lengths(model, output_of: dict) -> dict:
    """Every `MultiHeadAttention` layer in `model` (nested models too) -> (query length, key length): the lengths of
    its query and key projections' outputs in one call (`output_of`: layer -> output; a ViT's token count follows
    the image)."""
    import keras

    from tfmp import keras_internals

    lengths = {}
    for layer in keras_internals.nested_layers(model):
        if isinstance(layer, keras.layers.MultiHeadAttention):
            lengths[layer] = (int(output_of[layer.query_dense].shape[1]), int(output_of[layer.key_dense].shape[1]))
    return lengths


@dataclasses.dataclass(frozen=True)
class Peak:
    flops_per_second: float | None  # None: the clock is unknown
    formula: str


def flops_per_cycle(precision: str, flags: frozenset[str], vendor: str, family: int) -> tuple[int, str]:
    """(FLOPs per cycle per core, the units it assumes) for a precision policy name on this CPU."""
    amd = vendor == "AuthenticAMD"
    if amd and family >= 26:
        float32, wide = 64, "AMD Zen 5: 2 x 512-bit FMA"
    elif amd and "avx512f" in flags:
        float32, wide = 32, "AMD Zen 4: 2 x 256-bit FMA"
    elif "avx512f" in flags:
        float32, wide = 64, "Intel AVX-512: 2 x 512-bit FMA"
    elif "avx2" in flags and "fma" in flags:
        float32, wide = 32, "AVX2: 2 x 256-bit FMA"
    else:
        float32, wide = 8, "SSE: 2 x 128-bit add + mul"
    if precision != "mixed_bfloat16":
        return float32, f"{wide}, float32"
    if "amx_bf16" in flags:
        return 1024, "AMX bf16 tiles"
    if "avx512_bf16" in flags:
        return 2 * float32, f"{wide}, AVX512_BF16 dot products"
    return float32, f"{wide}, bf16 emulated through float32"


def _cpuinfo_fields() -> dict[str, str]:
    fields = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if not line.strip():
                    break  # the first processor's block is enough
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        pass
    return fields


def clock_ghz() -> tuple[float | None, str]:
    """(GHz, where it came from): TFMP_CPU_GHZ, else /proc/cpuinfo's `cpu MHz`, else unknown."""
    if os.environ.get("TFMP_CPU_GHZ"):
        return float(os.environ["TFMP_CPU_GHZ"]), "TFMP_CPU_GHZ"
    mhz = _cpuinfo_fields().get("cpu MHz")
    return (float(mhz) / 1000, "/proc/cpuinfo cpu MHz") if mhz else (None, "unknown (set TFMP_CPU_GHZ)")


def cpu_peak(precision: str, cores: int | None = None) -> Peak:
    """This CPU's peak FLOP/s for `precision`, with the formula it came from."""
    fields = _cpuinfo_fields()
    cores = cores or len(os.sched_getaffinity(0))
    per_cycle, units = flops_per_cycle(precision, hardware.cpu_flags(), fields.get("vendor_id", ""),
                                       int(fields.get("cpu family", "0") or 0))
    ghz, source = clock_ghz()
    if ghz is None:
        return Peak(None, f"{cores} cores x ? GHz ({source}) x {per_cycle} FLOP/cycle ({units})")
    peak = cores * ghz * 1e9 * per_cycle
    return Peak(peak, f"{cores} cores x {ghz:.3f} GHz ({source}) x {per_cycle} FLOP/cycle ({units}) = {peak / 1e9:.0f} GFLOP/s")


def utilisation(train_flops_per_example: float, examples_per_second: float | None, precision: str) -> dict:
    """`achieved_gflops_per_second`, `mfu` and `mfu_peak_formula` for metrics.json and the bench."""
    peak = cpu_peak(precision)
    achieved = train_flops_per_example * examples_per_second if examples_per_second else None
    return {
        "train_flops_per_example": int(train_flops_per_example),
        "achieved_gflops_per_second": round(achieved / 1e9, 1) if achieved else None,
        "mfu": round(achieved / peak.flops_per_second, 3) if achieved and peak.flops_per_second else None,
        "mfu_peak_formula": peak.formula,
    }
