"""What trains: `model.freeze` (module-name prefixes; a frozen module that needs no input gradient runs under
no_grad) and LoRA (`model.lora`, peft; its keys checked against the model by `check_lora`). `matches_prefix` is the
one rule for module-name prefixes, shared with `optim.lr_multipliers`."""

from __future__ import annotations

import threading
import warnings

import torch

from finetune.recipe import ModelConfig, RecipeError, first_line

WRAPPERS = {"model", "base_model", "module", "_orig_mod"}  # names that wrap a whole model (VLMs, peft, DDP, compile)


def matches_prefix(name: str, prefix: str) -> bool:
    """`prefix` names `name` or a module above it, counted from the top or after wrapper names: `vision_tower`
    matches `model.vision_tower.encoder…` (LLaVA), `layers.0` matches `model.layers.0.mlp…` but not
    `model.language_model.layers.0…`."""
    parts, want = name.split("."), prefix.split(".")
    for start in range(len(parts)):
        if parts[start : start + len(want)] == want:
            return True
        if parts[start] not in WRAPPERS:
            return False
    return False


def freeze(model: torch.nn.Module, prefixes: list[str]) -> None:
    for prefix in prefixes:
        matched = [p for n, p in model.named_parameters() if matches_prefix(n, prefix)]
        if not matched:
            raise RecipeError(f"model.freeze: '{prefix}' matches no parameter name; use a module-name prefix")
        for p in matched:
            p.requires_grad_(False)
    top = {n for n, _ in model.named_modules() if any(matches_prefix(n, p) for p in prefixes)}
    for name, module in model.named_modules():
        if name in top and name.rpartition(".")[0] not in top:  # outermost frozen modules only
            hooks = NoGradWhenFrozen()
            module.register_forward_pre_hook(hooks.enter, with_kwargs=True)
            module.register_forward_hook(hooks.leave, with_kwargs=True, always_call=True)


class NoGradWhenFrozen:
    """The forward hooks of one outermost frozen module: fed inputs that need no gradient (a vision tower fed pixels),
    it runs under no_grad, so autograd keeps none of its activations even where something upstream
    (enable_input_require_grads, checkpointing) would. Decided per call: a frozen module between trainable ones still
    passes gradients through."""

    def __init__(self):
        # the threads whose call turned gradients off (grad mode is per thread; DataParallel runs replicas in threads)
        self.turned_off: set[int] = set()

    def enter(self, module, args, kwargs):
        inputs = [*args, *kwargs.values()]
        if (
            torch.is_grad_enabled()
            and not any(p.requires_grad for p in module.parameters())
            and not any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)
        ):
            self.turned_off.add(threading.get_ident())
            torch.set_grad_enabled(False)

    def leave(self, module, args, kwargs, output):
        if threading.get_ident() in self.turned_off:
            self.turned_off.discard(threading.get_ident())
            torch.set_grad_enabled(True)


ALL_LINEAR = "all-linear"  # peft's name for every linear layer but the output head


def lora_targets(target_modules: list[str] | str) -> list[str] | str:
    """What peft's `target_modules` gets: module names, or the string all-linear (alone, or as the only list item)."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules)
    if ALL_LINEAR in names:
        if len(names) > 1:
            raise RecipeError(
                f"model.lora.target_modules={names}: {ALL_LINEAR} already means every linear layer; give it alone "
                "or list module names"
            )
        return ALL_LINEAR
    return names


def not_linear_outputs(model) -> list[str]:
    """The modules that are torch Linear layers by class but return no tensor (PhiMoE's and Llama 4's routers are
    Linear subclasses that return their routing): peft's all-linear would wrap them, and its LoRA layer expects a
    tensor back. Found by calling each model-defined Linear subclass with a forward of its own on one zero row."""
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if not isinstance(module, torch.nn.Linear) or cls.forward is torch.nn.Linear.forward:
            continue
        if not cls.__module__.startswith("transformers.models."):  # quantized layers (bitsandbytes) return tensors
            continue
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):  # a sampling router draws nothing of the run's
                row = module.weight.new_zeros(1, module.in_features)
                returned = module(row)
        except Exception:  # an input it does not take: left to peft as before
            continue
        if not isinstance(returned, torch.Tensor):
            found.append(name)
    return found


def add_lora(model, cfg: ModelConfig):
    from peft import LoraConfig, get_peft_model

    targets = lora_targets(cfg.lora.target_modules)
    lora = LoraConfig(
        r=cfg.lora.r,
        lora_alpha=cfg.lora.alpha,
        lora_dropout=cfg.lora.dropout,
        target_modules=targets,
        exclude_modules=(not_linear_outputs(model) or None) if targets == ALL_LINEAR else None,
        task_type="CAUSAL_LM",
    )
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated name; the run is not affected
            warnings.filterwarnings(
                "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
            )
            return get_peft_model(model, lora)
    except ValueError as e:  # peft's refusals: target modules that match nothing, or that LoRA cannot wrap
        raise RecipeError(f"model.lora.target_modules={targets}: {first_line(e)}") from None


def check_lora(cfg: ModelConfig, folder: str, vision: bool) -> None:
    """model.lora's keys against each other and the model, before anything loads: merge needs LoRA and a base in
    full precision (a merged quantized base would be dequantized weights plus a delta, not the model that trained);
    all-linear is for text models (a VLM's LoRA stays inside its language model, by module names)."""
    lora = cfg.lora
    if cfg.quantization.bits != "none":
        from finetune.model.quantized import check_folder_quantization

        check_folder_quantization(cfg, quantization(folder, cfg.trust_remote_code))
    if lora.merge and not lora.enabled:
        raise RecipeError("model.lora.merge=true needs model.lora.enabled=true (it merges the trained adapter)")
    if vision and lora.enabled and lora_targets(lora.target_modules) == ALL_LINEAR:
        raise RecipeError(
            f"model.lora.target_modules={ALL_LINEAR} is for text models; for a vision-language model list the "
            "language model's module names (e.g. [q_proj, k_proj, v_proj, o_proj])"
        )
    if lora.enabled and lora.merge and (method := quantization(folder, cfg.trust_remote_code)):
        raise RecipeError(
            f"model.lora.merge=true: model.name_or_path={cfg.name_or_path} is quantized ({method}); merging into "
            "quantized weights changes them; set model.lora.merge=false (the adapter is saved) and merge it into "
            "the full-precision base with peft"
        )


def quantization(folder: str, trust_remote_code: bool = False) -> str | None:
    """The quantization method named in a model folder's config.json (bitsandbytes, gptq, awq, …), or None."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None  # loading the model says what is wrong with the folder
    settings = getattr(config, "quantization_config", None)
    if not settings:
        return None
    method = settings.get("quant_method") if isinstance(settings, dict) else getattr(settings, "quant_method", None)
    return str(getattr(method, "value", method) or "quantization_config in config.json")
