"""Kill-and-resume soak: `kill -9` or SIGTERM training at random moments, resume with train.resume_from=auto until
done, and check every resumed run against an uninterrupted one, bitwise.

    python scripts/soak_resume.py                 # 20 stops over padded, length_grouped, token_budget, packed, streamed
    python scripts/soak_resume.py --ranks 2       # the same on two gloo ranks (torchrun), one rank killed alone too
    python scripts/soak_resume.py --quick         # 2 kills, one mode, a short run (CI: tests/test_resume.py)

Per mode, an uninterrupted reference run saves a checkpoint every step; its weights (model.safetensors bytes) and
per-step logs (loss, grad_norm, learning rate, label tokens, epoch, skip counter) are the expected values. Then a
chain of runs in a fresh folder, each started with the same command and train.resume_from=auto: once a run has
written a checkpoint of its own, it is stopped: SIGKILL to its process group after a random delay (mid-window,
mid-step, mid-save or between) or just after a checkpoint starts being written (mid-save); SIGTERM after a random delay
(the run must save and exit 143; torchrun: 1); with two ranks, SIGKILL to rank 1 alone (rank 0 must name it and
exit). A stop counts as resumed identically when the run after it started from the newest complete checkpoint and
every checkpoint it wrote (and the final model, if it finished) equals the reference's. Exit code 0 only when all stops
resumed identically.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = {
    "padded": [],
    "length_grouped": ["data.batching=length_grouped"],
    "token_budget": [
        "data.batching=token_budget",
        "data.max_tokens_per_micro_batch=128",
        "train.global_batch_tokens=256",
    ],
    "packed": ["data.batching=packed"],
    "streamed": ["data.streaming=true"],  # one endless pass: its position is skipped again at resume
}
LOGGED = ("step", "loss", "grad_norm", "learning_rate", "window_label_tokens", "epoch", "nonfinite_skipped")
CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")

# what a run stopped by SIGTERM exits with: 143 (128 + SIGTERM, docs/runs.md), or 1, torchrun's own code after its
# ranks saved and exited 143
STOPPED = (143, 1)


def command(mode: str, out: Path, steps: int, rows: int, ranks: int = 1) -> list[str]:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}"]
    return [
        *(launcher if ranks > 1 else [sys.executable]),
        "finetune/train.py",
        "recipe=recipes/debug.yaml",
        f"data.limit={rows}",
        "data.max_length=64",
        f"train.max_steps={steps}",
        "train.save_steps=1",
        "log.wandb_mode=disabled",
        *MODES[mode],
        f"train.output_dir={out}",
        "train.resume_from=auto",
    ]


def fingerprint(folder: Path) -> tuple[str, list]:
    """(sha256 of the weights file, the per-step logs without wall-clock figures)."""
    digest = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    history = json.loads((folder / "trainer_state.json").read_text())["log_history"]
    return digest, [{k: e.get(k) for k in LOGGED} for e in history if "loss" in e and "grad_norm" in e]


def checkpoints(out: Path) -> dict[int, Path]:
    if not out.is_dir():
        return {}
    return {int(m.group(1)): p for p in out.iterdir() if (m := CHECKPOINT.match(p.name))}


@dataclass
class Segment:
    """One run of a chain: what it resumed from, what it wrote, how it ended."""

    resumed_from: str | None = None
    expected_from: str | None = None
    new: dict[int, tuple] = field(default_factory=dict)
    final: tuple | None = None
    kill: str | None = None  # how it was killed; None: it ran to the end


def start(cmd: list[str], log: Path) -> subprocess.Popen:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": "disabled",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    # its own process group: a kill -9 reaches the launcher and every rank at once, as a lost machine does
    return subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True
    )


def rank_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the launcher's children (Linux /proc); torchrun starts each rank in a session of its own."""
    try:
        children = Path(f"/proc/{launcher}/task/{launcher}/children").read_text().split()
    except OSError:
        return {}
    ranks = {}
    for child in children:
        try:
            environ = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ranks.update({int(v[5:]): int(child) for v in environ if v.startswith(b"RANK=")})
    return ranks


def stop(proc: subprocess.Popen, kill: str) -> list[int]:
    """Stop the run the way `kill` names; the pids of its ranks (to wait for: they are not the launcher's group)."""
    ranks = rank_pids(proc.pid)
    if kill == "sigterm":
        os.killpg(proc.pid, signal.SIGTERM)  # as a scheduler or Ctrl-C signals the job: the launcher forwards it
    elif kill == "rank" and 1 in ranks:
        os.kill(ranks[1], signal.SIGKILL)  # one rank dies (the OOM killer); the others must notice and stop
    else:  # the whole machine is lost: every rank and the launcher at once
        for pid in ranks.values():
            os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
    return list(ranks.values())


def wait_gone(pids: list[int]) -> None:
    """Until every pid has ended (a zombie has)."""
    for pid in pids:
        while True:
            try:
                if "zombie" in Path(f"/proc/{pid}/status").read_text():
                    break
            except OSError:
                break
            time.sleep(0.02)


def wait_for(proc: subprocess.Popen, ready, poll: float = 0.005) -> bool:
    """Poll until ready() or the process exits; True if ready."""
    while proc.poll() is None:
        if ready():
            return True
        time.sleep(poll)
    return False


