"""finetune-launch: run a launcher so that a run stopped by a signal exits with its stop code, whatever the launcher.

    finetune-launch torchrun --nproc_per_node=8 finetune/train.py recipe=… train.resume_from=auto

A stopped run saves and exits 128 + the signal (143 after SIGTERM, 130 after SIGINT: "stopped, resume me"), but
torchrun and a multi-process `accelerate launch` exit 1 after their ranks stopped and saved, as after a crash: a
Kubernetes podFailurePolicy or a Slurm script cannot tell a stop from a failure. finetune-launch starts the command
in a session of its own, passes SIGTERM and SIGINT on to that whole process group (a rank dedupes the copy its
launcher forwards), waits for every process under it (it adopts what the launcher leaves: a one-process
`accelerate launch` exits before its training process has saved), then exits with the code the ranks' stop wrote,
else with the command's own (a death by signal N as 128 + N). As a container's PID 1 it catches SIGTERM, which the
kernel would drop for a PID 1 without a handler. Linux; imports nothing heavy.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import tempfile
import time

from finetune.env import STOP_CODE_FILE

USAGE = """usage: finetune-launch COMMAND [ARGS …]
       e.g. finetune-launch torchrun --standalone --nproc_per_node=8 finetune/train.py recipe=recipes/quickstart.yaml

Run COMMAND (torchrun, accelerate launch, python finetune/train.py), pass SIGTERM and SIGINT on to it and everything
it started, and exit with the run's own code: 143 or 130 after a stop that saved (resume with
train.resume_from=auto), 0 when it finished, else what COMMAND exited with."""
FORWARDED = (signal.SIGTERM, signal.SIGINT)
ADOPTED_WAIT_S = 600.0  # how long processes the launcher left behind may take to finish their save


def adopt_orphans() -> None:
    """Become the parent of what the command's processes leave behind (Linux PR_SET_CHILD_SUBREAPER), so their end
    can be waited for."""
    if sys.platform.startswith("linux"):
        pr_set_child_subreaper = 36
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_child_subreaper, 1, 0, 0, 0)


def wait_for_adopted(deadline: float) -> None:
    """Reap every remaining descendant (ranks still saving after their launcher exited) until none is left."""
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.1)


def exit_status(returncode: int) -> int:
    """A child's code as a shell reports it: a death by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def stop_code(path: str) -> int | None:
    with open(path) as written:
        text = written.read().strip()
    return int(text) if text.isdigit() else None


def supervise(command: list[str], stop_file: str) -> int:
    adopt_orphans()
    try:
        child = subprocess.Popen(command, env={**os.environ, STOP_CODE_FILE: stop_file}, start_new_session=True)
    except OSError as error:
        print(f"error: finetune-launch cannot start {command[0]!r}: {error.strerror}", file=sys.stderr)
        return 127

    def forward(signum, frame) -> None:
        try:
            os.killpg(child.pid, signum)
        except ProcessLookupError:  # the group has ended; what it left is still waited for
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    returncode = child.wait()
    wait_for_adopted(time.monotonic() + ADOPTED_WAIT_S)
    return stop_code(stop_file) or exit_status(returncode)


def main(argv: list[str] | None = None) -> int:
    command = sys.argv[1:] if argv is None else argv
    if not command or command[0] in ("-h", "--help"):
        print(USAGE, file=sys.stdout if command else sys.stderr)
        return 0 if command else 2
    descriptor, stop_file = tempfile.mkstemp(prefix="finetune-stop-code-")
    os.close(descriptor)
    try:
        return supervise(command, stop_file)
    finally:
        os.unlink(stop_file)


if __name__ == "__main__":
    sys.exit(main())
