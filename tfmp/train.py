"""`python -m tfmp.train --flagfile=experiments/X.cfg --workdir=runs/a` — the command line.

Intentionally thin: parse flags into a `Config` and call `tfmp.training.run`.
Exit codes: 0 done (or already finished); 2 usage or input error, as one line on
stderr with nothing written; 1 training failed, with a diagnosis; 143 stopped by
SIGTERM after checkpointing the current step, 130 the same for Ctrl-C (rerun the same command
to resume).
"""

from __future__ import annotations

import os
import sys

from tfmp import tf_environment

tf_environment.prepare()  # before TensorFlow loads: log level, oneDNN kernels

from absl import flags  # noqa: E402

from tfmp import config as tfmp_config  # noqa: E402
from tfmp import logs, report  # noqa: E402
from tfmp.run_directory import check_before_run  # noqa: E402

FLAGS = flags.FlagValues()
tfmp_config.define_flags(FLAGS)
flags.DEFINE_string("workdir", "", "Run directory: config.json, metrics.json, checkpoints/, tensorboard/.", flag_values=FLAGS)

PROGRAM = "tfmp.train"
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT (Ctrl-C); a stop by SIGTERM exits 143 = 128 + SIGTERM, as a shell reports it


def _fail(message: str, code: int) -> int:
    print(f"{PROGRAM}: error: {message}", file=sys.stderr)
    return code


def parse(argv: list[str]) -> tuple[tfmp_config.Config, str]:
    """The config and workdir `argv` (program name first) spells, not yet validated; raises UsageError (one line) on
    a flag that is unknown or malformed. Imports no TensorFlow (`tfmp.launch` checks its workers' flags with it)."""
    try:
        leftover = FLAGS(argv)
    except flags.Error as error:
        raise tfmp_config.UsageError(tfmp_config.flag_error_message(error)) from None
    try:
        if len(leftover) > 1:
            raise tfmp_config.UsageError(f"unexpected arguments {' '.join(leftover[1:])}; flags take the form --name=value")
        return tfmp_config.from_flags(FLAGS), FLAGS.workdir
    finally:
        FLAGS.unparse_flags()  # so main() can be called again in one process (tests)


def main(argv: list[str]) -> int:
    """Runs the CLI on `argv` (program name first) and returns the exit code."""
    logs.configure()  # first: absl's own logging.info would otherwise install Python's default format
    if any(arg in ("-h", "--help", "--helpfull") for arg in argv[1:]):
        print(f"usage: python -m {PROGRAM} [--flagfile=FILE] [--name=value ...]\n\n{FLAGS.get_help()}")
        return 0
    try:
        # Input checks that need no TensorFlow run first: its start-up lines would
        # otherwise bury the one-line error (check_before_run validates, and notes a setting's previous name).
        checked = check_before_run(*parse(argv))
    except tfmp_config.UsageError as error:
        return _fail(str(error), 2)
    config, directory, finished = checked
    if finished is not None:
        print(f"already finished: {directory.metrics_file} (nothing to do)")
        return 0

    logs.configure(verbose=config.verbose)
    try:
        # TensorFlow's C++ start-up lines go to fd 2 before its logging is set up; kept off the
        # terminal (shown with --verbose, or if loading fails) so the lines below are tfmp's.
        tf_environment.load_tensorflow(verbose=config.verbose)
        from tfmp import training
        from tfmp.callbacks import Preempted
    except KeyboardInterrupt:
        return _fail("interrupted (Ctrl-C) before training started", INTERRUPTED_EXIT_CODE)
    try:
        metrics = training.run(config, directory, checked=checked)
    except tfmp_config.UsageError as error:
        return _fail(str(error), 2)
    except training.TrainingFailed as error:
        return _fail(f"training failed: {error}", 1)
    except Preempted as stopped:  # its one line is logged already (tfmp.callbacks.preemption)
        return stopped.code
    except KeyboardInterrupt:  # Ctrl-C outside a training step (loading data, tracing, evaluating)
        return _fail("interrupted (Ctrl-C); rerun the same command to resume from the last checkpoint", INTERRUPTED_EXIT_CODE)
    if config.dry_run:
        print(f"dry run: {directory.memory_estimate_file}")
        return 0
    print(report.summary_table(metrics))
    drawn = f", {directory.summary_png_file}" if os.path.exists(directory.summary_png_file) else ""
    print(f"done: {directory.metrics_file}{drawn}")
    return 0


def run_cli() -> None:
    """Console-script entry point (`tfmp-train`)."""
    sys.exit(main(sys.argv))


if __name__ == "__main__":
    run_cli()
