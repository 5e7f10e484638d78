"""scripts/plot_run.py: one PNG, four panels, the logged series per optimizer step."""

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from finetune.tools import train

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("plot_run", ROOT / "scripts" / "plot_run.py")
plot_run = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot_run)


def read_png(path):
    import matplotlib.image

    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return matplotlib.image.imread(path)


@pytest.mark.e2e
def test_a_real_debug_run_plots_its_four_series(tmp_path, capsys):
    out = tmp_path / "run"
    assert train.main(["recipe=recipes/debug.yaml", "train.max_steps=3", f"train.output_dir={out}"]) == 0
    steps = plot_run.load_steps(str(out))
    assert [e["step"] for e in steps] == [1, 2, 3]

    fig = plot_run.figure(steps, "debug")
    assert len(fig.axes) == 4
    loss_ax, lr_ax, norm_ax, speed_ax = fig.axes
    for ax, key in [(loss_ax, "loss"), (lr_ax, "learning_rate"), (norm_ax, "grad_norm")]:
        (line,) = ax.get_lines()
        assert list(line.get_xdata()) == [1, 2, 3]
        np.testing.assert_allclose(line.get_ydata(), [e[key] for e in steps])
    # tokens/s: drawn from what training logged, or an explicit note when it logged none
    if "real_tokens_per_s" in steps[0]:
        np.testing.assert_allclose(speed_ax.get_lines()[0].get_ydata(), [e["real_tokens_per_s"] for e in steps])
    else:
        assert "not logged" in speed_ax.texts[0].get_text()

    capsys.readouterr()
    assert plot_run.main([str(out)]) == 0, capsys.readouterr().err
    image = read_png(out / "run.png")
    assert image.shape[:2] == (7 * 120, 11 * 120)  # figsize × dpi


def test_a_run_without_throughput_gets_an_empty_tokens_panel(tmp_path):
    history = [{"step": s, "loss": 3.0 - s / 10, "learning_rate": 1e-4 * s, "grad_norm": 2.0 / s} for s in (1, 2, 4)]
    history.append({"step": 4, "train_loss": 2.8, "train_runtime": 1.0})  # the end-of-training summary: not a step
    (tmp_path / "trainer_state.json").write_text(json.dumps({"log_history": history}))
    fig = plot_run.figure(plot_run.load_steps(str(tmp_path)), "synthetic")
    assert [len(ax.get_lines()) for ax in fig.axes] == [1, 1, 1, 0]
    assert list(fig.axes[0].get_lines()[0].get_xdata()) == [1, 2, 4]
    assert "not logged in this run" in fig.axes[3].texts[0].get_text()
    assert plot_run.main([str(tmp_path), f"out={tmp_path / 'p.png'}"]) == 0
    read_png(tmp_path / "p.png")


def test_missing_state_is_one_clear_error(tmp_path, capsys):
    assert plot_run.main([str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no trainer_state.json" in err and err.count("\n") == 1
