"""`DataReport`: what loading read, kept, dropped and skipped, and its one-line summary for the console."""

from __future__ import annotations

from dataclasses import dataclass, field


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
        return (
            f"{self.source} ({self.format}): {self.rows_kept:,} of {self.rows_read:,} rows kept{extra}; "
            f"{self.tokens:,} tokens, {self.target_tokens:,} targets"
        )
