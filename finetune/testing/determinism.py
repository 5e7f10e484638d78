"""Whether a model's training forward gives the same output twice for the same input, and making it do so for a check.

verify compares one training step with a brute force that runs each sequence alone; a forward that draws at random
(dropout is switched off beforehand: finetune/testing/reference.py's silence_dropout) would make it compare two
draws. A shared seed cannot make the draws match: the brute force runs every sequence alone while training runs
padded or packed micro-batches, so the two draw different numbers of values in different shapes. So:

- `random_modules`: the same micro-batch through the model twice, the random state running on between the calls
  (under `torch.random.fork_rng`, so training draws what it would have drawn), every module's inputs and output
  fingerprinted; a module whose inputs were the same both times and whose output was not draws at random. Of nested
  ones the innermost is kept (a mixture-of-experts block is random through its router).
- `run_as_in_evaluation`: such a module runs in evaluation mode in every forward from then on (its own `training`
  and its submodules' set off just before each call, so the trainer's `model.train()` does not undo it): PhiMoE's
  router then takes its top-k instead of sampling, in the trained model and the reference alike.
- `make_deterministic`: both, repeated while new random modules show; what is random in evaluation mode too is
  refused with `NotDeterministic`, naming the modules.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

import torch

ROUNDS = 4  # each round puts the innermost random modules in evaluation mode; their parents show in the next one


class NotDeterministic(Exception):
    """The training forward is random even with its random modules in evaluation mode."""


SAMPLES = 1024  # elements of each tensor compared one by one (evenly spaced), beside its sums


def fingerprint(value) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per tensor in `value` (nested tuples, lists, dicts, ModelOutputs), on the host: (up to SAMPLES evenly spaced
    elements in float64, [sum, 2-norm, sum of every other element] in float32). Dropout or a sampled routing changes
    many elements, so the samples show it undiluted; a few changed elements move the sums."""
    if isinstance(value, torch.Tensor):
        if value.is_complex() or value.numel() == 0:
            return []
        x = value.detach().reshape(-1).float()  # float32 reductions: fast, and alike for alike inputs
        sums = torch.stack([x.sum(), torch.linalg.vector_norm(x), x[::2].sum()])
        return [(x[:: max(1, x.numel() // SAMPLES)][:SAMPLES].double().cpu(), sums.double().cpu())]
    if isinstance(value, Mapping):
        return [part for key in value for part in fingerprint(value[key])]
    if isinstance(value, (tuple, list)):
        return [part for item in value for part in fingerprint(item)]
    return []


def _apart(a: torch.Tensor, b: torch.Tensor, threshold: float) -> bool:
    if a.shape != b.shape:
        return True
    if not (a.isfinite().all() and b.isfinite().all()):
        return not torch.equal(a.nan_to_num(), b.nan_to_num())
    return bool((a - b).abs().max() > threshold * max(float(a.abs().max()), 1e-30))


def differs(first: list, second: list, threshold: float) -> bool:
    """Whether two fingerprints differ: a tensor's samples or sums by more than `threshold` × their largest magnitude
    (what a kernel's non-deterministic order of summation changes stays below it)."""
    if len(first) != len(second):
        return True
    return any(_apart(a, b, threshold) for x, y in zip(first, second) for a, b in zip(x, y))


def traced_forward(model, inputs: Mapping) -> dict[str, list[tuple[list[float], list[float]]]]:
    """Module name → per call, (fingerprint of its inputs, of its output), of one no-grad forward of `inputs`."""
    calls: dict[str, list] = defaultdict(list)
    pending: dict[str, list] = defaultdict(list)
    handles = []
    for name, module in model.named_modules():

        def before(m, args, kwargs, name=name):
            pending[name].append(fingerprint((args, kwargs)))  # before the call: it may change its input in place

        def after(m, args, kwargs, output, name=name):
            calls[name].append((pending[name].pop(), fingerprint(output)))

        handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return calls


def random_modules(model, inputs: Mapping, threshold: float) -> list[str]:
    """The innermost modules whose output differed between two identical calls on the same inputs ("" for the
    model itself); [] where the forward gave the same twice."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=devices):
        first, second = traced_forward(model, inputs), traced_forward(model, inputs)
    random = []
    for name, calls in first.items():
        again = second.get(name, [])
        if len(again) != len(calls):  # called a different number of times: its caller is what is random
            continue
        same_inputs = all(not differs(a[0], b[0], threshold) for a, b in zip(calls, again))
        if same_inputs and any(differs(a[1], b[1], threshold) for a, b in zip(calls, again)):
            random.append(name)
    return [n for n in random if not any(o != n and (n == "" or o.startswith(n + ".")) for o in random)]


def _evaluation_mode(module, args) -> None:
    for m in module.modules():
        m.training = False


def run_as_in_evaluation(module) -> None:
    """`module` (and what it holds) in evaluation mode in every call from now on, whatever model.train() sets."""
    module.register_forward_pre_hook(_evaluation_mode)
    _evaluation_mode(module, ())


def make_deterministic(model, inputs: Mapping, threshold: float) -> list[str]:
    """Put every module of `model` whose training forward draws at random in evaluation mode (run_as_in_evaluation);
    the names of those modules ([] where the forward was deterministic). Raises NotDeterministic with the names of
    those that are random in evaluation mode too."""
    named = dict(model.named_modules())
    evaluating: list[str] = []
    for _ in range(ROUNDS):
        random = random_modules(model, inputs, threshold)
        if not random:
            return evaluating
        if still := [n for n in random if any(e in ("", n) or n.startswith(e + ".") for e in evaluating)]:
            raise NotDeterministic(still)
        kinds = {type(named[name]) for name in random}  # the same code draws alike wherever it runs
        for name, module in named.items():
            if type(module) in kinds and name not in evaluating:
                run_as_in_evaluation(module)
                evaluating.append(name)
    raise NotDeterministic(random_modules(model, inputs, threshold) or evaluating)


def describe(model, names: list[str]) -> str:
    """`Class (path, …)` per module class among `names`, at most three paths each."""
    named = dict(model.named_modules())
    by_class: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by_class[type(named[name]).__name__].append(name or "the model itself")
    parts = []
    for cls, paths in by_class.items():
        shown = ", ".join(paths[:3]) + (f", … {len(paths)} in all" if len(paths) > 3 else "")
        parts.append(f"{cls} ({shown})")
    return "; ".join(parts)
