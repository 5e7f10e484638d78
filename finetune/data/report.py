"""`DataReport`: what loading read, kept, dropped and skipped, and its one-line summary for the console."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from finetune.core.labels import IGNORE_INDEX

FIELDS = {"reasoning": "reasoning", "tool_calls": "tool calls", "content": "text"}


@dataclass
class DataReport:
    source: str = ""
    format: str = ""
    rows_read: int = 0
    rows_kept: int = 0
    truncated: int = 0
    dropped_over_length: int = 0
    dropped_no_supervised_tokens: int = 0
    bad_rows_skipped: int = 0
    first_skipped: list[str] = field(default_factory=list)  # where and why of the first skipped bad rows
    tokens: int = 0  # input tokens over the kept rows
    target_tokens: int = 0  # supervised targets after the causal shift
    streamed: bool = False  # data.streaming: rows are read as training goes, counts unknown at start
    skipped_files: list[str] = field(default_factory=list)  # a folder's files that are not data files
    turn_rows: str = "conversation"  # data.turn_rows
    # trained assistant turns that carry reasoning / tool calls, those the template drops, those dropped as last turn
    carried: Counter = field(default_factory=Counter)
    dropped: Counter = field(default_factory=Counter)
    dropped_last: Counter = field(default_factory=Counter)
    stop_appended: str | None = None  # the token appended after last turns the template ends with none (GLM)
    stop_rows: int = 0
    # the other data.turn_rows: its rows and targets where they differ, and this one's for the same conversations
    other: Counter = field(default_factory=Counter)

    def count_turns(self, located) -> None:
        """What one row's trained turns carry and what the template dropped of it (chat_spans.Located)."""
        if located is None:
            return
        for which in FIELDS:
            for dropped, last in located.trained_fields(which):
                self.carried[which] += 1
                self.dropped[which] += dropped
                self.dropped_last[which] += dropped and last
        if located.appended is not None:
            self.stop_appended, self.stop_rows = located.appended, self.stop_rows + 1

    def count_rows(self, key: str, labels: list[int] | None, max_length: int, truncation: str) -> None:
        """A row of either data.turn_rows for the comparison on the data line (`key`: "other" for the other's rows,
        "same" for this one's rows of the same conversations), after data.max_length as loading applies it."""
        if labels is None or len(labels) > max_length and truncation == "drop":
            return
        targets = sum(1 for label in labels[1:max_length] if label != IGNORE_INDEX)
        if targets:
            self.other[f"{key}_rows"] += 1
            self.other[f"{key}_targets"] += targets

    def other_figures(self) -> str:
        """The other data.turn_rows' rows and targets, where it differs from this one."""
        if not self.other:
            return ""
        other = "per_turn" if self.turn_rows == "conversation" else "conversation"
        rows = self.rows_kept - self.other["same_rows"] + self.other["other_rows"]
        targets = self.target_tokens - self.other["same_targets"] + self.other["other_targets"]
        return f"; data.turn_rows={other} would give {rows:,} rows, {targets:,} targets"

    def notes(self) -> list[str]:
        """Said once at start-up: what the chat template drops of what the rows carry, and a stop token appended."""
        lines = []
        for which, what in FIELDS.items():
            if not self.dropped[which]:
                continue
            pronoun = "them" if which == "tool_calls" else "it"
            fix = f"give a template that renders {pronoun} (data.chat_template)"
            if which == "reasoning" and self.turn_rows == "conversation" and not self.dropped_last[which]:
                fix = "data.turn_rows=per_turn trains each turn with its own (the template renders a last turn's)"
            lines.append(
                f"the chat template drops the {what} of {self.dropped[which]:,} of the {self.carried[which]:,} "
                f"trained assistant turns that carry {pronoun}: they train without {pronoun}; {fix}"
            )
        if self.stop_rows:
            lines.append(
                f"the chat template ends an assistant turn where the next turn's {self.stop_appended} begins, and "
                f"renders nothing after a conversation's last turn: {self.stop_appended} is appended there and "
                f"trained in {self.stop_rows:,} rows, so the model learns to stop"
            )
        return lines

    def summary(self) -> str:
        if self.streamed:
            return f"{self.source} ({self.format}), streamed: rows are read, tokenized and labelled as training goes"
        counts = [
            (self.truncated, "truncated"),
            (self.dropped_over_length, "dropped over data.max_length"),
            (self.dropped_no_supervised_tokens, "dropped without targets"),
            (self.bad_rows_skipped, "bad skipped"),
        ]
        extra = "".join(f", {n:,} {what}" for n, what in counts if n)
        if self.first_skipped:  # which rows, so a skip is never silent
            more = ", …" if self.bad_rows_skipped > len(self.first_skipped) else ""
            extra += f"; skipped: {'; '.join(self.first_skipped)}{more}"
        if self.skipped_files:  # said, never skipped in silence
            names = ", ".join(self.skipped_files[:3]) + (", …" if len(self.skipped_files) > 3 else "")
            extra += f"; {len(self.skipped_files)} other file(s) in the folder not read ({names})"
        kept = f"{self.rows_kept:,} of {self.rows_read:,} rows kept"
        if self.turn_rows == "per_turn":
            kept = f"{self.rows_kept:,} rows, one per trained assistant turn, from {self.rows_read:,} rows"
        return (
            f"{self.source} ({self.format}): {kept}{extra}; "
            f"{self.tokens:,} tokens, {self.target_tokens:,} targets{self.other_figures()}"
        )
