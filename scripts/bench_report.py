"""scripts/benchmark.py's report: an arm's rounds summed up, the ratios to the best peer, the targets, the table.

"Best peer": the fastest (real tokens/s) of every peer arm that ran: transformers.Trainer and TRL's SFTTrainer, every
variant (attention, Liger, weights dtype). A ratio is only given where both of its arms ran; a target whose arms did not
run says "not measured".
"""

from __future__ import annotations

import statistics

from bench_arms import AFTER_LIGER, parse
from bench_measure import mfu


def summarize(runs: list[dict]) -> dict:
    """One arm's rounds: median rates, the real-token share over every step, the highest peak."""

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
        "pids": [r["pid"] for r in runs],
        "weights_dtype": runs[0]["weights_dtype"],
    }


def fastest(results: dict, families: tuple[str, ...]) -> str | None:
    ran = [arm for arm, r in results.items() if "skipped" not in r and parse(arm).family in families]
    return max(ran, key=lambda arm: results[arm]["real_tokens_per_s"]) if ran else None


def add_ratios(results: dict) -> None:
    """Per arm that ran: its real tokens/s and peak memory over those of the fastest Trainer arm (`*_vs_best_hf`),
    TRL arm (`*_vs_best_trl`) and peer arm of either (`*_vs_best_peer`), and which arm each is; packed_after_liger's
    rate over packed's (`tokens_per_s_vs_packed`)."""
    ran = {arm: r for arm, r in results.items() if "skipped" not in r}
    for key, families in (("hf", ("trainer",)), ("trl", ("trl",)), ("peer", ("trainer", "trl"))):
        best = fastest(results, families)
        for r in ran.values():
            r[f"best_{key}_arm"] = best
            r[f"tokens_per_s_vs_best_{key}"] = ratio(r, results.get(best), "real_tokens_per_s")
            if key != "trl":
                r[f"peak_mem_vs_best_{key}"] = ratio(r, results.get(best), "peak_mem_mb")
    for arm, r in ran.items():
        if parse(arm).base == AFTER_LIGER:
            plain = "packed+bf16w" if parse(arm).bf16_weights else "packed"
            r["tokens_per_s_vs_packed"] = ratio(r, ran.get(plain), "real_tokens_per_s")


def ratio(r: dict, other: dict | None, key: str) -> float | None:
    return r[key] / other[key] if other is not None and "skipped" not in other else None


def add_utilisation(results: dict, layers: int, hidden: int, mean_length: float, peak: float | None) -> None:
    """Per arm that ran: MFU (None without a known peak)."""
    for r in results.values():
        if "skipped" not in r:
            r["mfu"] = mfu(r["real_tokens_per_s"], r["matmul_params"], layers, hidden, mean_length, peak)


Target = tuple[str, "bool | None", str]  # (target, passed: None where not measured, measured)


def compare(name: str, a: float | None, b: float | None, factor: float, at_least: bool) -> Target:
    if a is None or b is None:
        return name, None, "not measured"
    return name, (a >= factor * b if at_least else a <= factor * b), f"{a / b:.2f}×"


