"""The run directory: its layout, and what a rerun finds there.

    WORKDIR/config.json     the resolved config (written before training starts)
    WORKDIR/metrics.json    final figures, flat JSON (written last, atomically)
    WORKDIR/memory_estimate.json   what --dry_run estimated (nothing else is written then)
    WORKDIR/checkpoints/    tf.train checkpoints (see `tfmp.callbacks.Checkpointing`)
    WORKDIR/tensorboard/    TensorBoard scalars

Imports no TensorFlow, so the CLI can answer "already finished" or refuse a
conflicting rerun before TensorFlow starts.
"""

from __future__ import annotations

import json
import os

from tfmp.config import Config, UsageError, load_json, save_json

CONFIG_FILE = "config.json"
METRICS_FILE = "metrics.json"
MEMORY_ESTIMATE_FILE = "memory_estimate.json"


def finished_metrics(config: Config, workdir: str) -> dict | None:
    """What an earlier run in `workdir` left.

    Returns:
        Its metrics when the same config already finished there; None when the
        workdir is new or holds the same config unfinished (to be resumed).

    Raises:
        UsageError: the workdir holds a run with a different config.
    """
    if not workdir:
        raise UsageError("--workdir is required")
    config_path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.exists(config_path):
        return None
    differences = config.differences(load_json(config_path))
    if differences:
        raise UsageError(f"workdir {workdir} holds a run with another config ({'; '.join(differences)}); use a new --workdir")
    metrics_path = os.path.join(workdir, METRICS_FILE)
    if not os.path.exists(metrics_path):
        return None
    with open(metrics_path, encoding="utf-8") as file:
        return json.load(file)


def write_config(config: Config, workdir: str) -> None:
    os.makedirs(workdir, exist_ok=True)
    save_json(config, os.path.join(workdir, CONFIG_FILE))


def write_json(values: dict, workdir: str, file_name: str) -> None:
    """Writes WORKDIR/file_name via a temporary file and a rename, so it is never half-written."""
    os.makedirs(workdir, exist_ok=True)
    path = os.path.join(workdir, file_name)
    temporary = f"{path}.tmp"
    with open(temporary, "w", encoding="utf-8") as file:
        json.dump(values, file, indent=2, sort_keys=True)
        file.write("\n")
    os.replace(temporary, path)


def write_metrics(metrics: dict, workdir: str) -> None:
    write_json(metrics, workdir, METRICS_FILE)
