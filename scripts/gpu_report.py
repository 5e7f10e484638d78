"""report.md of scripts/gpu_check.py from its report.json: the environment, each step's status, and every figure
beside the command that produced it."""

from __future__ import annotations

import re
from pathlib import Path


def _fmt(value, spec: str = ".3g") -> str:
    return "n/a" if value is None else format(value, spec)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _verify(steps: list[dict]) -> list[str]:
    rows = []
    for s in steps:
        f = s["figures"]
        rows.append(
            [
                s["name"].removeprefix("verify_"),
                s["status"],
                f.get("verdict", s["reason"] or ""),
                _fmt(f.get("relative_error"), ".2e"),
                _fmt(f.get("tolerance"), "g"),
                _fmt(f.get("weight_deviation"), ".1e"),
                f"`{s['command']}`",
            ]
        )
    return [
        "## Exactness: verify against float64",
        "",
        *_table(["precision", "status", "verdict", "relative error", "tolerance", "weight deviation", "command"], rows),
        "",
    ]


def _gpu_tier(s: dict) -> list[str]:
    f = s["figures"]
    counts = ", ".join(f"{k} {f[k]}" for k in ("collected", "passed", "failed", "skipped") if k in f)
    return [
        "## GPU tier (`pytest -m gpu`)",
        "",
        f"{s['status']}: {counts or s['reason']}",
        "",
        f"command: `{s['command']}`",
        "",
    ]


def _loss_head(s: dict) -> list[str]:
    f = s["figures"]
    if not f:
        return []
    rows = [
        [
            str(r["vocab"]),
            str(r["hidden"]),
            str(r["tokens"]),
            r["precision"],
            r["arm"],
            f"{r['ms']:.1f}",
            f"{r['peak_mib']:.0f}",
            f"{r['loss_error']:.1e}",
            f"{r['grad_hidden_error']:.1e}",
            f"{r['grad_weight_error']:.1e}",
        ]
        for r in f["rows"]
    ]
    return [
        "## Loss head: forward + backward",
        "",
        f"{f['device']}; peak: {f['memory']}",
        "",
        *_table(
            ["vocab", "hidden", "tokens", "precision", "arm", "ms", "peak MiB", "loss err", "dh err", "dW err"], rows
        ),
        "",
        f"command: `{s['command']}`",
        "",
    ]


def _benchmark(s: dict) -> list[str]:
    f = s["figures"]
    if not f:
        return []
    ran = {arm: r for arm, r in f.items() if "skipped" not in r}
    rows = [
        [
            arm,
            f"{r['real_tokens_per_s']:.0f}",
            _fmt(r.get("mfu"), ".1%"),
            f"{r['peak_mem_mb']:.0f}",
            _fmt(r.get("tokens_per_s_vs_best_peer"), ".2f"),
            _fmt(r.get("peak_mem_vs_best_peer"), ".2f"),
            _fmt(r.get("tokens_per_s_vs_best_hf"), ".2f"),
            _fmt(r.get("tokens_per_s_vs_best_trl"), ".2f"),
            f"{r['real_token_share']:.3f}",
            _arm_configuration(r),
        ]
        for arm, r in ran.items()
    ]
    best = {k: next((r.get(f"best_{k}_arm") for r in ran.values() if r.get(f"best_{k}_arm")), None) for k in BEST}
    header = ["arm", "real tok/s", "MFU", "peak MiB", "× best peer tok/s", "× best peer mem", "× best HF tok/s"]
    skipped = [f"- `{arm}` skipped: {r['skipped']}" for arm, r in f.items() if "skipped" in r]
    return [
        f"## Training throughput: {s['name'].removeprefix('benchmark_')}",
        "",
        f"ratios over the fastest peer ({best['peer']}), the fastest Trainer arm ({best['hf']}) and the fastest TRL "
        f"SFTTrainer arm ({best['trl']})",
        "",
        *_table([*header, "× best TRL tok/s", "real share", "attention; Liger; weights"], rows),
        *([""] + skipped if skipped else []),
        "",
        f"command: `{s['command']}`",
        "",
    ]


BEST = ("peer", "hf", "trl")


def _arm_configuration(r: dict) -> str:
    """attention; Liger; weights dtype (results of scripts/benchmark.py before arms recorded them: blank)."""
    if "attention" not in r:
        return ""
    return f"{r['attention']}; {'Liger' if r['liger'] else 'no Liger'}; {r['weights']}"


