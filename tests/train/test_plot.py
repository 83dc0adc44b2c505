"""The training plot (metrics.plot_history): loss and accuracy per epoch, epochs in whole numbers."""
from __future__ import annotations

import pytest

from ncclavg.train.metrics import history_figure, plot_history

pytest.importorskip("matplotlib")


def _history(epochs: int) -> list[dict]:
    return [{"epoch": e, "loss": 1.0 / e, "accuracy": 1 - 0.5 / e, "val_loss": 1.1 / e,
             "val_accuracy": 1 - 0.6 / e} for e in range(1, epochs + 1)]


@pytest.mark.parametrize("epochs", [1, 2, 3, 5, 10, 25])
def test_the_epoch_axes_tick_at_whole_epochs(epochs):
    import matplotlib.pyplot as plt

    fig = history_figure(_history(epochs), title="t")
    try:
        fig.canvas.draw()
        for ax in fig.axes:
            lo, hi = ax.get_xlim()
            ticks = [t for t in ax.get_xticks() if lo <= t <= hi]
            assert ticks and all(float(t).is_integer() for t in ticks), (epochs, ticks)
    finally:
        plt.close(fig)


def test_plot_history_writes_a_png(tmp_path):
    path = plot_history(_history(3), tmp_path / "sub" / "p.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="history: no epoch records"):
        plot_history([], tmp_path / "q.png")
