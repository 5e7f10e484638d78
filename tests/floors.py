"""The floor of a low precision's own arithmetic, measured: the independent brute force (one sequence at a time,
unpadded) with its forward under autocast, against float64. The bf16/fp16 exactness tests (CPU and GPU) may not be
much worse than it."""

import torch
import torch.nn.functional as F

from finetune.core.labels import IGNORE_INDEX
from finetune.testing.reference import reference_gradient, relative_error
from finetune.testing.toy import model_at


def autocast_brute_force_error(initial, snapshot, window, dtype, device: str = "cpu") -> float:
    """Relative error vs float64 of the token-mean gradient computed one sequence at a time under autocast (the floor
    of that precision's own arithmetic) on `device`."""
    model = model_at(initial, snapshot)
    expected, _ = reference_gradient(model, window)
    model = model.to(device)
    total, count = torch.zeros((), device=device), 0
    for seq in window:
        ids, labels = (torch.as_tensor(seq[k]).to(device) for k in ("input_ids", "labels"))
        with torch.autocast(device, dtype=dtype):
            logits = model(input_ids=ids[None]).logits[0, :-1]
        keep = labels[1:] != IGNORE_INDEX
        total = total + F.cross_entropy(logits[keep].float(), labels[1:][keep], reduction="sum")
        count += int(keep.sum())
    (total / count).backward()
    return relative_error({n: p.grad.cpu().double() for n, p in model.named_parameters()}, expected)
