"""A run's start and end around the Trainer: the output directory checked before training, what the run starts from,
SIGTERM/SIGINT turned into "stop at the next micro-batch, save the last step, say how to resume" (window_stop.py), a
launcher that would never pass a container's stop on, and the final save landing file by file.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from transformers import TrainerCallback

from finetune.env import STOP_CODE_FILE, is_main_process, launch_kind, world_size
from finetune.model import lora_merge
from finetune.model.files import flush_tree
from finetune.recipe import RecipeError, TrainConfig
from finetune.training import output_dir
from finetune.training.checkpoints import checkpoints_in
from finetune.training.staging import save_staged

# ---- before training ----


def check_writable(run_dir: str) -> None:
    """Fail before training, not at the first save hours later; a folder made for the test is removed again."""
    if not is_main_process():
        return  # one rank probes: several probing one folder could not tell whose folder to remove
    missing = [p for p in [run_dir, *map(str, Path(run_dir).parents)] if not os.path.exists(p)]
    probe = os.path.join(run_dir, f".write-test-{os.getpid()}")
    try:
        os.makedirs(run_dir, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
    except OSError as e:
        raise RecipeError(
            f"train.output_dir={run_dir}: cannot write there ({e.strerror or type(e).__name__}); choose a "
            "writable folder"
        ) from None
    finally:
        with contextlib.suppress(OSError):
            os.remove(probe)
        for folder in missing:  # deepest first
            with contextlib.suppress(OSError):
                os.rmdir(folder)


def check_space(run_dir: str, model: torch.nn.Module) -> None:
    """A checkpoint holds the weights and about two optimizer states per trainable weight (AdamW's moments)."""
    params = list(model.parameters())
    need = sum(p.numel() * p.element_size() for p in params) + sum(p.numel() * 8 for p in params if p.requires_grad)
    # only rank 0 probes the folder (and removes it again), so on other ranks it may not exist yet
    existing = next(p for p in [Path(run_dir), *Path(run_dir).parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if free < need:
        raise RecipeError(
            f"train.output_dir={run_dir}: {free / 2**30:.2f} GiB free, a checkpoint needs about "
            f"{need / 2**30:.2f} GiB; free disk space or choose another train.output_dir"
        )


def start_line(train: TrainConfig, resume: str | None) -> str | None:
    """What the run starts from, when there is something to say."""
    if resume:
        return f"resuming from {resume}"
    found = checkpoints_in(train.output_dir)
    if found and train.resume_from is None:
        return (
            f"note: {train.output_dir} holds checkpoints up to checkpoint-{found[-1][0]}; starting fresh and "
            "overwriting them (train.resume_from=auto continues from the newest)"
        )
    return None


# ---- after training ----


def save_final(trainer, texts: dict[str, str]) -> None:
    """The trained model, trainer_state.json and `texts` ({file name: content}) written whole beside train.output_dir,
    then swapped in as one set (finetune/training/output_dir.py): the folder holds this run's model or the last one's,
    never a mix, whenever the process dies."""
    run_dir = trainer.args.output_dir

    def finish(staged: str) -> None:
        trainer.state.save_to_json(os.path.join(staged, "trainer_state.json"))
        for name, text in texts.items():
            with open(os.path.join(staged, name), "w") as f:
                f.write(text)
        flush_tree(staged)  # on disk before the swap: a power loss never leaves empty files

    def write(staged: str) -> None:
        trainer.save_model(staged)  # every rank: FSDP/ZeRO-3 gather the weights
        if trainer.merge_lora:  # model.lora.merge: the merged model, the adapter in adapter/
            lora_merge.write_merged(trainer, staged)

    staged = output_dir.sibling(run_dir)
    save_staged(trainer, str(staged), "the final model", write, finish)
    if trainer.args.should_save:
        output_dir.swap_in(run_dir, staged)  # a swap killed on the way is finished by the next run (`recover`)
    trainer.accelerator.wait_for_everyone()


def leave_together(trainer) -> None:
    """At the end of a run every rank waits for the others (a rank leaving while its peer is still in a gloo
    collective aborts the peer), then an NCCL process group is destroyed (NCCL warns of an undestroyed group). A gloo
    group is left to the process's end (finetune.env.exit_process): destroyed here, it would be freed with the last
    object holding it (the DDP reducer, the stop agreement's group) when the trainer goes, and a gloo group freed
    right after a collective can deadlock in its destructor."""
    trainer.accelerator.wait_for_everyone()
    if torch.distributed.is_initialized() and torch.distributed.get_backend() == "gloo":
        return
    trainer.end()  # Accelerator.end_training: destroys the default process group where this process created it


# ---- SIGTERM / SIGINT: stop at the next micro-batch, save the last step, say how to resume ----


# a launched rank's parent-death signal (PR_SET_PDEATHSIG): "the launcher is gone", never a second stop request
LAUNCHER_GONE = signal.SIGUSR2
# a stop signal this soon after the first is that stop delivered again, not a second request: a signal to the process
# group reaches the run directly and again through its launcher (torchrun passes SIGTERM on; Ctrl-C reaches all)
SAME_STOP_S = 2.0


class StopRequest:
    """Set by SIGTERM or SIGINT; the trainer stops at the next micro-batch (the window's end under DeepSpeed), saves
    the last optimizer step as a checkpoint and stops; the process then exits 128 + the signal's number (143 for
    SIGTERM, 130 for SIGINT), as a shell reports a process the signal ended: "stopped, resume me".

    A second request stops at once, without saving: SIGINT (Ctrl-C) as KeyboardInterrupt, SIGTERM by its default
    action. A second request is a stop signal more than SAME_STOP_S after the first; the launcher's death
    (LAUNCHER_GONE) is a first request or nothing.
    """

    def __init__(self):
        self.signal_name: str | None = None
        self.signum: int = signal.SIGTERM  # whose code the process exits with; a stop another rank was asked for too
        self._first_at: float | None = None
        self._previous: dict = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        if launch_kind() != "plain":
            self._previous[LAUNCHER_GONE] = signal.signal(LAUNCHER_GONE, self._launcher_gone)
            signal_when_the_launcher_dies()

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self._first_at is not None:
            if time.monotonic() - self._first_at < SAME_STOP_S:
                return  # the same stop, delivered again
            if signum == signal.SIGINT:  # the second request: at once, without saving
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._request(signum, signal.Signals(signum).name)

    def _launcher_gone(self, signum, frame) -> None:
        if self._first_at is None:
            self._request(signal.SIGTERM, "the launcher's exit")

    def _request(self, signum: int, name: str) -> None:
        self._first_at, self.signum, self.signal_name = time.monotonic(), signum, name
        if is_main_process():
            print(
                f"\n{name}: stopping at the next micro-batch, then saving the last optimizer step "
                f"(a second stop signal stops at once, without saving)",
                file=sys.stderr,
                flush=True,
            )

    @property
    def exit_code(self) -> int:
        """What the process exits with after this stop: 128 + the signal's number."""
        return 128 + int(self.signum)

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def join(self) -> None:
        """All ranks agreed on a stop that another rank was asked for: this rank stops and saves with them."""
        if self.signal_name is None:
            self.signal_name = "another rank's stop request"

    @contextlib.contextmanager
    def installed(self):
        main_thread = threading.current_thread() is threading.main_thread()  # signal handlers live there only
        if main_thread:
            self.install()
        try:
            yield self
        finally:
            if main_thread:
                self.uninstall()


def signal_when_the_launcher_dies() -> None:
    """LAUNCHER_GONE to this process when its launcher dies (Linux PR_SET_PDEATHSIG): `accelerate launch` with one
    process exits at once on SIGTERM, and torchrun killed with -9 leaves its ranks behind; they save and stop instead
    of training on unseen. A signal of its own, so that the launcher's death which a stop signal caused is not read
    as a second stop. Only under a launcher: a plain run outlives the shell that started it (nohup)."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(LAUNCHER_GONE), 0, 0, 0)
    if os.getppid() != parent:  # it died before the request: the kernel will not send it
        os.kill(os.getpid(), LAUNCHER_GONE)


# ---- a container's stop: SIGTERM to PID 1 of its PID namespace ----

SIGCGT = "SigCgt:"  # /proc/PID/status: the signals the process catches, a hex mask with bit (signal - 1)


def catches_sigterm(status: str) -> bool:
    """Whether a process with this /proc/PID/status text has a handler for SIGTERM."""
    line = next((line for line in status.splitlines() if line.startswith(SIGCGT)), None)
    return line is None or bool(int(line.removeprefix(SIGCGT).strip(), 16) >> (signal.SIGTERM - 1) & 1)


def container_stop_warning(argv: list[str], proc: str = "/proc") -> str | None:
    """A warning when this process's parent is PID 1 of its PID namespace (a container's first process) and does not
    catch SIGTERM: the kernel then drops a container's stop (docker stop, a pod's termination) before it reaches this
    run, and the SIGKILL after the grace period loses the steps since the last checkpoint. `accelerate launch` with one
    process is such a parent; `argv`: this run's arguments, for the command to run instead."""
    if os.getppid() != 1 or not sys.platform.startswith("linux"):
        return None
    try:
        with open(os.path.join(proc, "1", "status")) as f:
            status = f.read()
        with open(os.path.join(proc, "1", "cmdline"), "rb") as f:
            parent = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return None
    if catches_sigterm(status):
        return None
    instead = shlex.join(["python", sys.argv[0], *argv])
    return (
        f"warning: this run's parent, PID 1 ({parent or 'unknown'}), does not catch SIGTERM: a container's stop "
        "will not reach this run, and the SIGKILL after the grace period loses what was trained since the last "
        f"checkpoint. In a container run `{instead}` (or finetune-train) as its command, or put finetune-launch "
        "before the launcher; `accelerate launch` passes a stop on only with several processes (docs/runs.md)"
    )


class EvaluationStopped(Exception):
    """A stop request ended an evaluation at a batch: it is not logged; RecipeTrainer.evaluate returns no figures and
    the Trainer saves the checkpoint next."""


class StopDuringEvaluation(TrainerCallback):
    """Ends a running evaluation (before its samples) at the next batch when a stop was requested on any rank (all
    ranks agree once per eval batch when there are several), so the checkpoint is written in seconds, not after the
    whole eval set."""

    def __init__(self, stop: StopRequest):
        self.stop = stop

    def on_prediction_step(self, args, state, control, **kwargs):
        requested = self.stop.requested
        if torch.distributed.is_available() and torch.distributed.is_initialized() and world_size() > 1:
            flag = torch.tensor([int(requested)], device=args.device)
            torch.distributed.all_reduce(flag)
            requested = bool(flag.item())
        if requested and state.global_step < state.max_steps:
            self.stop.join()
            control.should_save = control.should_training_stop = True
            raise EvaluationStopped


def stopped_message(stop: StopRequest, trainer, argv: list[str]) -> str:
    step = trainer.state.global_step
    checkpoint = os.path.join(trainer.args.output_dir, f"checkpoint-{step}")
    if not os.path.isdir(checkpoint):  # stopped before a step was trained (the evaluation before step 1): none
        return (
            f"stopped by {stop.signal_name} before optimizer step 1 of {trainer.state.max_steps}; nothing trained, "
            f"no checkpoint written\nstart again with: {resume_command(argv)}"
        )
    return (
        f"stopped by {stop.signal_name} after optimizer step {step} of {trainer.state.max_steps}; checkpoint: "
        f"{checkpoint}\nresume with: {resume_command(argv)}"
    )


def resume_command(argv: list[str]) -> str:
    """The command that was run, with train.resume_from=auto: it continues from the newest checkpoint (under
    finetune-launch where the run was: it set the stop-code file)."""
    args = [a for a in argv if not a.startswith("train.resume_from=")] + ["train.resume_from=auto"]
    wrapper = "finetune-launch " if os.environ.get(STOP_CODE_FILE) else ""
    if world_size() > 1:  # the launcher's own options are not visible to a rank
        launcher = "torchrun" if launch_kind() == "torchrun" else "accelerate launch"
        return f"{wrapper}{launcher} [the same launch options] " + shlex.join([sys.argv[0], *args])
    return wrapper + shlex.join([sys.executable, sys.argv[0], *args])
