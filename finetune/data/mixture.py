"""data.mixture: several sources drawn into one training set at chosen shares.

Each source is read, tokenized and labelled as data.source would be (its own format, loss_on and split where it sets
them), less the rows eval.fraction holds out of it. The set has as many rows as all the sources' kept rows together;
a source of weight w contributes round(w / Σw × that) of them: whole passes over its rows, then a seeded sample of
them for the rest (seeded by train.seed and its name, so a run and its resume draw the same rows). The Trainer's
sampler then shuffles the whole set as it shuffles any other.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from finetune.data.report import DataReport
from finetune.data.row_kinds import RowKind
from finetune.data.training_set import load_training_set
from finetune.recipe import DataConfig, RecipeError, mixture_names


@dataclass
class MixtureReport:
    parts: list[tuple[str, DataReport, int, float]]  # (name, what loading kept, rows drawn, the weight's share)

    def summary(self) -> str:
        drawn = "; ".join(
            f"{name}: {rows:,} rows drawn ({share:.0%}) = {rows / report.rows_kept:.2f} passes over its "
            f"{report.rows_kept:,}"
            for name, report, rows, share in self.parts
        )
        each = "; ".join(report.summary() for _, report, _, _ in self.parts)
        return f"mixture of {len(self.parts)} sources: {drawn} [{each}]"

    def notes(self) -> list[str]:
        return [f"{name}: {line}" for name, report, _, _ in self.parts for line in report.notes()]


def drawn_counts(sizes: list[int], weights: list[float]) -> list[int]:
    """Rows drawn from each source: the weights' shares of all kept rows, rounded so they add up (largest
    remainders first)."""
    total, whole = sum(sizes), sum(weights)
    exact = [total * w / whole for w in weights]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: counts[k] - exact[k])
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


def drawn_rows(size: int, count: int, seed: int, name: str) -> list[int]:
    """`count` row indices of a source of `size` rows: whole passes, then a seeded sample without repeats."""
    passes, rest = divmod(count, size)
    return list(range(size)) * passes + sorted(random.Random(f"data.mixture {seed} {name}").sample(range(size), rest))


def part_data(data: DataConfig, part) -> DataConfig:
    """The data keys one source is read with: data.* with its own source and what it sets itself."""
    return dataclasses.replace(
        data,
        source=part.source,
        format=part.format or data.format,
        loss_on=part.loss_on or data.loss_on,
        split=part.split or data.split,
        mixture=[],
    )


def load_mixture(data: DataConfig, fraction: float, seed: int, tokenizer, rows: RowKind):
    """(the mixed training dataset, its MixtureReport, {name: rows held out of that source} or None)."""
    import datasets

    if rows.images:
        raise RecipeError("data.mixture mixes text sources; an image+text recipe reads one data.source")
    names, loaded, held = mixture_names(data), [], {}
    for name, part in zip(names, data.mixture):
        dataset, report, held_out = load_training_set(part_data(data, part), fraction, seed, tokenizer, rows)
        loaded.append((dataset, report))
        if held_out is not None:
            held[name] = held_out
    weights = [part.weight for part in data.mixture]
    counts = drawn_counts([len(d) for d, _ in loaded], weights)
    chosen = [d.select(drawn_rows(len(d), n, seed, name)) for (d, _), n, name in zip(loaded, counts, names)]
    shares = [w / sum(weights) for w in weights]
    report = MixtureReport([(name, r, n, s) for name, (_, r), n, s in zip(names, loaded, counts, shares)])
    return datasets.concatenate_datasets(chosen), report, held or None
