"""One arm of scripts/benchmark.py, trained in this process: ours (finetune.assemble.build), transformers.Trainer,
TRL's SFTTrainer, or the hand-written loop. Each returns its Clock and what else it measured."""

from __future__ import annotations

import contextlib
import io

import torch
from bench_arms import AFTER_LIGER, Arm
from bench_measure import Clock, Recording
from bench_setup import AUTOCAST, Bench


def run(bench: Bench, arm: Arm, accumulation: int | None = None, steps: int | None = None) -> tuple[Clock, dict]:
    cuda = torch.cuda.is_available()
    if arm.family == "ours":
        return run_ours(bench, arm, accumulation or bench.accumulation, steps or bench.steps, cuda)
    if arm.family == "hand":
        return run_hand_loop(bench, cuda)
    if arm.family == "trl":
        return run_trl(bench, arm, cuda)
    return run_trainer(bench, arm, cuda)


def weights_dtype(model) -> dict:
    """What the arm trained: the dtype of its weights, as built (a check on `+bf16w`)."""
    return {"weights_dtype": str(next(model.parameters()).dtype).removeprefix("torch.")}


def run_ours(bench: Bench, arm: Arm, accumulation: int, steps: int, cuda: bool) -> tuple[Clock, dict]:
    from finetune.assemble import build

    if arm.base == AFTER_LIGER:  # what a user who imported Liger for another model gets: its patches, then ours
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    batching = "packed" if arm.base == AFTER_LIGER else arm.base
    keys = [f"train.max_steps={steps}", "log.wandb_mode=disabled", "train.save_steps=0", f"data.batching={batching}"]
    keys += ["model.dtype=bfloat16"] if arm.bf16_weights else []
    keys += ["train.moe_balance=window"] if arm.window_balance else []
    if batching == "token_budget" or (batching == "packed" and bench.args.packed == "budget"):
        keys += [
            f"data.max_tokens_per_micro_batch={bench.budget}",
            f"train.global_batch_tokens={bench.budget * accumulation}",
        ]
    else:
        keys += [f"train.global_batch_size={bench.micro * accumulation}"]
    with contextlib.redirect_stdout(io.StringIO()):  # build's start-up lines
        trainer = build(bench.config(keys))
    clock = Clock(cuda)
    clock.attach(trainer)
    trainer.train()
    # what accumulating must keep between micro-batches: one gradient per trainable parameter
    trainable = [p for p in trainer.model.parameters() if p.requires_grad]
    return clock, {"gradient_mb": sum(p.numel() * p.element_size() for p in trainable) / 2**20} | weights_dtype(
        trainer.model
    )


def run_trainer(bench: Bench, arm: Arm, cuda: bool) -> tuple[Clock, dict]:
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithFlattening, Trainer, TrainingArguments

    if arm.base == "hf_padded":
        collator = DataCollatorForSeq2Seq(bench.tokenizer, label_pad_token_id=-100, return_tensors="pt")
    else:  # with flash attention, the collator hands the varlen kernel cu_seqlens (no re-derivation per layer)
        collator = DataCollatorWithFlattening(return_flash_attn_kwargs=arm.attention == "flash_attention_2")
    recording = arm.name == "hf_padded" and not bench.hand_batches_path.exists()
    if recording:  # what hand_loop replays, kept on the host by the collator (no sync in the measured steps)
        collator = Recording(collator)
    args = TrainingArguments(**bench.trainer_arguments(cuda), use_liger_kernel=arm.liger)
    model = bench.new_model(arm.attention, arm.bf16_weights)
    trainer = Trainer(model=model, args=args, train_dataset=bench.dataset, data_collator=collator)
    clock = Clock(cuda)
    clock.attach(trainer)
    trainer.train()
    if recording:
        torch.save(collator.batches, bench.hand_batches_path)
    return clock, weights_dtype(model)


def run_trl(bench: Bench, arm: Arm, cuda: bool) -> tuple[Clock, dict]:
    """TRL's SFTTrainer with its default loss on our tokenized rows (its own labels column: the same loss mask)."""
    from trl import SFTConfig, SFTTrainer

    args = bench.trainer_arguments(cuda) | dict(use_liger_kernel=arm.liger)
    if arm.base == "trl_packing":  # one best-fit-decreasing row of the token budget per micro-batch
        args |= dict(per_device_train_batch_size=1, packing=True, max_length=bench.budget)
    else:
        args |= dict(padding_free=True, max_length=None)
    rows = bench.dataset.select_columns(["input_ids", "labels"])
    model = bench.new_model(arm.attention, arm.bf16_weights)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = SFTTrainer(model=model, args=SFTConfig(**args), train_dataset=rows, processing_class=bench.tokenizer)
    clock = Clock(cuda)
    clock.attach(trainer)
    trainer.train()
    return clock, weights_dtype(trainer.model)


def run_hand_loop(bench: Bench, cuda: bool) -> tuple[Clock, dict]:
    """Plain PyTorch over exactly the micro-batches hf_padded's process trained on (its file)."""
    import torch.nn.functional as F

    from finetune.core.meter import matmul_parameters

    batches = torch.load(bench.hand_batches_path, weights_only=True)
    device = torch.device("cuda" if cuda else "cpu")
    model, o = bench.new_model().to(device).train(), bench.cfg.optim
    fast = {"fused": True} if cuda else {"foreach": True}
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **fast
    )
    dtype = AUTOCAST.get(bench.args.precision)
    autocast = torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)
    scaler = torch.amp.GradScaler(device.type, enabled=bench.args.precision == "fp16")
    clock, k = Clock(cuda), bench.accumulation
    clock.matmul_params = matmul_parameters(model)
    for step in range(bench.steps):
        window = batches[step * k : (step + 1) * k]
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
        torch.nn.utils.clip_grad_norm_(model.parameters(), bench.cfg.train.max_grad_norm)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        clock.mark()
    return clock, weights_dtype(model)
