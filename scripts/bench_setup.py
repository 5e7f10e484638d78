"""What every arm of scripts/benchmark.py shares: the options, the recipe, the data, the token budget, the models."""

from __future__ import annotations

import dataclasses
import math
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "bench.yaml"
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
# config_overrides on SmolLM2-135M's config (SmolLM2's vocabulary, tied embedding, head_dim 64); None: the recipe's
MODELS = {
    "bench": None,
    "tiny": TINY,
    "0.5b": dict(
        hidden_size=1280, intermediate_size=3584, num_hidden_layers=24, num_attention_heads=20, num_key_value_heads=4
    ),
    "smollm2-135m": {},
    "smollm2": {},  # pretrained weights
    "qwen3-moe": {},  # MIXTURES: a config of its own, SmolLM2's tokenizer
    "tiny-moe": {},
}
# Qwen3-MoE-shaped mixtures of experts with the router balancing loss on (Qwen3-MoE's coefficient), built from these
# configs with SmolLM2's tokenizer in the run's folder: qwen3-moe 0.7B parameters, 0.1B of them per token (12 layers,
# hidden 1,024, 32 experts of 512, 4 per token); tiny-moe for tests
MOE_LAYERS = dict(output_router_logits=True, router_aux_loss_coef=0.001, num_key_value_heads=4, head_dim=64)
MIXTURES = {
    "qwen3-moe": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=12,
        num_attention_heads=16,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=512,
        **MOE_LAYERS,
    ),
    "tiny-moe": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        **{**MOE_LAYERS, "num_key_value_heads": 2, "head_dim": 16},
    ),
}
AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Bench:
    """The options, the recipe, the data, the token budget; `scratch` is the run's folder (shared by its arms'
    processes)."""

    def __init__(self, args, scratch: str):
        from finetune.data.text import load_sft_dataset
        from finetune.model.loading import load_tokenizer, model_folder

        self.args, self.scratch = args, scratch
        self.cfg = self.config([])
        self.micro, self.accumulation = args.micro_batch, args.accumulation
        self.tokenizer = load_tokenizer(self.cfg.model, model_folder(self.cfg.model))
        self.dataset, self.report = load_sft_dataset(self.cfg.data, self.tokenizer)
        lengths = [len(ids) for ids in self.dataset["input_ids"]]
        self.mean_length = sum(lengths) / len(lengths)  # the attention term of MFU
        self.budget = max(round(mean_padded_tokens(lengths, self.micro)), self.cfg.data.max_length)
        self.steps = args.warmup + args.steps

    @property
    def hand_batches_path(self) -> Path:
        """Where hf_padded's process leaves the micro-batches it trained on, for hand_loop's to replay."""
        return Path(self.scratch) / "hf_padded_batches.pt"

    def config(self, overrides: list[str]):
        """recipes/bench.yaml with the data options, `overrides` and the model of --model."""
        from finetune.recipe import load_config

        a = self.args
        keys = [f"train.micro_batch_size={a.micro_batch}", f"train.global_batch_size={a.micro_batch * a.accumulation}"]
        keys += [f"data.limit={a.limit}"] if a.limit else []
        keys += [f"data.max_length={a.max_length}"] if a.max_length else []
        keys += [f"train.precision={a.precision}"]
        keys += [f"model.name_or_path={a.model_folder}", "model.gguf_file=null"] if a.model_folder else []
        if a.model in MIXTURES:
            keys += [f"model.name_or_path={self.mixture_folder(load_config([f'recipe={RECIPE}', *keys]))}"]
            keys += ["model.gguf_file=null"]
        keys += [*overrides, f"train.output_dir={tempfile.mkdtemp(dir=self.scratch)}"]
        cfg = load_config([f"recipe={RECIPE}", *keys])
        if a.model == "smollm2":  # the pretrained weights, not a random init
            cfg.model.from_config, cfg.model.config_overrides = False, {}
        elif MODELS[a.model] is not None:
            cfg.model.config_overrides = dict(MODELS[a.model])
        return cfg

    def mixture_folder(self, smollm2) -> Path:
        """The --model mixture of experts' config (MIXTURES) and SmolLM2's tokenizer, as a hub model's folder, in the
        run's folder (made once: the arms' processes read it)."""
        from transformers import AutoConfig, AutoTokenizer

        from finetune.model.loading import model_folder

        folder = Path(self.scratch) / self.args.model
        if not (folder / "config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(model_folder(smollm2.model))
            ids = {f"{k}_token_id": getattr(tokenizer, f"{k}_token_id") for k in ("pad", "bos", "eos")}
            config = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), **ids, **MIXTURES[self.args.model])
            config.save_pretrained(folder)
            tokenizer.save_pretrained(folder)
        return folder

    def describe(self) -> str:
        o, name = self.model_config(), self.args.model
        experts = (
            f", {o.num_experts} experts of {o.moe_intermediate_size}, {o.num_experts_per_tok} per token, router loss "
            f"×{o.router_aux_loss_coef:g}"
            if name in MIXTURES
            else ""
        )
        model = (
            f"{'SmolLM2-135M-Instruct (pretrained)' if name == 'smollm2' else name + ': random init'}, "
            f"{o.model_type}, hidden {o.hidden_size}, {o.num_hidden_layers} layers, {o.num_attention_heads}/"
            f"{o.num_key_value_heads} heads, MLP {o.intermediate_size}{experts}, vocabulary {o.vocab_size}"
        )
        device = (
            f"CUDA {torch.cuda.get_device_name()}"
            if torch.cuda.is_available()
            else f"CPU, {torch.get_num_threads()} thread(s)"
        )
        return (
            f"data: {self.report.summary()}\nmodel: {model}; {self.args.precision}; {device}\n"
            f"batch: micro {self.micro} × "
            f"accumulation {self.accumulation}; token budget {self.budget} computed tokens per micro-batch (the "
            f"mean of a random padded one), {self.budget * self.accumulation} per step; packed: {self.args.packed}"
            f"\n{self.args.warmup} warm-up + {self.args.steps} timed optimizer steps per arm, {self.args.rounds} "
            f"round(s), each arm in its own process"
        )

    def model_config(self):
        """The transformers config every arm's model is built from."""
        from transformers import AutoConfig

        from finetune.model.loading import model_folder

        config = AutoConfig.from_pretrained(model_folder(self.cfg.model))
        for key, value in (self.cfg.model.config_overrides if self.cfg.model.from_config else {}).items():
            setattr(config, key, value)
        return config

    def new_model(self, attention: str | None = None, bf16_weights: bool = False):
        """The peers' model: the same seed and config as ours, built by finetune's loader with `attention` (None: the
        recipe's sdpa). bf16_weights: built in bfloat16, as transformers' from_pretrained gives a user with a bf16
        checkpoint (TRL loads float32 unless model_init_kwargs names a dtype; we build from a config, so we say it)."""
        from transformers import set_seed

        from finetune.model.loading import load_model, model_folder

        set_seed(self.cfg.train.seed)  # as build() does: the same initial weights in every arm
        changes = {"attn_implementation": attention} if attention else {}
        changes |= {"dtype": "bfloat16"} if bf16_weights else {}
        return load_model(dataclasses.replace(self.cfg.model, **changes), model_folder(self.cfg.model))

    def trainer_arguments(self, cuda: bool) -> dict:
        """What every Trainer-based arm (transformers' and TRL's) is given."""
        t, precision = self.cfg.train, self.args.precision
        return dict(
            output_dir=t.output_dir,
            per_device_train_batch_size=self.micro,
            gradient_accumulation_steps=self.accumulation,
            max_steps=self.steps,
            learning_rate=self.cfg.optim.lr,
            max_grad_norm=t.max_grad_norm,
            seed=t.seed,
            bf16=precision == "bf16",
            fp16=precision == "fp16",
            report_to=[],
            save_strategy="no",
            logging_steps=10**6,
            use_cpu=not cuda,
        )


def mean_padded_tokens(lengths: list[int], micro: int) -> float:
    """Expected micro × longest of `micro` rows drawn at random without replacement (exact, by order statistics)."""
    ordered, total = sorted(lengths), math.comb(len(lengths), micro)
    return micro * sum(length * math.comb(k, micro - 1) for k, length in enumerate(ordered)) / total
