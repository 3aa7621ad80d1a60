"""What this machine has: CPU feature flags, bf16 units, GPUs and their compute capability, TPUs.

One place for hardware probing, read by `tfmp.precision` (what `--precision=auto` picks),
`tfmp.distribute` (what `--strategy=auto` picks) and `tfmp.compilation` (what
`--jit_compile=auto` picks). The CPU and TPU probes read files only; the GPU probe asks
TensorFlow. Tests pretend to be another machine by replacing these functions.
"""

from __future__ import annotations

import functools
import os


@functools.lru_cache(maxsize=None)
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags from /proc/cpuinfo (empty where that file does not exist)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_bf16_units() -> bool:
    """Whether the CPU computes bf16 natively (AVX512_BF16 or AMX); elsewhere oneDNN and Eigen
    emulate bf16 through float32, which is slower than float32 itself."""
    return bool(cpu_flags() & {"avx512_bf16", "amx_bf16"})


def tpu_vm_chips_present() -> bool:
    """Whether this machine is a TPU VM: chips appear as /dev/accel* (v2-v4) or /dev/vfio/N (v5+)."""
    return any(os.path.exists(f"/dev/accel{i}") for i in range(8)) or bool(
        os.path.isdir("/dev/vfio") and [n for n in os.listdir("/dev/vfio") if n.isdigit()]
    )


def tpu_present() -> bool:
    """Whether this process can see a TPU (TPU VM chips, or Colab / GKE TPU variables)."""
    return bool(os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR")) or tpu_vm_chips_present()


def gpu_compute_capabilities() -> list[tuple[int, int]]:
    """The compute capability (major, minor) of each visible GPU."""
    import tensorflow as tf

    capabilities = []
    for gpu in tf.config.list_physical_devices("GPU"):
        details = tf.config.experimental.get_device_details(gpu)
        capabilities.append(tuple(details.get("compute_capability", (0, 0))))
    return capabilities