def reference(mode: str, work: Path, steps: int, rows: int, ranks: int) -> tuple[dict[int, tuple], tuple, float]:
    out = work / f"{mode}-reference"
    proc = start(command(mode, out, steps, rows, ranks), work / f"{mode}-reference.log")
    seen: dict[int, float] = {}
    while proc.poll() is None:  # when each checkpoint appears: the step time the random kills are drawn from
        for step in checkpoints(out):
            seen.setdefault(step, time.monotonic())
        time.sleep(0.02)
    if proc.returncode != 0:
        sys.exit(f"reference run for {mode} failed; see {work / f'{mode}-reference.log'}")
    times = sorted(seen.values())
    step_time = (times[-1] - times[0]) / max(len(times) - 1, 1) if len(times) > 1 else 1.0
    expected = {step: fingerprint(path) for step, path in checkpoints(out).items()}
    final = fingerprint(out)
    shutil.rmtree(out)
    return expected, final, step_time


def run_segment(
    cmd: list[str], out: Path, log: Path, kill: str | None, step_time: float, rng: random.Random
) -> Segment:
    before = checkpoints(out)
    segment = Segment(expected_from=str(before[max(before)]) if before else None)
    proc, ranks = start(cmd, log), []
    if kill is not None and wait_for(proc, lambda: set(checkpoints(out)) - set(before)):  # it has made progress
        if kill == "save":
            staging = out / ".staging"
            wait_for(proc, lambda: staging.is_dir() and any(staging.iterdir()))
            delay = rng.uniform(0.0, 0.05)
        else:
            delay = rng.uniform(0.0, 1.5 * step_time)
        time.sleep(delay)
        if proc.poll() is None:
            saving = (out / ".staging").is_dir() and any((out / ".staging").iterdir())
            ranks = stop(proc, kill)
            after = "a save began" if kill == "save" else "its first checkpoint"
            segment.kill = f"{kill} {delay:.2f} s after {after} ({'mid-save' if saving else 'no save under way'})"
    proc.wait()
    wait_gone(ranks)
    if segment.kill is None and proc.returncode != 0:
        sys.exit(f"a resumed run failed (exit {proc.returncode}); see {log}")
    stopped = segment.kill and kill == "sigterm" and "stopped by SIGTERM" in log.read_text()
    if stopped and proc.returncode not in STOPPED:
        sys.exit(f"a run stopped by SIGTERM exited {proc.returncode}; see {log}")
    match = re.search(r"^resuming from (.+)$", log.read_text(), re.M)
    segment.resumed_from = match.group(1).strip() if match else None
    segment.new = {s: fingerprint(p) for s, p in checkpoints(out).items() if s not in before}
    if segment.kill is None:
        segment.final = fingerprint(out)
    return segment


def identical(segment: Segment, expected: dict[int, tuple], final: tuple) -> tuple[bool, str]:
    if segment.resumed_from != segment.expected_from:
        return False, f"resumed from {segment.resumed_from}, newest complete was {segment.expected_from}"
    wrong = [s for s, fp in segment.new.items() if fp != expected.get(s)]
    if wrong:
        return False, f"checkpoint-{wrong[0]} differs from the reference"
    if segment.final is not None and segment.final != final:
        return False, "final model or log differs from the reference"
    wrote = f"checkpoints {min(segment.new)}-{max(segment.new)}" if segment.new else "no checkpoint"
    return True, f"resumed from {Path(segment.resumed_from).name}, wrote {wrote}{', finished' if segment.final else ''}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=None, help="kills in all (default 20; 2 with --quick)")
    parser.add_argument("--modes", default=None, help="comma-separated modes of MODES (default: all five)")
    parser.add_argument("--quick", action="store_true", help="2 kills on one mode, 4 optimizer steps")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1, help="1, or 2 gloo ranks under torchrun")
    parser.add_argument("--work", default=None, help="work folder (default: a temporary one, removed at the end)")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kills = args.kills if args.kills is not None else (2 if args.quick else 20)
    modes = args.modes.split(",") if args.modes else ([rng.choice(list(MODES))] if args.quick else list(MODES))
    steps, rows = (4, 16) if args.quick else (8, 24)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="soak-resume-"))
    work.mkdir(parents=True, exist_ok=True)
    quota = {m: kills // len(modes) + (i < kills % len(modes)) for i, m in enumerate(modes)}
    results: list[tuple[bool, str]] = []
    stops: list[str] = []  # how each run was stopped
    for mode in modes:
        if not quota[mode]:
            continue
        expected, final, step_time = reference(mode, work, steps, rows, args.ranks)
        print(f"[{mode}] reference: {len(expected)} checkpoints, {step_time:.2f} s per step", flush=True)
        chain, left = 0, quota[mode]
        while left:
            chain += 1
            out = work / f"{mode}-chain{chain}"
            cmd, previous, segment_index = command(mode, out, steps, rows, args.ranks), None, 0
            while True:
                segment_index += 1
                kinds = ["random", "random", "save", "sigterm"] + (["rank"] if args.ranks > 1 else [])
                kind = rng.choice(kinds) if left else None
                log = work / f"{mode}-chain{chain}-{segment_index}.log"
                segment = run_segment(cmd, out, log, kind, step_time, rng)
                if previous is not None:  # the kill before this run is judged by what this run did
                    ok, why = identical(segment, expected, final)
                    results.append((ok, f"[{mode}] kill {len(results) + 1}: {previous.kill}; {why}"))
                    print(("identical  " if ok else "DIFFERENT  ") + results[-1][1], flush=True)
                if segment.kill is None:
                    break
                stops.append(kind)
                left -= 1
                previous = segment
            shutil.rmtree(out, ignore_errors=True)
    same = sum(ok for ok, _ in results)
    print(f"{same}/{len(results)} kills resumed identically (bitwise weights and per-step logs)")
    print("stops: " + ", ".join(f"{kind} {n}" for kind, n in sorted(Counter(stops).items())))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if same == len(results) == kills else 1


if __name__ == "__main__":
    sys.exit(main())
