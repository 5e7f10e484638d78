"""Packed-row attention: sdpa over the whole row with transformers' block-diagonal mask vs `packed_sdpa` (causal sdpa
on each sequence, finetune/model/packed_attention.py), and on CUDA vs one varlen_attn call per layer, forward +
backward, as ratios measured in one run.

    OMP_NUM_THREADS=1 python scripts/bench_packed_attention.py [--rows 4] [--repeats 5]
    python scripts/bench_packed_attention.py --device cuda [--rows 16] [--per-row 64] [--repeats 20]

The model of recipes/bench.yaml (Llama-shaped: hidden 384, 6 heads, 2 kv heads, 6 layers, SmolLM2 vocabulary, random
init) on packed rows of --per-row sequences drawn at random from the built-in docstring set. On the CPU (fp32) the
arms are `sdpa` (masked) and `packed_sdpa` (per sequence); with --device cuda (bf16 weights) they are `sdpa`,
`per_sequence` (the per-sequence loop, as packed_sdpa runs without a varlen kernel) and `varlen` (packed_sdpa with
torch's varlen_attn, fed the bounds the packed collator makes: cu_seq_lens_q/k, max_length_q/k). Two figures per row:
- model: the whole forward (mask construction included) and backward of the summed cross-entropy of the row;
- attention: one layer's attention call alone (q, k, v of the row's shape; the mask built once, outside the timing).
All arms run on the same rows, alternating, and each figure is the median of --repeats (CUDA: synchronized before and
after each); the ratio is masked sdpa / the arm (above 1: the arm is faster). The machine's load average is printed
with the figures.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeats: int, device: str) -> float:
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_rows(dataset, rows: int, per_row: int, seed: int, device: str) -> list[dict]:
    """Packed rows as the model takes them; on CUDA with the bounds the packed collator adds for the varlen kernel."""
    rng = random.Random(seed)
    picks = [rng.sample(range(len(dataset)), per_row) for _ in range(rows)]
    out = []
    for pick in picks:
        seqs = [dataset[i]["input_ids"] for i in pick]
        inputs = {
            "input_ids": torch.tensor([[t for s in seqs for t in s]], device=device),
            "position_ids": torch.tensor([[p for s in seqs for p in range(len(s))]], device=device),
        }
        if device == "cuda":
            edges = [0]
            for seq in seqs:
                edges.append(edges[-1] + len(seq))
            cu = torch.tensor(edges, dtype=torch.int32, device=device)
            longest = max(len(seq) for seq in seqs)
            inputs.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=longest, max_length_k=longest)
        out.append({"inputs": inputs, "lengths": [len(s) for s in seqs]})
    return out


def arms(device: str) -> dict:
    """{arm: (attn_implementation name, the attention function of one layer)}; masked sdpa first."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from finetune.model import packed_attention
    from finetune.model.packed_attention import PackedAttention
    from finetune.model.varlen_attention import VarlenKernel, torch_varlen_attn

    if device == "cpu":
        packed_attention.register()
        return {
            "sdpa": ("sdpa", sdpa_attention_forward),
            packed_attention.NAME: (packed_attention.NAME, packed_attention.packed_sdpa_attention),
        }
    varlen = torch_varlen_attn()
    if varlen is None:
        raise SystemExit(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn (torch>=2.10)")
    loop = packed_attention.register(PackedAttention(None), "per_sequence")
    kernel = packed_attention.register(PackedAttention(VarlenKernel(varlen)), "varlen")
    return {
        "sdpa": ("sdpa", sdpa_attention_forward),
        "per_sequence": ("per_sequence", loop),
        "varlen": ("varlen", kernel),
    }


def measure_row(model, row: dict, implementations: dict, repeats: int, device: str) -> dict:
    """{arm: (max |Δlogit| vs masked sdpa, model fwd+bwd s, one layer's attention fwd+bwd s)} for one packed row."""
    from transformers.masking_utils import create_causal_mask

    inputs, c = row["inputs"], model.config
    attention = model.model.layers[0].self_attn
    length = inputs["input_ids"].shape[1]
    dtype = next(model.parameters()).dtype

    def model_step(implementation):
        model.config._attn_implementation = implementation
        logits = model(**inputs, use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1].float(), inputs["input_ids"][0, 1:], reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)

    def attention_step(fn, q, k, v, mask):
        kwargs = {key: value for key, value in inputs.items() if key != "input_ids"}
        out, _ = fn(attention, q, k, v, mask, scaling=attention.scaling, **kwargs)
        out.float().sum().backward()

    logits = {}
    with torch.no_grad():  # the same answer first: the comparison is between equal computations
        model.eval()
        for arm, (implementation, _) in implementations.items():
            model.config._attn_implementation = implementation
            logits[arm] = model(**inputs, use_cache=False).logits.float()
        model.train()
    model_times = {arm: [] for arm in implementations}
    for _ in range(repeats):  # alternating: load changes hit all alike
        for arm, (implementation, _) in implementations.items():
            model_times[arm].append(timed(functools.partial(model_step, implementation), 1, device))
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, heads, length, attention.head_dim, generator=g, device=device, dtype=dtype, requires_grad=True)
        for heads in (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads)
    )
    model.config._attn_implementation = "sdpa"
    mask = create_causal_mask(
        config=model.config,
        inputs_embeds=torch.zeros(1, length, 1, device=device),
        attention_mask=None,
        past_key_values=None,
        position_ids=inputs["position_ids"],
    )
    assert mask is not None and mask.shape[-1] == length
    attn_times = {arm: [] for arm in implementations}
    for _ in range(repeats):
        for arm, (_, fn) in implementations.items():
            step = functools.partial(attention_step, fn, q, k, v, mask if arm == "sdpa" else None)
            attn_times[arm].append(timed(step, 1, device))
    return {
        arm: (
            float((logits[arm] - logits["sdpa"]).abs().max()),
            statistics.median(model_times[arm]),
            statistics.median(attn_times[arm]),
        )
        for arm in implementations
    }


