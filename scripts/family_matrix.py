"""The family matrix (docs/models.md): `finetune.verify` on a tiny random model of each decoder family, padded, packed.

    OMP_NUM_THREADS=1 python scripts/family_matrix.py [--families llama,qwen3] [--output docs/models.md]

Each case is tests/test_families.py's: the family's tiny config from finetune/testing/families.py and SmolLM2's
tokenizer (the debug recipe's) in a temporary folder, the debug recipe's one optimizer step (16 rows of at most 64
tokens) checked against the float64 brute force, in this process through `finetune.tools.verify.main`. A cell is PASS
or FAIL with the largest relative error and its tolerance (from verify's last line), `refused` with the reason of its
one `error:` line, or the exception of a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from finetune.testing.families import (
    ADAPTERS,
    FAMILIES,
    RECIPE_KEYS,
    VOCAB,
    family_folder,
    two_rank_batching,
    verify_argv,
)

ROOT = Path(__file__).resolve().parent.parent

BATCHINGS = ("padded", "length_grouped", "packed")
TWO_RANKS = "two ranks"
VERDICT = re.compile(r"^verify: (PASS|FAIL): largest relative error (\S+) \(tolerance (\S+)\)", re.MULTILINE)
STATE = re.compile(r"would carry the state of its (.+?) layers")
CROSSING = re.compile(r"does not keep the sequences of a packed row apart: .*\(they attend to one another\)")
CANNOT_RUN = re.compile(r"does not keep the sequences of a packed row apart: the packed probe row cannot run")
# verify's line for modules that draw at random in training mode (finetune/testing/determinism.py), and per family
# the classes it named, as the cases ran: the notes column says so
EVALUATED = re.compile(r"^verify: (.+?) \(.*\) gives a different output for the same input in training mode", re.M)
RANDOM_IN_TRAINING: dict[str, str] = {}
COMMAND = "OMP_NUM_THREADS=1 .venv/bin/python scripts/family_matrix.py"


def outcome(code: int, out: str, err: str) -> str:
    """The cell for one verify run: its verdict and figures, a refusal's reason, or the error it ended with."""
    if (verdict := VERDICT.search(out)) is not None:
        word, error, tolerance = verdict.groups()
        return f"{word} {error} (tolerance {tolerance})"
    errors = [line.removeprefix("error: ") for line in err.splitlines() if line.startswith("error: ")]
    if code == 2 and errors:
        state = STATE.search(errors[0])
        reason = f"state of its {state.group(1)} layers would cross sequences" if state else errors[0][:120]
        if CROSSING.search(errors[0]):
            reason = "its attention lets a packed row's sequences see one another (the packed probe)"
        elif CANNOT_RUN.search(errors[0]):
            reason = "its attention cannot run a packed row (the packed probe)"
        return f"refused: {reason}"
    lines = [line for line in err.strip().splitlines() if line and not line.startswith(" ")]
    last = next((line for line in reversed(lines) if "Error" in line or "error" in line), "no verdict printed")
    return f"error (exit {code}): {last[:160]}"


def debug_tokenizer():
    """SmolLM2's tokenizer, as the debug recipe loads it (its GGUF converted once into the cache)."""
    from finetune.model.loading import load_tokenizer, model_folder
    from finetune.recipe import load_config

    model = load_config([f"recipe={ROOT / 'recipes' / 'debug.yaml'}"]).model
    return load_tokenizer(model, model_folder(model))


def run_case(family: str, batching: str, tokenizer, keys: tuple[str, ...] = ()) -> tuple[str, float]:
    """(the cell, seconds) for one family and batching (and recipe `keys`), verify run in this process on a fresh
    tiny model."""
    from finetune.tools import verify

    out, err = io.StringIO(), io.StringIO()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="family-matrix-") as scratch:
        folder = family_folder(Path(scratch), family, tokenizer)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = verify.main([*verify_argv(folder, family, batching), *keys])
            except Exception as e:  # the boundary keeps a bug's traceback; anything past it is still one cell
                code, err = 70, io.StringIO(f"{type(e).__name__}: {e}")
    if found := EVALUATED.search(out.getvalue()):
        RANDOM_IN_TRAINING[family] = found.group(1)
    return outcome(code, out.getvalue(), err.getvalue()), time.perf_counter() - start


def run_two_ranks(family: str, tokenizer) -> tuple[str, float]:
    """(the cell, seconds) for the family on two CPU ranks under `accelerate launch` (packed rows where the family
    packs, else padded): the window gathered from both ranks against the float64 brute force."""
    batching = two_rank_batching(family)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="family-matrix-") as scratch:
        folder = family_folder(Path(scratch), family, tokenizer)
        launch = [str(Path(sys.executable).parent / "accelerate"), "launch", "--multi_gpu", "--num_processes", "2"]
        environ = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        command = [*launch, "-m", "finetune.verify", *verify_argv(folder, family, batching)]
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=environ)
    cell = outcome(result.returncode, result.stdout, result.stderr)
    return f"{batching}: {cell}", time.perf_counter() - start