def targets(results: dict, accumulation: int = 4, model: str = "bench") -> list[Target]:
    """(target, passed, measured); passed is None where an arm it needs did not run."""

    def get(arm, key):
        r = results.get(arm) or {}
        return None if "skipped" in r else r.get(key)

    def rate(arm):
        return get(arm, "real_tokens_per_s")

    def memory(arm):
        return get(arm, "peak_mem_mb")

    best = fastest(results, ("trainer", "trl"))
    rows = []
    for arm in ("packed", "token_budget"):
        rows.append(compare(f"{arm} ≥ 1.2× hf_flatten real tokens/s", rate(arm), rate("hf_flatten"), 1.2, True))
        rows.append(least(f"{arm} real-token share ≥ 0.95", get(arm, "real_token_share"), 0.95, ".3f"))
    for arm in ("packed", "packed+bf16w", "token_budget"):
        rows.append(compare(f"{arm} ≥ 1.5× best peer ({best}) real tokens/s", rate(arm), rate(best), 1.5, True))
        rows.append(compare(f"{arm} peak memory ≤ 0.8× best peer ({best})", memory(arm), memory(best), 0.8, False))
    rows.append(compare(f"{AFTER_LIGER} ≥ 1.0× packed real tokens/s", rate(AFTER_LIGER), rate("packed"), 1.0, True))
    if model == "0.5b":
        rows.append(least("packed MFU ≥ 40 % (0.5b)", get("packed", "mfu"), 0.4, ".1%"))
    rows.append(compare("padded ≥ 0.97× hand_loop real tokens/s", rate("padded"), rate("hand_loop"), 0.97, True))
    rows.append(compare("packed peak memory ≤ 0.8× hf_flatten", memory("packed"), memory("hf_flatten"), 0.8, False))
    name = f"packed peak memory, accumulation {accumulation} ≤ 1.1× accumulation 1"
    rows.append(compare(name, memory("packed"), get("packed", "peak_mem_mb_accumulation_1"), 1.1, False))
    return rows


def least(name: str, value: float | None, bound: float, form: str) -> Target:
    return (name, None, "not measured") if value is None else (name, value >= bound, format(value, form))


def print_report(results: dict, memory_kind: str, header: str, accumulation: int, model: str) -> None:
    best = fastest(results, ("trainer", "trl"))
    print(
        f"\n{header}\npeak MiB: {memory_kind}, above the arm's start; others CPU: the share of the machine's CPU "
        "time other processes used during the timed steps (high: wall-clock rates are not comparable); × best peer: "
        f"over the fastest Trainer or TRL arm ({best})\n"
    )
    print(
        f"{'arm':<32}{'real tok/s':>11}{'computed tok/s':>15}{'real share':>11}{'peak MiB':>9}{'MFU':>7}"
        f"{'× best peer tok/s':>18}{'× best peer mem':>16}{'real tok/CPU-s':>15}{'others CPU':>11}{'timed steps':>12}"
    )
    for arm, r in results.items():
        if "skipped" in r:
            continue
        print(
            f"{arm:<32}{r['real_tokens_per_s']:>11.0f}{r['computed_tokens_per_s']:>15.0f}"
            f"{r['real_token_share']:>11.3f}{r['peak_mem_mb']:>9.0f}"
            f"{'n/a' if r['mfu'] is None else format(r['mfu'], '.1%'):>7}{shown(r['tokens_per_s_vs_best_peer']):>18}"
            f"{shown(r['peak_mem_vs_best_peer']):>16}{r['real_tokens_per_cpu_s']:>15.0f}"
            f"{r['others_cpu_share']:>11.0%}{r['timed_steps']:>12}"
        )
    packed = results.get("packed", {})
    if "peak_mem_mb_accumulation_1" in packed:
        print(
            f"{'packed, accumulation 1':<32}{'':>37}{packed['peak_mem_mb_accumulation_1']:>9.0f}   (accumulating "
            f"keeps the gradients between micro-batches: {packed['gradient_mb']:.0f} MiB)"
        )
    print_configurations(results)
    print("\ntargets:")
    for name, passed, measured in targets(results, accumulation, model):
        print(f"  {'n/a ' if passed is None else 'PASS' if passed else 'FAIL'}  {name}: {measured}")


def print_configurations(results: dict) -> None:
    print("\nconfiguration (attention; Liger; weights; batching):")
    for arm, r in results.items():
        state = f"SKIPPED: {r['skipped']}" if "skipped" in r else f"{r['real_tokens_per_s']:.0f} real tok/s"
        liger = "Liger" if r["liger"] else "no Liger"
        print(f"  {arm:<32}{r['attention']}; {liger}; {r['weights']} weights; {r['batching']} — {state}")
    after = results.get(AFTER_LIGER, {})
    if after.get("tokens_per_s_vs_packed") is not None:
        print(f"  Liger in the process: {AFTER_LIGER} / packed = {after['tokens_per_s_vs_packed']:.2f}×")


def shown(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
