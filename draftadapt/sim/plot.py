"""The simulator's PNG: step-time breakdown per configuration, speedup against acceptance."""

from __future__ import annotations

from pathlib import Path

from draftadapt.sim.model import SimResult
from draftadapt.sim.report import LABELS, Comparison

# stacked in step order; exposed generation is what the step waits for
SEGMENTS = (("data_s", "data"), ("prepare_s", "prepare"), ("exposed_gen_s", "gen (exposed)"),
            ("logprob_s", "logprob"), ("train_s", "train"), ("adapt_s", "adapt"))


def plot(result: SimResult, path: str | Path, comparisons: list[Comparison] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, curve) = plt.subplots(1, 2, figsize=(13, 5))
    names, rows = [], []
    for mode, by_config in result.rows.items():
        for config, st in by_config.items():
            names.append(f"{mode}\n{LABELS[config]}")
            rows.append(st)
    modes = [mode for mode, by_config in result.rows.items() for _ in by_config]
    bottom = [0.0] * len(rows)
    for field, label in SEGMENTS:
        # async loads weights on the generation GPUs, off the trainer's critical path
        values = [0.0 if (field == "prepare_s" and mode == "async") else getattr(st, field)
                  for st, mode in zip(rows, modes)]
        if not any(values):
            continue
        bars.bar(range(len(rows)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    bars.scatter(range(len(rows)), [st.step_s for st in rows], color="black", marker="_", s=400,
                 zorder=3, label="step time")
    bars.set_xticks(range(len(rows)), names, fontsize=7)
    bars.set_ylabel("seconds per RL step")
    bars.set_title("step-time breakdown")
    bars.legend(fontsize=7)

    for mode, points in result.sweep.items():
        xs = [p["accept_length"] for p in points]
        curve.plot(xs, [p["gen_speedup"] for p in points], marker="o", label=f"{mode}: generation")
        curve.plot(xs, [p["e2e_speedup"] for p in points], marker="s", label=f"{mode}: end to end")
        if mode == "sync":
            curve.plot(xs, [p["ceiling"] for p in points], linestyle="--", color="gray",
                       label="end-to-end ceiling 1/(R_gen/alpha + 1 - R_gen)")
    curve.axhline(1.0, color="black", linewidth=0.5)
    for c in comparisons or []:
        alpha = _published_alpha(result, c)
        if alpha is not None:
            curve.scatter([alpha], [c.published], marker="*", s=120, zorder=4,
                          color="red" if c.gated else "none", edgecolors="red")
    curve.scatter([], [], marker="*", s=120, color="red", label="published (hollow: not gated)")
    curve.set_xlabel("acceptance length (tokens per verify step)")
    curve.set_ylabel("speedup over no speculation")
    curve.set_title("speedup against acceptance length")
    curve.legend(fontsize=7)
    fig.suptitle(result.name)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _published_alpha(result: SimResult, c: Comparison) -> float | None:
    """Where a published speedup sits on the curve: the recipe's acceptance, or a variant
    that only changes the acceptance length (other variants, e.g. another k, are off-curve)."""
    mode, name, config = c.figure.split(".")
    if "speedup" not in name or mode not in result.sweep:
        return None
    if not c.overrides:
        return result.rows[mode][config].accept_length
    if len(c.overrides) == 1 and c.overrides[0].startswith("spec.accept_length="):
        return float(c.overrides[0].split("=", 1)[1])
    return None
