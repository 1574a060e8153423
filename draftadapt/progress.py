"""Progress bars that stay readable in a log file.

On a terminal tqdm redraws a line in place; written to a file or a pipe (a batch job, `> log`)
every redraw becomes text, and a few hundred steps leave thousands of updates in the log. Off a
terminal the bar here updates at most every ``LOG_INTERVAL_S`` seconds.
"""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm

LOG_INTERVAL_S = 30.0


class _LogBar(tqdm):
    """A bar for a log file: ``set_postfix`` waits for the next interval's redraw (tqdm's default
    redraws at once, which made a per-step postfix a per-step line again)."""

    def set_postfix(self, ordered_dict=None, refresh: bool = True, **kwargs: Any) -> None:
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


def progress(**kwargs: Any) -> tqdm:
    """``tqdm(**kwargs)`` on stderr; sparse updates when stderr is not a terminal."""
    stream = kwargs.setdefault("file", sys.stderr)
    isatty = getattr(stream, "isatty", None)
    kwargs.setdefault("dynamic_ncols", True)
    if callable(isatty) and isatty():
        return tqdm(**kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    kwargs.setdefault("maxinterval", LOG_INTERVAL_S * 2)
    return _LogBar(**kwargs)
