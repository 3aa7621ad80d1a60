"""How tfmp talks: its own messages through `logging` (logger "tfmp"), in one short format.

* Library use: a user who has not configured logging still sees tfmp's choices once — the
  precision and strategy with their reasons, the checkpoint a run resumed from — because the
  "tfmp" logger logs INFO and, while the root logger has no handler, writes them itself
  ("tfmp: precision: mixed_bfloat16 (...)"). A user who configures logging (`basicConfig`,
  absl) receives the same records through their own handlers instead, never twice.
* Entry points (`configure`): the same short format; the run's narrative (INFO: choices made,
  phases) on stdout beside Keras' epoch lines, warnings and errors on stderr — so an error is
  the one line stderr gets. Python warnings become one "warning: ..." line instead of a
  `UserWarning` with its source line.

TensorFlow-free, so the CLI can use it before TensorFlow loads.
"""

from __future__ import annotations

import logging
import sys
import warnings

LOGGER_NAME = "tfmp"


class _ShortFormatter(logging.Formatter):
    """`message` for INFO, `warning: message` / `error: message` above it."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        return message if record.levelno <= logging.INFO else f"{record.levelname.lower()}: {message}"


_PROBE = logging.LogRecord("probe", logging.WARNING, "", 0, "message", None, None)


def _implicit_basic_config(handler: logging.Handler) -> bool:
    """Whether `handler` is the one absl's `logging.basicConfig()` adds when TensorFlow logs through absl before
    anyone configured logging (its first checkpoint does): stderr, Python's default format."""
    return (type(handler) is logging.StreamHandler and handler.stream is sys.stderr
            and (handler.formatter or logging.Formatter()).format(_PROBE) == "WARNING:probe:message")


class _UntilConfigured(logging.Handler):
    """Writes tfmp's records to stderr while nobody has configured logging: the root logger has no handler, or
    only the default one absl adds by itself mid-run (then tfmp's records stop there, so a run's lines keep
    one format and come once). Once the user configures logging, their handlers get the records instead."""

    def emit(self, record: logging.LogRecord) -> None:
        logger = logging.getLogger(LOGGER_NAME)
        if any(not _implicit_basic_config(handler) for handler in logging.getLogger().handlers):
            logger.propagate = True
            return  # the user's handlers get it by propagation
        logger.propagate = False
        try:
            sys.stderr.write(f"tfmp: {self.format(record)}\n")
        except Exception:  # noqa: BLE001 — logging must never raise into the caller
            self.handleError(record)


class _EntryPointHandler(logging.Handler):
    """The entry points' handler: INFO and below to stdout, WARNING and above to stderr (added once)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stdout if record.levelno <= logging.INFO else sys.stderr
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:  # noqa: BLE001 — logging must never raise into the caller
            self.handleError(record)


_SAID: set[tuple[str, int, str]] = set()


def once(logger: logging.Logger, level: int, message: str, *args) -> None:
    """Logs `message % args` the first time this process says it (a choice repeated by every call that makes it, such
    as the strategy of each `get_strategy`, is a line the first time and noise after)."""
    text = message % args if args else message
    if (logger.name, level, text) not in _SAID:
        _SAID.add((logger.name, level, text))
        logger.log(level, "%s", text)


def install_library_default() -> None:
    """INFO for tfmp's logger, written by `_UntilConfigured` (idempotent; run by `import tfmp`)."""
    logger = logging.getLogger(LOGGER_NAME)
    if not any(isinstance(handler, _UntilConfigured) for handler in logger.handlers):
        handler = _UntilConfigured()
        handler.setFormatter(_ShortFormatter())
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _warning_as_log_line(message, category, filename, lineno, file=None, line=None) -> None:
    logging.getLogger(LOGGER_NAME).warning("%s", message)


# Closures that make one tf.function per model or per group of weights, each traced once (`_KerasStepTracingFilter`).
_ONE_FUNCTION_EACH = ("TensorFlowTrainer._make_function.<locals>",  # Keras: each model's train/test/predict step
                      "whole_weights.<locals>",  # tfmp.sharding.weights: one all-gather per bucket of zero3 weights
                      "_save_through_the_chief.<locals>")  # tfmp.sharding.checkpoint_state: one per bucket of state


class _KerasStepTracingFilter(logging.Filter):
    """Drops TensorFlow's "N out of the last M calls to <function TensorFlowTrainer._make_function.<locals>...>
    triggered tf.function retracing" warning. TensorFlow counts traces per Python code object, and Keras makes every
    model's train, test and predict function from one closure: the first trace of each new model's function (the
    SSL run's probes and baseline draws, each a model of its own) counts as a "retrace" of one function — as does the
    first trace of each bucket's gather in a multi-worker zero3 save (`_ONE_FUNCTION_EACH`). Retraces of one function
    are what costs time; tfmp's own were found and removed, and tests/test_presentation.py checks that no function
    tfmp runs is traced twice. Every other retracing warning is kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not ("triggered tf.function retracing" in message and any(name in message for name in _ONE_FUNCTION_EACH))


def configure(verbose: bool = False) -> None:
    """Logging for tfmp's entry points: one short line per message (INFO to stdout, warnings and
    errors to stderr); other libraries' records at WARNING (INFO too with `verbose`)."""
    root = logging.getLogger()
    if not any(isinstance(handler, _EntryPointHandler) for handler in root.handlers):
        handler = _EntryPointHandler()
        handler.setFormatter(_ShortFormatter())
        root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger(LOGGER_NAME).setLevel(logging.DEBUG if verbose else logging.INFO)
    tensorflow_logger = logging.getLogger("tensorflow")
    if not any(isinstance(existing, _KerasStepTracingFilter) for existing in tensorflow_logger.filters):
        tensorflow_logger.addFilter(_KerasStepTracingFilter())
    warnings.showwarning = _warning_as_log_line
