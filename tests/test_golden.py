"""Golden trajectories: each shipped recipe trained at debug size gives, at every optimizer step, the loss, gradient
norm, learning rate and target count recorded in tests/golden/<recipe>.json (scripts/record_golden.py wrote them; it
runs through finetune.load_config and finetune.build only, so a restructuring of the package that moves a number is
seen here). A perturbed run (the learning rate × 1.01) fails the comparison by a wide margin.

Re-record (`python scripts/record_golden.py [RECIPE]`) only for a change meant to move the numbers, and say why in
the commit (docs/contributing.md)."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = ROOT / "tests" / "golden"
spec = importlib.util.spec_from_file_location("record_golden", ROOT / "scripts" / "record_golden.py")
record_golden = importlib.util.module_from_spec(spec)
spec.loader.exec_module(record_golden)

# Measured on every recipe's run, every step (float32 values): two recordings were bit-identical; 2 torch threads
# instead of the recorder's 1 moved a value by at most 1.1e-7 (relative), torch's and MKL's AVX2 or plain (no SIMD)
# kernels instead of AVX-512 ones (ATEN_CPU_CAPABILITY, MKL_ENABLE_INSTRUCTIONS, ONEDNN_MAX_CPU_ISA: another CPU's code
# paths) by at most 2.0e-7, about 2 float32 ulps. RTOL is 5× that; the learning rate × 1.01 moves the debug run's
# loss by 1.2e-4 and its gradient norm by 1.4e-3.
RTOL = 1e-6
FLOATS = ("loss", "grad_norm", "learning_rate")


def golden(name: str) -> dict:
    return json.loads((GOLDEN_DIR / f"{name}.json").read_text())


def relative_drift(recorded: list[dict], got: list[dict]) -> dict[str, float]:
    """The largest relative difference of each float metric over the steps; the steps and their target counts must be
    the same."""
    assert [s["step"] for s in got] == [s["step"] for s in recorded], f"other steps: {got}"
    assert [s["window_label_tokens"] for s in got] == [s["window_label_tokens"] for s in recorded], f"other rows: {got}"

    def relative(want: float, have: float) -> float:
        return abs(have - want) / abs(want) if want else (0.0 if have == 0 else float("inf"))

    return {key: max(relative(r[key], g[key]) for r, g in zip(recorded, got)) for key in FLOATS}


def assert_matches(entry: dict, got: list[dict]) -> None:
    import torch
    import transformers

    drift = relative_drift(entry["steps"], got)
    now = {"torch": torch.__version__, "transformers": transformers.__version__}
    assert max(drift.values()) <= RTOL, (
        f"{entry['recipe']} moved: largest relative change {drift} > {RTOL} (recorded with {entry['recorded']}, now "
        f"{now}); got {got}. If the change meant to move it, re-record with `python scripts/record_golden.py` and say "
        "why in the commit"
    )


def test_every_shipped_recipe_has_a_golden_file_recorded_from_the_recorders_table():
    recipes = {path.stem for path in (ROOT / "recipes").glob("*.yaml")}
    assert {path.stem for path in GOLDEN_DIR.glob("*.json")} == recipes == set(record_golden.GOLDEN)
    for name, run in record_golden.GOLDEN.items():
        entry = golden(name)
        # the table edited without re-recording would check the old numbers against a new run
        assert {key: entry.get(key) for key in ("overrides", "language_model")} == {
            "overrides": run["overrides"],
            "language_model": run.get("language_model"),
        }, name
        assert len(entry["steps"]) >= 4 and {*record_golden.METRICS, "step"} == set(entry["steps"][0]), name


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(record_golden.GOLDEN))
def test_the_recipe_trains_as_recorded(name, tmp_path):
    entry = golden(name)
    assert_matches(entry, record_golden.trajectory(entry, tmp_path))


@pytest.mark.e2e
def test_a_learning_rate_one_percent_higher_fails_the_comparison(tmp_path):
    import finetune

    entry = golden("debug")
    lr = finetune.load_config(entry["overrides"]).optim.lr * 1.01
    perturbed = {**entry, "overrides": [*entry["overrides"], f"optim.lr={lr!r}"]}
    got = record_golden.trajectory(perturbed, tmp_path)
    with pytest.raises(AssertionError, match="recipes/debug.yaml moved"):
        assert_matches(entry, got)
    drift = relative_drift(entry["steps"], got)
    assert drift["learning_rate"] == pytest.approx(0.01)
    # seen in the loss and the gradient norm alone, far above the tolerance (measured: 1.2e-4 and 1.4e-3)
    assert drift["loss"] > 50 * RTOL and drift["grad_norm"] > 500 * RTOL, drift
