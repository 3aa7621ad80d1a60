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

`captured_stderr()` keeps the lines TensorFlow's C++ side prints while it loads and first
lists devices (a banner, twice, then `failed call to cuInit` on a machine without a GPU)
off the terminal: `TF_CPP_MIN_LOG_LEVEL` does not reach them in TF 2.21, since they are
written before absl's logging is initialised. They are captured at the file-descriptor
level (C++ writes to fd 2 directly) and shown with `--verbose`, or when loading fails.
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
import tempfile


def prepare() -> None:
    """Sets tfmp's start-up defaults for TensorFlow, unless the user set them."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if platform.machine() in ("x86_64", "AMD64"):
        # Not on Arm: there oneDNN runs through the Arm Compute Library, which tfmp has not measured.
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")


@contextlib.contextmanager
def captured_stderr(show: bool = False):
    """Sends everything written to stderr (fd 2) inside the block to a temporary file: TensorFlow's C++ start-up
    lines, or what a C library prints by itself (libjpeg's "Improper call to JPEG library" on a bad file).

    The captured text is written to the real stderr afterwards when `show` is set or the block
    raised; the yielded list receives it either way (one string).
    """
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 2)
        failed = False
        try:
            yield captured
        except BaseException:
            failed = True
            raise
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read().decode("utf-8", "replace"))
            if (show or failed) and captured[0]:
                sys.stderr.write(captured[0])
                sys.stderr.flush()


def load_tensorflow(verbose: bool = False):
    """Imports TensorFlow and discovers its devices with their start-up lines captured (`captured_stderr`);
    the entry points call this before anything else imports TensorFlow. Returns the module."""
    with captured_stderr(show=verbose):
        import tensorflow as tf

        tf.config.list_physical_devices()  # device discovery prints the rest (cuInit on machines without a GPU)
    return tf
