"""`python -m tfmp.launch --num_workers=N [tfmp.train flags... | SCRIPT.py [args...]]` — multi-worker training on one machine.

Starts N worker processes on 127.0.0.1, each with free ports, so the run uses TensorFlow's
own multi-worker runtime (`MultiWorkerMirroredStrategy`, gRPC collectives) exactly as it
would across machines:

* by default, `python -m tfmp.train` with its own `--worker_hosts/--task_index` (which
  `tfmp.train` turns into TF_CONFIG). Worker 0 is the chief: it alone writes config.json,
  metrics.json, checkpoints and the encoder to --workdir;
* with a Python file as the first argument, a user's own script (`python SCRIPT.py args`),
  with TF_CONFIG set for it, as `torchrun` or `accelerate launch` do: the script creates
  `tf.distribute.MultiWorkerMirroredStrategy()` (or `tfmp.distribute.get_strategy(
  "multi_worker_mirrored")`) and trains as it would on one machine.

Each worker's output is streamed with a `[worker i]` prefix. If a worker exits with
an error, the others are stopped (they would otherwise wait for it forever), and the
launcher exits with the worst exit code. SIGTERM or Ctrl-C to the launcher (a scheduler's
stop) is passed to every worker as SIGTERM and the launcher waits for them, then exits with
143 or 130: no worker outlives it; launching again resumes from the chief's last checkpoint.
At the end it prints the largest worker's peak resident memory (`ru_maxrss` of the reaped
workers): with one process per worker, that is the most memory any one replica's device needed.
Only loopback addresses are ever used.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import threading
import time

LOOPBACK = "127.0.0.1"


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on the loopback interface."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((LOOPBACK, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _stream(process: subprocess.Popen, prefix: str) -> None:
    for line in process.stdout:
        sys.stdout.write(f"{prefix} {line}")
        sys.stdout.flush()


def exit_code(code: int) -> int:
    """A process's return code as a shell reports it (killed by signal N: 128 + N)."""
    return 128 - code if code < 0 else code


def worker_command(train_args: list[str], hosts: list[str], index: int) -> tuple[list[str], dict]:
    """The command and environment of worker `index`: tfmp.train with cluster flags, or a script with TF_CONFIG."""
    environment = dict(os.environ)
    if train_args and train_args[0].endswith(".py"):
        environment["TF_CONFIG"] = json.dumps({"cluster": {"worker": hosts}, "task": {"type": "worker", "index": index}})
        return [sys.executable, *train_args], environment
    environment.pop("TF_CONFIG", None)  # each worker gets its own from --worker_hosts/--task_index
    return [sys.executable, "-m", "tfmp.train", *train_args, "--strategy=multi_worker_mirrored",
            f"--worker_hosts={','.join(hosts)}", f"--task_index={index}"], environment


def launch(num_workers: int, train_args: list[str], poll_seconds: float = 0.2) -> int:
    """Runs the workers to completion; returns the launcher's exit code."""
    hosts = [f"{LOOPBACK}:{port}" for port in free_ports(num_workers)]
    processes = []
    for index in range(num_workers):
        command, environment = worker_command(train_args, hosts, index)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=environment)
        threading.Thread(target=_stream, args=(process, f"[worker {index}]"), daemon=True).start()
        processes.append(process)

    stopped = set()  # workers the launcher ended: their codes say nothing about the run
    signalled = None  # the signal that stopped the launcher, if one did

    def stop(signum, frame):
        raise _Stopped(signum)

    # Without a handler, SIGTERM would end the launcher alone and leave its workers training, orphaned.
    previous = signal.signal(signal.SIGTERM, stop) if threading.current_thread() is threading.main_thread() else None
    try:
        # Poll every worker each round: `any(p.poll() is None ...)` would stop at the first running one and
        # never notice a later worker that died, leaving the others blocked in a collective (seen in a test run).
        while None in [process.poll() for process in processes]:
            if any(process.returncode not in (None, 0) for process in processes):
                for index, process in enumerate(processes):
                    if process.poll() is None:
                        process.terminate()  # a dead peer would leave them blocked in a collective forever
                        stopped.add(index)
                break
            time.sleep(poll_seconds)
    except (KeyboardInterrupt, _Stopped) as stop_signal:
        signalled = stop_signal.signum if isinstance(stop_signal, _Stopped) else signal.SIGINT
        for process in processes:
            if process.poll() is None:
                process.terminate()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    codes = []
    for process in processes:
        try:
            codes.append(exit_code(process.wait(timeout=60)))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(exit_code(process.wait()))
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # Linux reports KiB
    print(f"tfmp.launch: the largest worker's peak RSS: {peak / 2**30:.2f} GiB ({peak} bytes)", flush=True)
    if signalled is not None:
        return 128 + signalled  # as a shell reports a process the signal ended
    failures = [code for index, code in enumerate(codes) if code and index not in stopped]
    return max(failures or codes)


class _Stopped(Exception):
    """SIGTERM reached the launcher."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tfmp.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--num_workers", type=int, default=2, help="worker processes to start on 127.0.0.1")
    args, train_args = parser.parse_known_args(argv[1:])
    if args.num_workers < 1:
        print(f"tfmp.launch: error: num_workers must be >= 1, got {args.num_workers}", file=sys.stderr)
        return 2
    if train_args and train_args[0].endswith(".py") and not os.path.isfile(train_args[0]):
        print(f"tfmp.launch: error: script {train_args[0]}: no such file", file=sys.stderr)
        return 2
    script = bool(train_args) and train_args[0].endswith(".py")
    bad = [arg for arg in train_args if arg.split("=")[0] in ("--strategy", "--worker_hosts", "--task_index", "--num_cpu_devices")]
    if bad and not script:
        print(f"tfmp.launch: error: {' '.join(bad)} is set by the launcher; remove it", file=sys.stderr)
        return 2
    if not script:  # a bad flag is said once, here, rather than by every worker after TensorFlow has started
        from tfmp import train
        from tfmp.config import UsageError, validate

        command, _ = worker_command(train_args, [f"{LOOPBACK}:0"] * args.num_workers, 0)
        try:  # validated without the note on a setting's previous name: the workers say it
            validate(train.parse(["tfmp.train", *command[3:]])[0])
        except UsageError as error:
            print(f"tfmp.launch: error: {error}", file=sys.stderr)
            return 2
    return launch(args.num_workers, train_args)


if __name__ == "__main__":
    sys.exit(main(sys.argv))
