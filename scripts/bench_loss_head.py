"""The LM head's summed cross-entropy, forward + backward, three ways: error against float64, peak memory, time.

    OMP_NUM_THREADS=2 python scripts/bench_loss_head.py [--json head.json]          # CPU: a few minutes
    python scripts/bench_loss_head.py --device cuda --json head.json                  # GPU: more tokens and hiddens
    python scripts/bench_loss_head.py --quick                                         # tests: toy sizes

Arms, each `loss = f(hidden [N, H], weight [V, H], targets [N])` then `loss.backward()`:
- ours:  `finetune.core.loss.head_cross_entropy_sum` (the project's head, whatever it does inside);
- torch: `torch.nn.functional.linear_cross_entropy(reduction="sum", ignore_index=-100,
  options=torch.nn.LinearCrossEntropyOptions())` (the chunked path, torch's own defaults); skipped where torch lacks it;
- plain: `F.cross_entropy((hidden @ weight.T).float(), targets, reduction="sum")`: the [N, V] logits, as HF models do.

Precisions: fp32 (fp32 leaves); bf16 (hidden and weight are bf16 leaves, as under ZeRO's bf16 weights); autocast
(fp32 leaves under `torch.autocast(dtype=bfloat16)`, as a trainer's forward runs). Inputs: hidden ~ N(0, 1), weight ~
N(0, 4/H) (logits of standard deviation 2), uniform targets; every input value is rounded to bf16 first, so one float64
reference (logits, softmax and both gradients written out here, chunked) is exact for every precision: errors are the
arm's own, not the rounding of its inputs. Relative error: |loss − ref| / |ref|, ‖grad − ref‖ / ‖ref‖ (Frobenius).

Peak memory is above the inputs (the gradients of hidden and weight included, which every arm allocates), measured by
scripts/bench_measure.py's `PeakMemory`, as benchmark.py measures. CUDA:
`max_memory_allocated` after `reset_peak_memory_stats`, all arms in this process. CPU: each arm runs in a fresh process
(multiprocessing, spawn) whose resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs after the
inputs and a warm-up exist) is read after its timed passes. Why RSS: torch's CPU tensors come from malloc/mmap, which
tracemalloc does not see; large blocks are mmapped and returned on free, so the high-water mark follows the live
tensors; a fresh process keeps earlier arms' heap out. Time: median of --repeats passes after a warm-up pass on the
first 256 rows (CUDA: synchronised before and after each pass).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from bench_measure import PeakMemory  # scripts/: the memory meter benchmark.py measures with

ARMS = ("ours", "torch", "plain")
PRECISIONS = ("fp32", "bf16", "autocast")
VOCABS = (49152, 151936)


def has_torch_op() -> bool:
    return hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")


def make_inputs(tokens: int, hidden: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 hidden [N, H], weight [V, H] whose values are all bf16-representable, int64 targets [N]; on the CPU."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, hidden, generator=g).bfloat16().float()
    w = (torch.randn(vocab, hidden, generator=g) * (2 / hidden**0.5)).bfloat16().float()
    return h, w, torch.randint(0, vocab, (tokens,), generator=g)


def reference(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, chunk: int = 256) -> dict[str, torch.Tensor]:
    """Float64 loss sum and gradients, written out: d loss / d logits = softmax − one_hot."""
    h64, w64 = h.double(), w.double()
    loss = torch.zeros((), dtype=torch.float64, device=h.device)
    grad_h, grad_w = torch.empty_like(h64), torch.zeros_like(w64)
    for s in range(0, h.shape[0], chunk):
        logits = h64[s : s + chunk] @ w64.t()
        target = t[s : s + chunk]
        log_norm = torch.logsumexp(logits, dim=-1)
        loss += (log_norm - logits.gather(1, target[:, None]).squeeze(1)).sum()
        p = (logits - log_norm[:, None]).exp_()
        p[torch.arange(target.numel(), device=p.device), target] -= 1
        grad_h[s : s + chunk] = p @ w64
        grad_w += p.t() @ h64[s : s + chunk]
    return {"loss": loss.cpu(), "hidden": grad_h.cpu(), "weight": grad_w.cpu()}


def arm_fn(arm: str):
    if arm == "ours":
        from finetune.core.loss import head_cross_entropy_sum  # the public function only: its inside may change

        return lambda h, w, t: head_cross_entropy_sum(h, w, None, t, 0.0)[0]
    if arm == "torch":
        options = torch.nn.LinearCrossEntropyOptions()
        return lambda h, w, t: F.linear_cross_entropy(h, w, t, reduction="sum", ignore_index=-100, options=options)
    return lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t, reduction="sum", ignore_index=-100)


def relative(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double().cpu(), ref.double()
    return float((a - ref).norm() / ref.norm())


def run_arm(spec: dict) -> dict:
    """One arm at one size and precision: time, peak memory, errors against the reference saved at spec['ref']."""
    torch.set_num_threads(spec["threads"])
    device = torch.device(spec["device"])
    h0, w0, t = make_inputs(spec["tokens"], spec["hidden"], spec["vocab"], spec["seed"])
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    h = h0.to(device, dtype).requires_grad_()
    w = w0.to(device, dtype).requires_grad_()
    t = t.to(device)
    del h0, w0
    fn = arm_fn(spec["arm"])
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec["precision"] == "autocast"
        else contextlib.nullcontext()
    )

    def step(rows: int | None = None):
        h.grad = w.grad = None
        with autocast:
            loss = fn(h[:rows] if rows else h, w, t[:rows] if rows else t)
        loss.backward()
        return loss

    step(rows=256)  # warm-up: kernels picked, libraries loaded
    h.grad = w.grad = None
    peak = PeakMemory(cuda=device.type == "cuda")
    peak.start()
    times = []
    for _ in range(spec["repeats"]):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak_mib = peak.peak_mb()
    ref = torch.load(spec["ref"], weights_only=True)
    return {
        **{k: spec[k] for k in ("arm", "precision", "vocab", "hidden", "tokens")},
        "ms": 1000 * statistics.median(times),
        "peak_mib": peak_mib,
        "loss_error": abs(float(loss.detach().double()) - float(ref["loss"])) / abs(float(ref["loss"])),
        "grad_hidden_error": relative(h.grad, ref["hidden"]),
        "grad_weight_error": relative(w.grad, ref["weight"]),
        "loss_dtype": str(loss.dtype).removeprefix("torch."),
    }


def in_fresh_process(spec: dict) -> dict:
    """run_arm in a spawned interpreter, so that its resident set holds this arm alone."""
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:
        return pool.apply(run_arm, (spec,))


def measure(args) -> list[dict]:
    rows, device = [], torch.device(args.device)
    arms = [a for a in args.arms if a != "torch" or has_torch_op()]
    with tempfile.TemporaryDirectory(prefix="loss-head-") as scratch:
        for vocab in args.vocab:
            for hidden in args.hidden:
                h, w, t = make_inputs(args.tokens, hidden, vocab, args.seed)
                started = time.perf_counter()
                ref_path = str(Path(scratch) / f"ref-{vocab}-{hidden}.pt")
                torch.save(reference(h.to(device), w.to(device), t.to(device)), ref_path)
                del h, w, t
                print(
                    f"V={vocab} H={hidden} N={args.tokens}: float64 reference {time.perf_counter() - started:.1f} s",
                    flush=True,
                )
                for precision in args.precision:
                    for arm in arms:
                        spec = dict(
                            arm=arm,
                            precision=precision,
                            vocab=vocab,
                            hidden=hidden,
                            tokens=args.tokens,
                            seed=args.seed,
                            device=args.device,
                            threads=args.threads,
                            repeats=args.repeats,
                            ref=ref_path,
                        )
                        row = run_arm(spec) if device.type == "cuda" else in_fresh_process(spec)
                        rows.append(row)
                        print(format_row(row), flush=True)
    if "torch" in args.arms and not has_torch_op():
        print(f"torch {torch.__version__} has no F.linear_cross_entropy: the torch arm was skipped")
    return rows


HEADER = (
    f"{'vocab':>7} {'hidden':>6} {'tokens':>6} {'precision':<9} {'arm':<6} {'ms':>9} {'peak MiB':>9} "
    f"{'loss err':>9} {'dh err':>9} {'dW err':>9}"
)


def format_row(r: dict) -> str:
    return (
        f"{r['vocab']:>7} {r['hidden']:>6} {r['tokens']:>6} {r['precision']:<9} {r['arm']:<6} {r['ms']:>9.1f} "
        f"{r['peak_mib']:>9.0f} {r['loss_error']:>9.1e} {r['grad_hidden_error']:>9.1e} "
        f"{r['grad_weight_error']:>9.1e}"
    )


def parse_args(argv: list[str]) -> argparse.Namespace:
    def ints(text: str) -> list[int]:
        return [int(x) for x in text.split(",")]

    def choices(allowed):
        def parse(text: str) -> list[str]:
            picked = text.split(",")
            if set(picked) - set(allowed):
                raise argparse.ArgumentTypeError(f"choose from {', '.join(allowed)}")
            return picked

        return parse

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="toy sizes (tests): 64 tokens, hidden 32, vocab 1000")
    parser.add_argument("--tokens", type=int, help="N: rows of hidden states (default CPU 2048, CUDA 8192)")
    parser.add_argument("--hidden", type=ints, help="comma-separated (default CPU 576, CUDA 576,1536)")
    parser.add_argument("--vocab", type=ints, help="comma-separated (default 49152,151936)")
    parser.add_argument("--precision", type=choices(PRECISIONS), default=list(PRECISIONS))
    parser.add_argument("--arms", type=choices(ARMS), default=list(ARMS))
    parser.add_argument("--repeats", type=int, help="timed passes per arm, median kept (default CPU 1, CUDA 5)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write {device, torch, memory, rows: [...]} here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible to torch")
    if args.quick:
        args.tokens, args.hidden, args.vocab = args.tokens or 64, args.hidden or [32], args.vocab or [1000]
    args.tokens = args.tokens or (8192 if cuda else 2048)
    args.hidden = args.hidden or ([576, 1536] if cuda else [576])
    args.vocab = args.vocab or list(VOCABS)
    args.repeats = args.repeats or (5 if cuda else 1)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} thread(s)"
    memory = (
        "CUDA max_memory_allocated above the inputs"
        if args.device == "cuda"
        else "CPU resident-set high-water mark above the inputs, one fresh process per arm"
    )
    print(f"{device}; torch {torch.__version__}; N={args.tokens} tokens; peak: {memory}\n{HEADER}", flush=True)
    rows = measure(args)
    load = os.getloadavg()[0] if args.device == "cpu" else None  # others' share of a shared CPU skews the times
    print(f"\n{HEADER}\n" + "\n".join(format_row(r) for r in rows))
    if load is not None:
        print(f"load average {load:.1f} (the machine's; {os.cpu_count()} cores)")
    if args.json:
        out = {
            "device": device,
            "load_average": load,
            "torch": torch.__version__,
            "memory": memory,
            "command": " ".join(sys.argv),
            "torch_op": has_torch_op(),
            "rows": rows,
        }
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main(sys.argv[1:]))
