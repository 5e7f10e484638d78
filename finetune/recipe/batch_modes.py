"""The batching modes as one table, and one set's batching settings (`Batching`): training's come from `data.*` and
`train.micro_batch_size`, the eval set's from `eval.*`. Every place that asks what a mode does reads it here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    packs: bool  # rows concatenated into one, position ids restarting (else padded to the micro-batch's longest)
    groups_by_length: bool  # rows of similar length share a micro-batch (the Trainer's LengthGroupedSampler)
    budget: str  # "no" | "optional" | "required": micro-batches filled up to max_tokens_per_micro_batch


MODES = {
    "padded": Mode(packs=False, groups_by_length=False, budget="no"),
    "length_grouped": Mode(packs=False, groups_by_length=True, budget="no"),
    "token_budget": Mode(packs=False, groups_by_length=False, budget="required"),  # rows × padded length ≤ budget
    "packed": Mode(packs=True, groups_by_length=False, budget="optional"),  # real tokens ≤ budget, when one is set
}


@dataclass(frozen=True)
class Batching:
    """How one set's rows become micro-batches. `section`: the recipe section its keys live in (data or eval)."""

    mode: str
    rows_per_micro_batch: int  # when not budgeted
    max_tokens: int | None  # max_tokens_per_micro_batch
    section: str = "data"

    @property
    def budgeted(self) -> bool:
        """Micro-batches filled up to `max_tokens` rather than a fixed row count (formed once, up front)."""
        budget = MODES[self.mode].budget
        return budget == "required" or (budget == "optional" and bool(self.max_tokens))

    @property
    def packs(self) -> bool:
        return MODES[self.mode].packs

    @property
    def counts_padding(self) -> bool:
        """A budgeted micro-batch costs rows × its longest row (padded), not the sum of its rows (packed)."""
        return not self.packs

    @property
    def groups_by_length(self) -> bool:
        return MODES[self.mode].groups_by_length

    @property
    def needs_lengths_up_front(self) -> bool:
        """Sorting or budgeting by length: impossible for a stream, whose rows are not known up front."""
        return self.budgeted or self.groups_by_length
