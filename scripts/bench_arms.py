"""The arms of scripts/benchmark.py: their names, what each configures, the preset sets, and why one cannot run here.

An arm name is a base and modifiers joined by `+`: `trl_packing+flex+liger+bf16w` is TRL's SFTTrainer with
best-fit-decreasing packing, flex_attention, `use_liger_kernel=True` and bf16 weights. Modifiers: `flex`
(flex_attention) or `flash` (flash_attention_2) for the peers' attention (default sdpa), `liger` (the peers'
`use_liger_kernel=True`), `bf16w` (weights built in bfloat16, not float32; ours: the recipe's model.dtype=bfloat16),
`window` (ours, on a mixture of experts: the router balancing loss over the whole window, train.moe_balance=window;
without it, micro).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

TRAINER = ("hf_padded", "hf_flatten")  # transformers.Trainer
TRL = ("trl_padding_free", "trl_packing")  # TRL's SFTTrainer
OURS = ("padded", "length_grouped", "token_budget", "packed")  # finetune.assemble.build
AFTER_LIGER = "packed_after_liger"  # ours, packed, in a process where Liger's Llama patches were applied first
# today's arms, as shipped: the peers with their defaults (sdpa, float32 weights, no Liger)
SHIPPED = (
    "hf_padded",
    "hf_flatten",
    "hf_flatten_flash",
    "padded",
    "length_grouped",
    "token_budget",
    "packed",
    "trl_padding_free",
    "trl_packing",
    "hand_loop",
)
ALIASES = {"hf_flatten_flash": "hf_flatten+flash"}
ATTENTION = {"flex": "flex_attention", "flash": "flash_attention_2"}
BATCHING = {
    "hf_padded": "padded (DataCollatorForSeq2Seq)",
    "hf_flatten": "padding-free rows (DataCollatorWithFlattening)",
    "trl_padding_free": "padding-free rows (padding_free=True)",
    "trl_packing": "best-fit-decreasing packing into one row of the token budget",
    "hand_loop": "hf_padded's micro-batches, replayed",
    AFTER_LIGER: "packed",
}
PEERS = ("hf_flatten", "trl_padding_free", "trl_packing")  # the tuned variants are built on these
TUNED_PEERS = ("+flex+liger", "+flex+liger+bf16w", "+flash+liger+bf16w")


@dataclass(frozen=True)
class Arm:
    name: str
    base: str
    attention: str | None = None  # None: the recipe's (ours) or sdpa (the peers)
    liger: bool = False
    bf16_weights: bool = False
    window_balance: bool = False

    @property
    def family(self) -> str:
        if self.base in OURS or self.base == AFTER_LIGER:
            return "ours"
        return "trainer" if self.base in TRAINER else "trl" if self.base in TRL else "hand"

    @property
    def is_peer(self) -> bool:
        return self.family in ("trainer", "trl")

    def configuration(self) -> dict:
        return {
            "attention": self.attention
            or ("recipe (sdpa, per-sequence on packed rows)" if self.family == "ours" else "sdpa"),
            "liger": self.liger or self.base == AFTER_LIGER,
            "weights": "bfloat16" if self.bf16_weights else "float32",
            "batching": BATCHING.get(self.base, f"ours: data.batching={self.base}"),
            **({"moe_balance": "window"} if self.window_balance else {}),
        }


def parse(name: str) -> Arm:
    """The arm a name means; ValueError (one line) for a name that means none."""
    base, *modifiers = ALIASES.get(name, name).split("+")
    known = (*TRAINER, *TRL, *OURS, AFTER_LIGER, "hand_loop")
    if base not in known:
        raise ValueError(f"unknown arm {name!r}: the base must be one of {', '.join(known)}")
    ours = {"bf16w", "window"}
    allowed = ours if base in (*OURS, AFTER_LIGER) else set() if base == "hand_loop" else {"bf16w", "liger", *ATTENTION}
    bad = [m for m in modifiers if m not in allowed] + [m for m in set(modifiers) if modifiers.count(m) > 1]
    if bad or len(set(modifiers) & set(ATTENTION)) > 1:
        raise ValueError(f"arm {name!r}: {base} takes at most one of each of {', '.join(sorted(allowed)) or 'nothing'}")
    attention = next((ATTENTION[m] for m in modifiers if m in ATTENTION), None)
    return Arm(name, base, attention, "liger" in modifiers, "bf16w" in modifiers, "window" in modifiers)


def has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def unavailable(arm: Arm, cuda: bool) -> str | None:
    """Why the arm cannot run on this machine (None: it can)."""
    if arm.family == "trl" and not has("trl"):
        return "needs trl (pip install trl)"
    if arm.attention == "flash_attention_2":
        from transformers.utils import is_flash_attn_2_available

        if not (cuda and is_flash_attn_2_available()):
            return "flash_attention_2 needs flash-attn installed and a CUDA device"
    if arm.attention == "flex_attention" and not cuda:
        return "flex_attention: torch's FlexAttention has no backward on a CPU"
    if arm.liger or arm.base == AFTER_LIGER:
        if not has("liger_kernel"):
            return "needs liger-kernel (pip install liger-kernel)"
        if not cuda:
            return "Liger's Triton kernels need a CUDA device"
    return None


def fallback(name: str, cuda: bool) -> str:
    """The nearest runnable variant of a tuned peer arm: flash → flex → sdpa, then without Liger."""
    arm = parse(name)
    steps = [("+flash", "+flex"), ("+flex", ""), ("+liger", "")]
    while unavailable(arm, cuda) is not None and steps:
        old, new = steps.pop(0)
        name = name.replace(old, new, 1)
        arm = parse(name)
    return name


def preset(peers: str, cuda: bool) -> list[str]:
    """The arm names of `--peers shipped|tuned|all` (unavailable ones included: the caller reports them skipped). The
    tuned set runs the headline arms first (a run cut short by --time-limit keeps them)."""
    tuned_peers = [base + suffix for base in reversed(PEERS) for suffix in TUNED_PEERS]
    ours = ["packed", AFTER_LIGER, "packed+bf16w", "token_budget"]
    if peers == "shipped":
        return list(SHIPPED)
    if peers == "tuned":  # what cannot run here is listed, and its nearest runnable variant runs instead
        names = ours[:2] + [n for t in tuned_peers for n in (t, fallback(t, cuda))] + ours[2:]
        return list(dict.fromkeys(names))
    every = [base + a + liger + w for base in PEERS for a in ("", "+flex", "+flash") for liger in ("", "+liger")
             for w in ("", "+bf16w")]  # fmt: skip
    return list(dict.fromkeys([*SHIPPED, *ours, *every]))


def arm_set(arms: str | None, peers: str, cuda: bool) -> tuple[list[Arm], dict[str, str]]:
    """(every arm asked for, in order; {arm: why it cannot run here}). ValueError for an unknown name or a set whose
    hand_loop has no hf_padded to replay."""
    names = arms.split(",") if arms else preset(peers, cuda)
    chosen = [parse(n) for n in dict.fromkeys(names)]
    skipped = {a.name: why for a in chosen if (why := unavailable(a, cuda)) is not None}
    runnable = [a.name for a in chosen if a.name not in skipped]
    if "hand_loop" in runnable and "hf_padded" not in runnable:
        raise ValueError("hand_loop replays hf_padded's micro-batches: include hf_padded")
    return chosen, skipped
