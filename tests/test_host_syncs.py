"""Host syncs of the training path, counted on a CPU (finetune/testing/host_syncs.py models which tensors a CUDA run
keeps on the device): the debug recipe, packed and padded, makes at most one per micro-batch plus three per optimizer
step (the bound tests/test_gpu.py checks with torch's CUDA sync debug mode)."""

import contextlib
import io

import torch

from finetune.assemble import build
from finetune.model import packed_attention
from finetune.model.packed_attention import NAME, PackedAttention
from finetune.model.varlen_attention import VarlenKernel
from finetune.recipe import load_config
from finetune.testing.host_syncs import HostSyncs, step_counts, train_counting
from tests.attention import per_sequence

STEPS = 3


def varlen_stand_in(syncs: HostSyncs):
    """torch's varlen_attn written out per sequence on a CPU; on CUDA the kernel reads nothing back, so neither does
    its stand-in count."""

    def varlen(query, key, value, cu_q, cu_k, max_q, max_k, *, return_aux=None, scale=None, window_size, enable_gqa):
        with syncs.paused():
            return per_sequence(query, key, value, cu_q.tolist(), scale)

    return varlen


def counted_run(tmp_path, batching: str, cuda_attention: bool) -> tuple[HostSyncs, int]:
    cfg = load_config(
        ["recipe=recipes/debug.yaml", f"data.batching={batching}", f"train.max_steps={STEPS}", "train.save_steps=0"]
    )
    cfg.train.output_dir = str(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()):
        trainer = build(cfg, evaluate=False)
    syncs = HostSyncs()
    if cuda_attention:  # the CUDA path of packed rows: one varlen call per layer
        kernel = VarlenKernel(varlen_stand_in(syncs), device="cpu", dtypes=(torch.float32,))
        packed_attention.register(PackedAttention(kernel), NAME)
    try:
        train_counting(trainer, syncs)
    finally:
        packed_attention.register()
    return syncs, trainer.args.gradient_accumulation_steps


def test_packed_training_syncs_at_most_once_per_micro_batch_plus_three_per_step(tmp_path):
    syncs, micro_batches = counted_run(tmp_path, "packed", cuda_attention=True)
    counts = step_counts(syncs)
    assert micro_batches == 2 and list(counts) == list(range(2, STEPS + 1)), syncs.per_phase
    assert all(n <= micro_batches + 3 for n in counts.values()), (counts, syncs.sites.most_common(12))


def test_padded_training_syncs_at_most_once_per_micro_batch_plus_three_per_step(tmp_path):
    """Right-padded rows train without their attention mask (ForwardTakes.unmasks_right_padding): transformers' sdpa
    mask, which read a padded mask back twice per forward (`_ignore_causal_mask_sdpa`), is not made; what transformers
    reads is its packed-rows check of the positions it makes on the device (`find_packed_sequence_indices`, once per
    micro-batch), and this project three per step (the step's norm and finite flag together, the logged loss and
    norm)."""
    syncs, micro_batches = counted_run(tmp_path, "padded", cuda_attention=False)
    transformers_mask = {site.split(" <- ")[0]: n for site, n in syncs.sites.items() if "@ masking_utils.py" in site}
    counts = step_counts(syncs)
    assert len(transformers_mask) == 1 and sum(transformers_mask.values()) == micro_batches * STEPS, transformers_mask
    assert list(counts) == list(range(2, STEPS + 1)), counts
    assert all(n <= micro_batches + 3 for n in counts.values()), (counts, syncs.sites.most_common(12))


def test_per_sequence_packed_attention_reads_the_bounds_once_per_forward(tmp_path):
    """Without the varlen kernel (a CPU, torch < 2.10) each forward reads its rows' bounds once: one more per
    micro-batch than the varlen path, none per layer."""
    syncs, micro_batches = counted_run(tmp_path, "packed", cuda_attention=False)
    bounds = sum(n for site, n in syncs.sites.items() if site.startswith("tolist @ packed_attention.py"))
    assert bounds == STEPS * micro_batches
    assert all(n <= 2 * micro_batches + 3 for n in step_counts(syncs).values())


def test_the_counter_sees_device_reads_and_not_host_ones():
    syncs = HostSyncs()
    device, host = torch.arange(6.0), torch.arange(6.0)
    with syncs:
        syncs.place(device)
        derived = device * 2
        float(derived.sum()), host.sum().item(), host.tolist()  # one device read
        derived[derived > 3]  # a boolean mask: its size is read back
        derived[torch.tensor([1, 2])]  # an integer index: nothing read back
        derived.tolist(), derived.cpu()  # two blocking copies
        derived[derived > 3] = 0.0  # a mask fill from a host scalar: CUDA's masked_fill, nothing read back
        derived.nonzero(), torch.equal(derived, device)
    ops = sorted(site.split(" @ ")[0] for site in syncs.sites.elements())
    assert ops == ["_local_scalar_dense", "cpu", "equal", "index", "nonzero", "tolist"], ops


def test_a_tensor_made_with_the_devices_torch_device_is_on_it():
    """transformers makes positions with `torch.arange(n, device=inputs_embeds.device)`: on CUDA a device tensor, and
    reading it back a sync; one made on the host (no device, or the string "cpu") reads nothing back."""
    syncs = HostSyncs()
    with syncs:
        made_there = torch.arange(4, device=torch.device("cpu"))
        bool((made_there == 0).all())
        bool((torch.arange(4) == 0).all()), bool((torch.zeros(2, device="cpu") == 0).all())
    assert sum(syncs.sites.values()) == 1, syncs.sites