def _syncs(s: dict) -> list[str]:
    f = s["figures"]
    if not f:
        return []
    cuda = f["cuda_syncs_per_step"]
    lines = [
        "## Host syncs per optimizer step",
        "",
        f"{f['device']}, {f['micro_batches_per_step']} micro-batches per step, {f['steps']} steps counted",
        "",
    ]
    if cuda is not None:
        lines.append(
            f"- CUDA runtime syncs: {cuda:.1f} per step (bound {f['bound_per_step']}: "
            f"{'within' if f['within_bound'] else 'above'}); {f['cuda_syncs']}"
        )
    if "modelled_syncs_per_step" in f:  # a CPU: the syncs a CUDA run would make (finetune/testing/host_syncs.py)
        lines.append(
            f"- modelled CUDA syncs: {f['modelled_syncs_per_step']:.1f} per step (bound {f['bound_per_step']}); "
            f"{f['modelled_syncs_by_step']}"
        )
    else:
        lines.append(f"- syncing aten ops: {f['syncing_ops_per_step']:.1f} per step; {f['syncing_ops']}")
    return [*lines, "", f"command: `{s['command']}`", ""]


def _profile(s: dict) -> list[str]:
    if not s["figures"]:
        return []
    from profile_summary import markdown  # beside this script

    return ["## Profile of one packed optimizer step", "", markdown(s["figures"]), f"command: `{s['command']}`", ""]


def _vlm(s: dict) -> list[str]:
    f = s["figures"]
    modes = f.get("cuda", f)
    if not modes:
        return []
    rows = [
        [mode, f"{r['samples_per_s']:.1f}", f"{r['real_tokens_per_s']:.0f}", f"{r['peak_mem_mb']:.0f}"]
        for mode, r in modes.items()
    ]
    recipe = re.search(r"--recipe (\S+)", s["command"])
    return [
        f"## VLM recipe {recipe.group(1) if recipe else 'recipes/vlm_seed.yaml'}: training throughput",
        "",
        f"{next(iter(modes.values()))['device']}",
        "",
        *_table(["mode", "samples/s", "real tok/s", "peak MiB"], rows),
        "",
        f"command: `{s['command']}`",
        "",
    ]


def _sharded(steps: list[dict]) -> list[str]:
    rows = []
    for s in steps:
        f = s["figures"]
        resume, whole, best = f.get("resume") or {}, f.get("consolidated") or {}, f.get("best") or {}
        rows.append(
            [
                s["name"].removeprefix("sharded_"),
                s["status"],
                str(f.get("precision", "")),
                f"{_fmt(resume.get('max_rel_diff'), '.1e')} ({_fmt(resume.get('tolerance'), 'g')})",
                f"{_fmt(whole.get('parameters'), ',')}, {_fmt(whole.get('missing_keys'), 'd')}/"
                f"{_fmt(whole.get('unexpected_keys'), 'd')}",
                f"{_fmt(whole.get('eval_loss'), '.4f')} vs {_fmt(whole.get('logged_eval_loss'), '.4f')}",
                f"{best.get('step', 'n/a')} ({best.get('expected_step', 'n/a')})",
                s["reason"] or "",
            ]
        )
    header = ["config", "status", "precision", "resume: max rel. loss diff (bound)"]
    header += ["consolidated: params, missing/unexpected", "eval loss reloaded vs logged", "best step (lowest logged)"]
    header += ["reason"]
    return ["## Sharded training on one GPU process", "", *_table(header, rows), ""]


def write_report(report: dict, path: Path) -> None:
    env, steps = report["environment"], report["steps"]
    lines = [
        f"# GPU check{' (smoke, toy sizes)' if report['smoke'] else ''}",
        "",
        f"command: `{report['command']}`, {report['wall_s']:.0f} s of a {report.get('budget_s', 0):.0f} s budget",
        "",
        *_table(["", ""], [[k, str(v)] for k, v in env.items()]),
        "",
        "## Steps",
        "",
        *_table(
            ["step", "status", "wall s", "reason", "command"],
            [[s["name"], s["status"], f"{s['wall_s']:.0f}", s["reason"] or "", f"`{s['command']}`"] for s in steps],
        ),
        "",
    ]
    by_kind = {"gpu_tier": _gpu_tier, "loss_head": _loss_head, "host_syncs": _syncs, "profile_packed": _profile}
    by_kind |= {"vlm_bf16": _vlm, "vlm_qwen_bf16": _vlm}
    verify = [s for s in steps if s["name"].startswith("verify_")]
    sharded = [s for s in steps if s["name"].startswith("sharded_")]
    for s in steps:
        if s["name"] in by_kind:
            lines += by_kind[s["name"]](s)
        elif s["name"].startswith("benchmark_"):
            lines += _benchmark(s)
        elif verify and s is verify[0]:
            lines += _verify(verify)
        elif sharded and s is sharded[0]:
            lines += _sharded(sharded)
    path.write_text("\n".join(lines) + "\n")
