"""Independent brute force for exactness tests: float64, unpadded, one sequence at a time.

It shares no code with finetune/: the loss is written out here with the plain definition
(mean over every target token of the window of -log softmax(logits[t])[labels[t + 1]]).
"""

import copy

import torch


def reference_gradient(model, sequences, forward=None, shift=True, label_smoothing=0.0):
    """Token-mean next-token cross-entropy gradient over `sequences` (dicts of 1-D input_ids/labels[, extra]).

    Returns ({name: float64 grad}, float64 loss). `forward(model, seq)` returns [1, T, V] logits for one sequence.
    shift=False: position t predicts labels[t] (masked LM, token classification, a seq2seq decoder's logits).
    label_smoothing ε: each target's loss is (1 − ε)·(−log p[target]) + ε·mean over classes of (−log p).
    """
    ref = copy.deepcopy(model).to(torch.float64)
    ref.train()
    for module in ref.modules():  # dropout off: the reference is the deterministic gradient
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    ref.zero_grad(set_to_none=True)
    total_loss = torch.zeros((), dtype=torch.float64)
    total_targets = 0
    per_sequence = []
    for seq in sequences:
        ids = torch.as_tensor(seq["input_ids"]).unsqueeze(0)
        labels = torch.as_tensor(seq["labels"])
        logits = forward(ref, seq) if forward else ref(input_ids=ids)["logits"]  # ModelOutput or dict
        logits = logits[0].to(torch.float64)
        seq_loss = torch.zeros((), dtype=torch.float64)
        offset = 1 if shift else 0
        for t in range(len(labels) - offset):
            target = int(labels[t + offset])
            if target == -100:
                continue
            log_p = torch.log_softmax(logits[t], dim=-1)
            seq_loss = seq_loss - (1 - label_smoothing) * log_p[target] - label_smoothing * log_p.mean()
            total_targets += 1
        per_sequence.append(seq_loss)
    total_loss = torch.stack(per_sequence).sum()
    if total_targets == 0:
        return {n: torch.zeros_like(p) for n, p in ref.named_parameters()}, 0.0
    mean_loss = total_loss / total_targets
    mean_loss.backward()
    grads = {
        name: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().clone()
        for name, p in ref.named_parameters()
    }
    return grads, float(mean_loss.detach())


def relative_error(applied: dict, reference: dict) -> float:
    num = sum(float(((applied[n].double() - reference[n]) ** 2).sum()) for n in reference)
    den = sum(float((reference[n] ** 2).sum()) for n in reference)
    return (num / den) ** 0.5
