"""Progress bars: redrawn freely on a terminal, sparse in a log file."""

from __future__ import annotations

import io

from draftadapt.progress import LOG_INTERVAL_S, progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_log_file_gets_sparse_updates():
    log = io.StringIO()
    bar = progress(total=1000, desc="work", file=log)
    for i in range(1000):
        bar.update(1)
        bar.set_postfix(loss=f"{1 / (i + 1):.3f}")  # as the trainers do every step
    bar.close()
    assert bar.mininterval == LOG_INTERVAL_S
    # the first draw and the final one; a redraw per step would be ~1000 lines
    assert log.getvalue().count("work") <= 3, log.getvalue()
    assert "loss=0.001" in log.getvalue()  # the postfix still shows, with the final draw


def test_a_terminal_keeps_tqdm_defaults():
    bar = progress(total=10, desc="work", file=Terminal())
    assert bar.mininterval == 0.1
    bar.close()