def print_row(row: dict, figures: dict) -> None:
    """One packed row's line: each arm against the masked SDPA, the whole model and one layer's attention."""
    length = row["inputs"]["input_ids"].shape[1]
    _, model_sdpa, attn_sdpa = figures["sdpa"]
    parts = [
        f"{arm}: max |Δlogit| {diff:.2e}, model fwd+bwd {model_s:.4f} s ({model_sdpa / model_s:.2f}×), "
        f"one layer's attention {attn_s * 1e3:.2f} ms ({attn_sdpa / attn_s:.2f}×)"
        for arm, (diff, model_s, attn_s) in figures.items()
        if arm != "sdpa"
    ]
    print(
        f"row of {length} tokens ({'+'.join(map(str, row['lengths']))}): masked sdpa model fwd+bwd "
        f"{model_sdpa:.4f} s, one layer's attention {attn_sdpa * 1e3:.2f} ms; " + "; ".join(parts)
    )


def print_total(results: list[dict]) -> None:
    """The sums over every row, each arm against the masked SDPA."""
    total = {arm: (sum(r[arm][1] for r in results), sum(r[arm][2] for r in results)) for arm in results[0]}
    model_sdpa, attn_sdpa = total["sdpa"]
    print(
        f"all {len(results)} rows: masked sdpa model fwd+bwd {model_sdpa:.3f} s, attention alone "
        f"{attn_sdpa * 1e3:.1f} ms; "
        + "; ".join(
            f"{arm}: model {model_s:.3f} s ({model_sdpa / model_s:.2f}× faster), attention {attn_s * 1e3:.1f} ms "
            f"({attn_sdpa / attn_s:.2f}×)"
            for arm, (model_s, attn_s) in total.items()
            if arm != "sdpa"
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="packed rows (--per-row sequences each) to time")
    parser.add_argument("--per-row", type=int, default=8, help="sequences per packed row")
    parser.add_argument("--repeats", type=int, default=5, help="timings per implementation and row (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 weights, and the varlen arm"
    )
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")

    from transformers import set_seed

    from finetune.data.text import load_sft_dataset
    from finetune.model.loading import load_model, load_tokenizer, model_folder
    from finetune.recipe import load_config

    cfg = load_config([f"recipe={ROOT / 'recipes' / 'bench.yaml'}", "log.wandb_mode=disabled"])
    folder = model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model, folder)
    dataset, _ = load_sft_dataset(cfg.data, tokenizer)
    set_seed(cfg.train.seed)
    model = load_model(cfg.model, folder).train()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model.to(args.device, dtype)
    implementations = arms(args.device)
    c = model.config
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} thread(s)"
    print(
        f"model: Llama hidden {c.hidden_size}, {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, "
        f"{c.num_hidden_layers} layers, vocab {c.vocab_size}, {str(dtype).removeprefix('torch.')}; {where}; "
        f"torch {torch.__version__}"
    )
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))

    results = []
    for row in packed_rows(dataset, args.rows, args.per_row, args.seed, args.device):
        results.append(measure_row(model, row, implementations, args.repeats, args.device))
        print_row(row, results[-1])
    print_total(results)
    print("load average (1, 5, 15 min) after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
