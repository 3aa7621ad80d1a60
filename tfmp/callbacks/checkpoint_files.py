"""Checkpoint files on disk: which exist, which read completely, and a `checkpoint` state file repaired.

Checkpoints are found from their index files (`ckpt-<step>.index`), not from the `checkpoint`
state file, which a crash or a bad disk can leave unreadable; each is read completely before
anything is restored, so a damaged one is skipped whole and never restored in part. No Keras here.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile

import tensorflow as tf

logger = logging.getLogger(__name__)

PREFIX = "ckpt"
STATE_FILE = "checkpoint"  # tf.train's name for the file listing a directory's checkpoints
BUILD_CONFIG_FILE = "model_build_config.json"  # the model's Keras build config: a lazily built model is built from it
REPLICAS_FILE = "replicas.json"  # how many replicas wrote the checkpoints: a resume on another count says so
_INDEX = re.compile(rf"^{PREFIX}-(\d+)\.index$")


def find_checkpoints(directory: str) -> list[tuple[int, str]]:
    """(step, path prefix) of every checkpoint whose index file is in `directory`, oldest first."""
    if not os.path.isdir(directory):
        return []
    found = [(int(match.group(1)), os.path.join(directory, f"{PREFIX}-{match.group(1)}"))
             for match in map(_INDEX.match, os.listdir(directory)) if match]
    return sorted(found)


def unreadable_reason(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be read completely, or None when every tensor reads.

    A crash, a full disk or a bad copy can leave a truncated data file behind an intact index,
    a garbage index, an empty file or a missing shard; each fails in its own way."""
    try:
        reader = tf.train.load_checkpoint(path)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as error:  # noqa: BLE001 — OpError, IndexError, DataLossError, ...
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        return f"{type(error).__name__}: {first_line}"[:160]
    return None


def _state_file_readable(directory: str) -> bool:
    try:
        tf.train.get_checkpoint_state(directory)
    except Exception:  # noqa: BLE001 — garbage bytes raise UnicodeDecodeError or a text-proto ParseError
        return False
    return True


def progress(path: str) -> tuple[int, int]:
    """(epochs completed, step) that the checkpoint at `path` records."""
    reader = tf.train.load_checkpoint(path)
    return int(reader.get_tensor("epoch/.ATTRIBUTES/VARIABLE_VALUE")), int(reader.get_tensor("step/.ATTRIBUTES/VARIABLE_VALUE"))


def newest_readable(directory: str) -> tuple[str | None, list[str]]:
    """The newest checkpoint in `directory` that reads completely (or None), and the newer ones skipped, with why."""
    skipped = []
    for _, path in reversed(find_checkpoints(directory)):
        reason = unreadable_reason(path)
        if reason is None:
            return path, skipped
        skipped.append(f"{os.path.basename(path)} ({reason})")
    return None, skipped


def set_aside_unreadable_state_file(directory: str) -> None:
    """An unreadable `checkpoint` state file would stop `tf.train.CheckpointManager`; it is moved to
    `checkpoint.unreadable` (kept for inspection) and rewritten from the index files found."""
    state = os.path.join(directory, STATE_FILE)
    if not os.path.exists(state) or _state_file_readable(directory):
        return
    os.replace(state, f"{state}.unreadable")
    found = [path for _, path in find_checkpoints(directory)]
    if found:
        tf.compat.v1.train.update_checkpoint_state(directory, found[-1], all_model_checkpoint_paths=found)
    logger.warning("checkpoint state file %s was unreadable: moved to %s.unreadable and rebuilt from %d index file(s)",
                   state, STATE_FILE, len(found))


def _write_json(directory: str, name: str, content: dict) -> None:
    """Writes `content` as `directory/name` atomically (a crash leaves the old file or the new one)."""
    descriptor, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
    with os.fdopen(descriptor, "w", encoding="utf-8") as file:
        json.dump(content, file)
    os.replace(temporary, os.path.join(directory, name))


def _read_json(directory: str, name: str) -> dict | None:
    try:
        with open(os.path.join(directory, name), encoding="utf-8") as file:
            content = json.load(file)
    except (OSError, ValueError):
        return None
    return content if isinstance(content, dict) else None


def write_build_config(directory: str, build_config: dict) -> None:
    """Keeps the model's Keras build config (its input shape) beside its checkpoints."""
    _write_json(directory, BUILD_CONFIG_FILE, build_config)


def read_build_config(directory: str) -> dict | None:
    """The build config `write_build_config` kept in `directory`, or None."""
    return _read_json(directory, BUILD_CONFIG_FILE)


def write_replicas(directory: str, replicas: int) -> None:
    """Records how many replicas write the checkpoints in `directory`."""
    _write_json(directory, REPLICAS_FILE, {"replicas": replicas})


def read_replicas(directory: str) -> int | None:
    """The replica count `write_replicas` recorded in `directory`, or None (none recorded, or unreadable)."""
    replicas = (_read_json(directory, REPLICAS_FILE) or {}).get("replicas")
    return replicas if isinstance(replicas, int) else None
