"""Environment variables TensorFlow reads once, when it loads: set here, before it does.

TensorFlow-free on purpose: tfmp's entry points (`tfmp.train`, `tfmp.bench`, `tfmp.doctor`)
call `prepare()` before anything imports TensorFlow. A variable the user has already set
is never changed.

* `TF_CPP_MIN_LOG_LEVEL=2`: keeps TF's C++ INFO/WARNING chatter out of the terminal.
* `TF_ENABLE_ONEDNN_OPTS=1` on x86-64: TF turns its oneDNN CPU kernels on by default only on
  CPUs with AVX512_VNNI, AVX512_BF16 or AMX. On an AVX2-only AMD EPYC (Zen 3) a float32
  ResNet-18 training step ran 1.5x faster with them (BUILD_NOTES.md, "Machine and versions"),
  and without them TF keeps no CPU allocation statistics, so peak tensor memory cannot be
  measured. On CPUs where oneDNN is TF's default already, setting it changes nothing.
"""

from __future__ import annotations

import os
import platform


def prepare() -> None:
    """Sets tfmp's start-up defaults for TensorFlow, unless the user set them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if platform.machine() in ("x86_64", "AMD64"):
        # Not on Arm: there oneDNN runs through the Arm Compute Library, which tfmp has not measured.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
