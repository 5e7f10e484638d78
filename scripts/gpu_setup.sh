# On the GPU machine, sourced before scripts/gpu_check.py:   source scripts/gpu_setup.sh .carry
# Installs DIR/wheels (scripts/gpu_carry.py) over the image's own CUDA torch into /tmp/site (once per machine),
# puts /tmp/site and the repository on PYTHONPATH, and prints the versions the run uses.
carry_dir=${1:-.carry}
site=/tmp/site
if [ -d "$carry_dir/wheels" ] && [ ! -f "$site/.installed" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        "$carry_dir"/wheels/*.whl && touch "$site/.installed" || { echo "gpu_setup: installing the wheels failed"; return 1; }
fi
if [ ! -f "$site/.installed" ]; then  # a fresh machine: what an earlier call installed is gone
    echo "gpu_setup: no $carry_dir/wheels here and none installed on this machine (a fresh one): carry $carry_dir/wheels"
    return 1
fi
export PYTHONPATH="$site:$PWD" WANDB_MODE=disabled HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
python3 - <<'PY'
import importlib.metadata as m, importlib.util as u, torch
names = ("transformers", "accelerate", "datasets", "peft", "trl", "liger_kernel", "triton", "huggingface_hub", "tokenizers",
         "pyarrow", "fsspec")
found = [f"{n} {m.version(n) if u.find_spec(n) else 'absent'}" for n in names] + ["deepspeed " + (m.version("deepspeed") if u.find_spec("deepspeed") else "absent")]
print(f"gpu_setup: torch {torch.__version__} ({torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}); "
      + ", ".join(found))
PY
