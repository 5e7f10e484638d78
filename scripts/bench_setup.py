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
        keys += [*overrides, f"train.output_dir={tempfile.mkdtemp(dir=self.scratch)}"]
        cfg = load_config([f"recipe={RECIPE}", *keys])
        if a.model == "smollm2":  # the pretrained weights, not a random init
            cfg.model.from_config, cfg.model.config_overrides = False, {}
        elif MODELS[a.model] is not None:
            cfg.model.config_overrides = dict(MODELS[a.model])
        return cfg

    def describe(self) -> str:
        o, name = self.model_config(), self.args.model
        model = (
            f"{'SmolLM2-135M-Instruct (pretrained)' if name == 'smollm2' else name + ': random init'}, Llama, "
            f"hidden {o.hidden_size}, {o.num_hidden_layers} layers, {o.num_attention_heads}/"
            f"{o.num_key_value_heads} heads, MLP {o.intermediate_size}, vocabulary {o.vocab_size}"
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
