"""The GPU tier (`pytest -m gpu`, skipped without CUDA; scripts/gpu_check.py runs it): what a CPU cannot show.

- bf16 and fp16 (a real GradScaler) training exact against float64 within the precision's own error, as
  tests/test_head_precision.py states the bound;
- the chunked head's peak memory against plain logits;
- fp16 overflow: the step is skipped and the schedule does not advance;
- host syncs on the training path: at most one per micro-batch plus three per optimizer step.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from transformers import TrainerCallback, TrainingArguments

from finetune import TokenNormTrainer
from finetune.core.loss import head_cross_entropy_sum
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import RecordingCollator, SnapshotCallback, model_at, ragged_rows, tiny_llama
from tests.floors import autocast_brute_force_error

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
ROUNDOFF = {"bf16": 2.0**-8, "fp16": 2.0**-11}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def cuda_args(output_dir, micro, accumulation, precision, **extra):
    """SGD lr 1 without clipping (the parameter change is minus the applied gradient) on the GPU, in the given
    precision; `extra` overrides any of these."""
    options = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=1,
        learning_rate=1.0,
        optim="sgd",
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=0.0,  # Trainer's default 1.0 would scale the applied gradient: 0.146 off on the first step
        report_to=[],
        save_strategy="no",
        seed=0,
        remove_unused_columns=False,
        dataloader_num_workers=0,
        disable_tqdm=True,
        bf16=precision == "bf16",
        fp16=precision == "fp16",
    )
    return TrainingArguments(**(options | extra))


def train_on_cuda(model, rows, tmp_path, micro, accumulation, precision, **extra):
    collator, snapshots = RecordingCollator(), SnapshotCallback()
    trainer = TokenNormTrainer(
        model=model,
        args=cuda_args(tmp_path, micro, accumulation, precision, **extra),
        train_dataset=rows,
        data_collator=collator,
        callbacks=[snapshots],
    )
    trainer.train()
    windows = [sum(collator.batches[i : i + accumulation], []) for i in range(0, len(collator.batches), accumulation)]
    cpu = [{n: t.cpu() for n, t in snap.items()} for snap in snapshots.snapshots]
    return trainer, windows, cpu


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_is_exact_within_its_own_error(precision, tmp_path):
    initial = tiny_llama()
    trainer, windows, snapshots = train_on_cuda(
        copy.deepcopy(initial), ragged_rows(12, seed=8), tmp_path, 2, 3, precision
    )
    assert trainer.chunked_head.head is not False  # the head ran chunked under the accelerate-wrapped forward
    for k, window in enumerate(windows):
        if torch.equal(snapshots[k]["lm_head.weight"], snapshots[k + 1]["lm_head.weight"]):
            continue  # an fp16 step skipped by the scaler (overflow at the initial scale): nothing applied
        grads, _ = reference_gradient(model_at(initial, snapshots[k]), window)
        applied = {n: snapshots[k][n] - snapshots[k + 1][n] for n in grads}
        error = relative_error(applied, grads)
        floor = autocast_brute_force_error(initial, snapshots[k], window, DTYPES[precision], "cuda")
        assert error <= 1.5 * floor and error <= 2 * ROUNDOFF[precision], (error, floor)


def peak_extra_bytes(fn) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_head_needs_a_fraction_of_plain_logits_memory():
    """8,192 kept tokens, SmolLM2's head (49,152 × 576) in bf16: the chunked head's peak beyond its inputs is at
    most half of what autocast logits + float32 cross-entropy need."""
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, hidden, vocab = 8192, 576, 49152
    states = torch.randn(tokens, hidden, device="cuda", generator=g, requires_grad=True)
    weight = (torch.randn(vocab, hidden, device="cuda", generator=g) * hidden**-0.5).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device="cuda", generator=g)

    def chunked():
        loss, _ = head_cross_entropy_sum(states, weight, None, targets, compute_dtype=torch.bfloat16)
        loss.backward()

    def plain():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = states @ weight.t()
        F.cross_entropy(logits.float(), targets, reduction="sum").backward()

    ours, theirs = peak_extra_bytes(chunked), peak_extra_bytes(plain)
    assert ours <= 0.5 * theirs, (ours / 2**20, theirs / 2**20)


def test_fp16_overflow_skips_the_step_and_holds_the_schedule(tmp_path):
    """A scale of 2^40 overflows the first steps: the weights stay, and the LR schedule does not advance on them.
    (The recipe path never pairs a GradScaler with a fused optimizer, whose step() the scaler always calls:
    tests/test_mixed_precision.py.)"""
    model = tiny_llama().cuda()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = cuda_args(
        tmp_path, 2, 1, "fp16", max_steps=2, lr_scheduler_type="linear", optim="adamw_torch", learning_rate=1e-3
    )
    trainer = TokenNormTrainer(
        model=model, args=args, train_dataset=ragged_rows(8, seed=1), data_collator=RecordingCollator()
    )
    trainer.accelerator.scaler = torch.amp.GradScaler("cuda", init_scale=2.0**40, growth_interval=1000)
    lrs = []

    class RecordLR(TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            lrs.append(trainer.lr_scheduler.get_last_lr()[0])

    trainer.add_callback(RecordLR())
    trainer.train()
    skipped = all(torch.equal(before[n], p.detach()) for n, p in model.named_parameters())
    assert skipped and lrs == [1e-3, 1e-3], lrs


def test_training_path_syncs_at_most_once_per_micro_batch_plus_three_per_step(tmp_path):
    """torch.cuda.set_sync_debug_mode('warn') names every blocking host-device sync; logging is left out (every
    1,000 steps) since a logged step reads its figures by design."""
    model = tiny_llama().cuda()
    micro_batches, steps = 3, 4
    args = cuda_args(
        tmp_path,
        2,
        micro_batches,
        "bf16",
        max_steps=steps,
        logging_steps=1000,
        max_grad_norm=1.0,
        logging_nan_inf_filter=False,
        dataloader_pin_memory=True,
    )
    trainer = TokenNormTrainer(
        model=model, args=args, train_dataset=ragged_rows(48, seed=2), data_collator=RecordingCollator()
    )

    class CountFromStepTwo(TrainerCallback):
        def on_step_begin(self, *a, **k):  # the first step compiles, probes and allocates: counted from step 2
            if trainer.state.global_step == 1:
                torch.cuda.set_sync_debug_mode("warn")

    trainer.add_callback(CountFromStepTwo())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    counted_steps = steps - 1
    assert len(syncs) <= counted_steps * (micro_batches + 3), [str(w.message)[:120] for w in syncs]
