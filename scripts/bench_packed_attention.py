"""Packed-row attention: sdpa over the whole row with transformers' block-diagonal mask vs `packed_sdpa` (causal sdpa
on each sequence, finetune/model/packed_attention.py), forward + backward, as ratios measured in one run.

    OMP_NUM_THREADS=1 python scripts/bench_packed_attention.py [--rows 4] [--repeats 5]

The model of recipes/bench.yaml (Llama-shaped: hidden 384, 6 heads, 2 kv heads, 6 layers, SmolLM2 vocabulary, random
init, fp32) on packed rows of 8 sequences drawn at random from the built-in docstring set. Two figures per row:
- model: the whole forward (mask construction included) and backward of the summed cross-entropy of the row;
- attention: one layer's attention call alone (q, k, v of the row's shape; the mask built once, outside the timing).
Both implementations run on the same rows, alternating, and each figure is the median of --repeats; the ratio is
masked / per-sequence (above 1: per-sequence is faster). The machine's load average is printed with the figures.
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


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def packed_rows(dataset, rows: int, per_row: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    picks = [rng.sample(range(len(dataset)), per_row) for _ in range(rows)]
    out = []
    for pick in picks:
        seqs = [dataset[i]["input_ids"] for i in pick]
        out.append({
            "input_ids": torch.tensor([[t for s in seqs for t in s]]),
            "position_ids": torch.tensor([[p for s in seqs for p in range(len(s))]]),
            "lengths": [len(s) for s in seqs],
        })
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=4, help="packed rows (8 sequences each) to time")
    parser.add_argument("--per-row", type=int, default=8, help="sequences per packed row")
    parser.add_argument("--repeats", type=int, default=5, help="timings per implementation and row (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    from transformers import set_seed
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import create_causal_mask

    from finetune.data.text import load_sft_dataset
    from finetune.model import packed_attention
    from finetune.model.loading import load_model, load_tokenizer, model_folder
    from finetune.recipe import load_config

    cfg = load_config([f"recipe={ROOT / 'recipes' / 'bench.yaml'}", "log.wandb_mode=disabled"])
    folder = model_folder(cfg.model)
    tokenizer = load_tokenizer(cfg.model, folder)
    dataset, _ = load_sft_dataset(cfg.data, tokenizer)
    set_seed(cfg.train.seed)
    model = load_model(cfg.model, folder).train()
    packed_attention.register()
    attention = model.model.layers[0].self_attn
    c = model.config
    print(f"model: Llama hidden {c.hidden_size}, {c.num_attention_heads} heads, {c.num_key_value_heads} kv heads, "
          f"{c.num_hidden_layers} layers, vocab {c.vocab_size}, fp32; CPU, {torch.get_num_threads()} thread(s)")
    print("load average (1, 5, 15 min) before: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))

    def model_step(row, implementation):
        model.config._attn_implementation = implementation
        logits = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits[0, :-1], row["input_ids"][0, 1:], reduction="sum")
        loss.backward()
        model.zero_grad(set_to_none=True)

    def attention_step(fn, q, k, v, mask, row):
        out, _ = fn(attention, q, k, v, mask, scaling=attention.scaling, position_ids=row["position_ids"])
        out.sum().backward()

    results = []
    head_dim, heads, kv_heads = attention.head_dim, c.num_attention_heads, c.num_key_value_heads
    for row in packed_rows(dataset, args.rows, args.per_row, args.seed):
        length = row["input_ids"].shape[1]
        # the same answer first: the comparison is between equal computations
        with torch.no_grad():
            model.eval()
            model.config._attn_implementation = "sdpa"
            a = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
            model.config._attn_implementation = packed_attention.NAME
            b = model(input_ids=row["input_ids"], position_ids=row["position_ids"], use_cache=False).logits
            model.train()
        max_diff = float((a - b).abs().max())
        model_times = {impl: [] for impl in ("sdpa", packed_attention.NAME)}
        for _ in range(args.repeats):  # alternating: load changes hit both alike
            for impl in model_times:
                model_times[impl].append(timed(lambda row=row, impl=impl: model_step(row, impl), 1))
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, heads, length, head_dim, generator=g, requires_grad=True)
        k = torch.randn(1, kv_heads, length, head_dim, generator=g, requires_grad=True)
        v = torch.randn(1, kv_heads, length, head_dim, generator=g, requires_grad=True)
        embeds = torch.zeros(1, length, 1)
        model.config._attn_implementation = "sdpa"
        mask = create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=None,
                                  past_key_values=None, position_ids=row["position_ids"])
        assert mask is not None and mask.shape[-1] == length
        attn_times = {"sdpa": [], packed_attention.NAME: []}
        calls = {"sdpa": (sdpa_attention_forward, mask),
                 packed_attention.NAME: (packed_attention.packed_sdpa_attention, None)}
        for _ in range(args.repeats):
            for impl, (fn, m) in calls.items():
                step = functools.partial(attention_step, fn, q, k, v, m, row)
                attn_times[impl].append(timed(step, 1))
        med = {f"{kind}_{impl}": statistics.median(t) for kind, times in (("model", model_times), ("attn", attn_times))
               for impl, t in times.items()}
        results.append(med)
        print(f"row of {length} tokens ({'+'.join(map(str, row['lengths']))}), max |Δlogit| {max_diff:.2e}: "
              f"model fwd+bwd {med['model_sdpa']:.3f} s masked vs {med['model_' + packed_attention.NAME]:.3f} s "
              f"per-sequence ({med['model_sdpa'] / med['model_' + packed_attention.NAME]:.2f}×); one layer's "
              f"attention {med['attn_sdpa'] * 1e3:.1f} ms vs {med['attn_' + packed_attention.NAME] * 1e3:.1f} ms "
              f"({med['attn_sdpa'] / med['attn_' + packed_attention.NAME]:.2f}×)")
    total = {key: sum(r[key] for r in results) for key in results[0]}
    name = packed_attention.NAME
    print(f"all {len(results)} rows: model fwd+bwd {total['model_sdpa'] / total['model_' + name]:.2f}× faster "
          f"per-sequence ({total['model_sdpa']:.3f} s vs {total['model_' + name]:.3f} s); attention alone "
          f"{total['attn_sdpa'] / total['attn_' + name]:.2f}× ({total['attn_sdpa'] * 1e3:.0f} ms vs "
          f"{total['attn_' + name] * 1e3:.0f} ms)")
    print("load average (1, 5, 15 min) after: {:.2f} {:.2f} {:.2f}".format(*os.getloadavg()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
