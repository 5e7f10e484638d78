"""Summarise a torch.profiler Chrome trace (`train.profile_steps` writes one): the top kernels by total time, the idle
gaps between consecutive kernels on the busiest stream (total, the largest, and what ran on the host around each),
and the host syncs per optimizer step. A CPU trace has no CUDA kernels: its top-level CPU ops on the busiest thread
stand in for kernels and the stream (the syncs are then the ops that would sync on a GPU).

    python scripts/profile_summary.py OUT/profile_steps_2-2.trace.json --steps 1 --micro-batches 4 \
        --json profile.json --markdown profile.md
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
SYNCING_OPS = ("aten::_local_scalar_dense", "aten::nonzero")  # host reads (syncs where the tensor is on a GPU)


def complete_events(trace: dict) -> list[dict]:
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def device_timeline(events: list[dict]) -> tuple[str, list[dict]]:
    """("cuda", the busiest stream's kernels and copies) or, without any, ("cpu", the busiest thread's top-level CPU
    ops); sorted by start."""
    lanes: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in DEVICE_CATEGORIES:
            lanes[(e.get("pid"), e.get("tid"))].append(e)
    kind = "cuda" if lanes else "cpu"
    if not lanes:
        for e in events:
            if e.get("cat") == "cpu_op":
                lanes[(e.get("pid"), e.get("tid"))].append(e)
        lanes = {lane: top_level(ops) for lane, ops in lanes.items()}
    if not lanes:
        return kind, []
    busiest = max(lanes.values(), key=lambda lane: sum(e["dur"] for e in lane))
    return kind, sorted(busiest, key=lambda e: e["ts"])


def top_level(ops: list[dict]) -> list[dict]:
    """The ops no other op of the list encloses (ops nest on a thread)."""
    kept, end = [], float("-inf")
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            kept.append(e)
            end = e["ts"] + e["dur"]
    return kept


def top_by_time(timeline: list[dict], count: int = 15) -> list[dict]:
    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in timeline:
        totals[e["name"]][0] += e["dur"]
        totals[e["name"]][1] += 1
    busy = sum(t for t, _ in totals.values()) or 1.0
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:count]
    return [{"name": name, "total_us": round(t, 3), "calls": n, "share": round(t / busy, 4)} for name, (t, n) in ranked]


def idle_gaps(timeline: list[dict], host: list[dict], count: int = 10) -> dict:
    """The idle time between consecutive events of the timeline: total, span, and the `count` largest gaps with the
    events on either side and the host events covering it (innermost first)."""
    gaps = []
    for before, after in zip(timeline, timeline[1:]):
        start = before["ts"] + before["dur"]
        if after["ts"] > start:
            gaps.append((after["ts"] - start, start, before, after))
    span = (timeline[-1]["ts"] + timeline[-1]["dur"] - timeline[0]["ts"]) if timeline else 0.0
    idle = sum(g[0] for g in gaps)
    largest = sorted(gaps, key=lambda g: -g[0])[:count]
    return {
        "span_us": round(span, 3),
        "idle_us": round(idle, 3),
        "idle_share": round(idle / span, 4) if span else 0.0,
        "gaps": len(gaps),
        "largest": [
            {
                "idle_us": round(length, 3),
                "at_us": round(start - timeline[0]["ts"], 3),
                "after": before["name"],
                "before": after["name"],
                "host": host_around(host, start, start + length),
            }
            for length, start, before, after in largest
        ],
    }


def host_around(host: list[dict], start: float, end: float, count: int = 3) -> list[str]:
    """The names of the host events covering at least half of [start, end], innermost (shortest) first: what the
    host was doing while the device waited (a sync call inside a scalar read inside the op that asked for it)."""
    covering = sorted(
        (e["dur"], e["name"]) for e in host if min(end, e["ts"] + e["dur"]) - max(start, e["ts"]) >= (end - start) / 2
    )
    names: list[str] = []
    for _, name in covering:
        if name not in names:
            names.append(name)
    return names[:count]


def host_syncs(events: list[dict], steps: int, micro_batches: int) -> dict:
    """Counts of the runtime calls that block the host, device-to-host copies and host-reading aten ops: in all, per
    optimizer step and per micro-batch."""
    counts = {name: 0 for name in (*SYNC_CALLS, "Memcpy DtoH", *SYNCING_OPS)}
    for e in events:
        name, cat = e["name"], e.get("cat")
        if cat == "cuda_runtime" and name in SYNC_CALLS:
            counts[name] += 1
        elif cat == "gpu_memcpy" and "DtoH" in name:
            counts["Memcpy DtoH"] += 1
        elif cat == "cpu_op" and name in SYNCING_OPS:
            counts[name] += 1
    blocking = sum(counts[name] for name in SYNC_CALLS)
    return {
        "counts": counts,
        "blocking_calls_per_step": blocking / steps,
        "dtoh_copies_per_step": counts["Memcpy DtoH"] / steps,
        "syncing_ops_per_step": sum(counts[name] for name in SYNCING_OPS) / steps,
        "per_micro_batch": {name: n / (steps * micro_batches) for name, n in counts.items()},
    }


def summarize(trace: dict, steps: int = 1, micro_batches: int = 1) -> dict:
    events = complete_events(trace)
    kind, timeline = device_timeline(events)
    host = [e for e in events if e.get("cat") in ("cpu_op", "cuda_runtime", "user_annotation")]
    if kind == "cpu":  # the host is the timeline: its top-level ops are the gaps' sides, the nested ones the context
        sides = {id(e) for e in timeline}
        host = [e for e in host if id(e) not in sides]
    return {
        "kind": kind,
        "steps": steps,
        "micro_batches_per_step": micro_batches,
        "events": len(timeline),
        "busy_us": round(sum(e["dur"] for e in timeline), 3),
        "top": top_by_time(timeline),
        "idle": idle_gaps(timeline, host),
        "host_syncs": host_syncs(events, steps, micro_batches),
    }


def markdown(summary: dict) -> str:
    what = "CUDA kernels" if summary["kind"] == "cuda" else "top-level CPU ops (a CPU trace: no CUDA kernels)"
    idle, syncs = summary["idle"], summary["host_syncs"]
    lines = [
        f"### Profile: {what}, {summary['steps']} optimizer step(s) of {summary['micro_batches_per_step']} "
        "micro-batches",
        "",
        f"busy {summary['busy_us'] / 1e3:.1f} ms of a {idle['span_us'] / 1e3:.1f} ms span; idle "
        f"{idle['idle_us'] / 1e3:.1f} ms ({idle['idle_share']:.1%}) in {idle['gaps']} gaps",
        "",
        "| name | total ms | calls | share |",
        "|---|---|---|---|",
        *(
            f"| `{t['name'][:90]}` | {t['total_us'] / 1e3:.2f} | {t['calls']} | {t['share']:.1%} |"
            for t in summary["top"]
        ),
        "",
        "| idle ms | at ms | after | before | host around it |",
        "|---|---|---|---|---|",
        *(
            f"| {g['idle_us'] / 1e3:.2f} | {g['at_us'] / 1e3:.1f} | `{g['after'][:40]}` | `{g['before'][:40]}` | "
            f"{', '.join(f'`{h[:40]}`' for h in g['host'])} |"
            for g in idle["largest"]
        ),
        "",
        f"host syncs per step: {syncs['blocking_calls_per_step']:.1f} blocking CUDA calls, "
        f"{syncs['dtoh_copies_per_step']:.1f} device-to-host copies, {syncs['syncing_ops_per_step']:.1f} host-reading "
        f"ops; {', '.join(f'{k} {v}' for k, v in syncs['counts'].items() if v)}",
        "",
    ]
    return "\n".join(lines)


def write(summary: dict, json_path: str | None, markdown_path: str | None) -> None:
    """The summary as JSON and markdown where asked, and the markdown on stdout."""
    if json_path:
        Path(json_path).write_text(json.dumps(summary, indent=1) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(markdown(summary))
    print(markdown(summary))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Chrome trace from torch.profiler (profile_steps_A-B.trace.json)")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps in the trace")
    parser.add_argument("--micro-batches", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--json", help="write the summary here")
    parser.add_argument("--markdown", help="write the markdown summary here")
    args = parser.parse_args(argv)
    write(summarize(json.loads(Path(args.trace).read_text()), args.steps, args.micro_batches), args.json, args.markdown)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