def notes(family: str) -> str:
    """What the family's tiny model exercises beyond a plain decoder, from its config kwargs and model class."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from finetune.core.router_balance import config_router_loss
    from finetune.core.router_weight import config_coefficient

    kwargs, found = FAMILIES[family], []
    if any("expert" in key for key in str(kwargs).split("'")):  # DBRX's sit in its ffn_config
        fixed = {k: v for k, v in kwargs.items() if v is not VOCAB}
        config = AutoConfig.for_model(family, num_hidden_layers=2, **fixed)
        router = config_router_loss(config) and config_coefficient(config, config.get_text_config())
        found.append(f"experts, router loss ×{router:g}" if router else "experts (no router loss in the family)")
    if "sliding_window" in kwargs:
        found.append(f"sliding window {kwargs['sliding_window']}")
    if not getattr(getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[family]), "_supports_sdpa", True):
        found.append("eager attention (no sdpa in its class; `model.attn_implementation=auto` picks eager)")
    if family in RANDOM_IN_TRAINING:
        found.append(f"{RANDOM_IN_TRAINING[family]} draws at random in training: verify runs it in evaluation mode")
    found += [f"`{key}`" for key in RECIPE_KEYS.get(family, [])]
    return "; ".join(found)


def shell(*command: str) -> str:
    try:
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def header() -> str:
    import torch
    import transformers

    return (
        "# Model families\n\n"
        "Generated by `scripts/family_matrix.py`; do not edit by hand. Each decoder family of the installed "
        "transformers, as a tiny random model (finetune/testing/families.py: hidden 64, 2 layers, 4 heads, SmolLM2's "
        "tokenizer), trained one optimizer step of recipes/debug.yaml (16 rows of at most 64 tokens, micro-batch 4 × "
        "accumulation 2) through `finetune.verify`, which compares the applied gradient with the float64 brute force "
        "(each sequence alone, unpadded; docs/exactness.md), with padded, length-grouped and packed rows in one "
        "process, and on two CPU ranks under `accelerate launch` (packed rows where the family packs, else padded: "
        "the window gathered from both ranks), and with LoRA on every linear layer and QLoRA (the same over a 4-bit "
        "NF4 base, the reference over the dequantized base; peft also adapts a mixture of experts' fused expert "
        "weights and router, which bitsandbytes leaves unquantized) on the same rows as two ranks. A cell gives "
        "verify's verdict with the largest relative error and the tolerance it was held to, or `refused` with the "
        "reason of its one `error:` line: packed rows are refused for models whose layers carry state along the "
        "sequence (finetune/model/sequence_mixers.py), and for models whose attention lets a packed row's sequences "
        "see one another (the packed probe, finetune/model/packed_probe.py); `data.batching=token_budget` or `padded` "
        "is exact for them. "
        "Mixtures of experts run with their router balancing loss on where the family has one. Each step is checked "
        "deterministic: verify switches every dropout off, and a module that draws at random in training mode runs "
        "in evaluation mode for the check (named in the notes). "
        "tests/test_families.py asserts the same outcomes. Seconds: "
        "each case's wall time, one after another (the first includes the imports; a two-rank case includes its "
        "launch).\n\n"
        f"Measured {shell('date', '-u', '+%F')} at commit `{shell('git', 'rev-parse', '--short', 'HEAD')}` on "
        f"{cpu_name()} (OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}), transformers "
        f"{transformers.__version__}, torch {torch.__version__}, Python {platform.python_version()}. Regenerate "
        f"with:\n\n    {COMMAND}\n"
    )


def table(results: dict[str, dict[str, tuple[str, float]]]) -> str:
    columns = (*BATCHINGS, TWO_RANKS, *ADAPTERS)
    lines = [
        f"| family | {' | '.join(columns)} | seconds ({' / '.join(columns)}) | notes |",
        "| --- " * (len(columns) + 3) + "|",
    ]
    for family, cells in results.items():
        seconds = " / ".join(f"{cells[c][1]:.1f}" for c in columns)
        verdicts = " | ".join(cells[c][0] for c in columns)
        lines.append(f"| `{family}` | {verdicts} | {seconds} | {notes(family)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated model types (default: all)")
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "models.md")
    args = parser.parse_args(argv)
    for key, value in (("HF_HUB_OFFLINE", "1"), ("WANDB_MODE", "disabled"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(key, value)
    os.chdir(ROOT)  # the recipe's path is the repository's
    results, tokenizer = {}, debug_tokenizer()
    for family in args.families.split(","):
        results[family] = {}
        for batching in BATCHINGS:
            cell, seconds = results[family][batching] = run_case(family, batching, tokenizer)
            print(f"{family:<18} {batching:<14} {seconds:5.1f} s  {cell}", flush=True)
        cell, seconds = results[family][TWO_RANKS] = run_two_ranks(family, tokenizer)
        print(f"{family:<18} {TWO_RANKS:<14} {seconds:5.1f} s  {cell}", flush=True)
        for adapter, keys in ADAPTERS.items():
            batching = two_rank_batching(family)
            cell, seconds = run_case(family, batching, tokenizer, tuple(keys))
            results[family][adapter] = f"{batching}: {cell}", seconds
            print(f"{family:<18} {adapter:<14} {seconds:5.1f} s  {cell}", flush=True)
    args.output.write_text(header() + "\n" + table(results))
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
