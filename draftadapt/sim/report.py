"""Projected figures beside the published ones, and the stdout table."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from draftadapt.config import load_config
from draftadapt.sim.config import Published, SimConfig
from draftadapt.sim.model import CONFIGS, SimResult, rel_err, simulate, step_ceiling

LABELS = {"plain": "no speculation", "spec": "speculation, frozen draft", "adapt": "speculation, adapted draft"}


@dataclass
class Comparison:
    """A published figure (config.Published, its value as ``published``) beside its projection."""

    figure: str  # e.g. sync.gen_speedup.spec
    published: float  # the paper's value
    projected: float  # the simulator's, for the recipe variant
    source: str  # where the paper states it
    overrides: list[str]  # the variant: key=value on top of the recipe
    gated: bool  # counted in the reproduction bar
    calibrated: bool  # the recipe was fitted to it (not a prediction)
    tolerance: float  # allowed relative error
    note: str  # why it is not gated, or what it rests on

    @property
    def rel_err(self) -> float:
        return rel_err(self.projected, self.published)

    @property
    def ok(self) -> bool:
        return abs(self.rel_err) <= self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "rel_err": self.rel_err, "ok": self.ok}


def compare(recipe: str, overrides: list[str], cfg: SimConfig, result: SimResult) -> list[Comparison]:
    """Each published figure of the recipe against its projection (variants with their own
    overrides are simulated here)."""
    out = []
    cache: dict[tuple[str, ...], SimResult] = {(): result}
    for pub in cfg.published:
        key = tuple(pub.overrides)
        if key not in cache:
            variant = load_config(SimConfig, recipe, list(overrides) + list(pub.overrides))
            cache[key] = simulate(variant, sweep=False)
        out.append(_comparison(pub, cache[key].figures[pub.figure]))
    return out


def _comparison(pub: Published, projected: float) -> Comparison:
    return Comparison(
        figure=pub.figure, published=pub.value, projected=projected, source=pub.source,
        overrides=list(pub.overrides), gated=pub.gated, calibrated=pub.calibrated,
        tolerance=pub.tolerance, note=pub.note,
    )


def format_table(cfg: SimConfig, result: SimResult) -> str:
    lines = [result.name]
    head = (f"  {'':28s} {'accept':>6s} {'prepare':>8s} {'gen':>8s} {'exposed':>8s} {'logprob':>8s} "
            f"{'train':>7s} {'adapt':>6s} {'step':>8s} {'gen x':>6s} {'e2e x':>6s} {'ceiling':>7s}")
    for mode, rows in result.rows.items():
        lines.append(f"{mode} pipeline (seconds per RL step)")
        lines.append(head)
        for config in CONFIGS:
            if config not in rows:
                continue
            st = rows[config]
            f = result.figures
            lines.append(
                f"  {LABELS[config]:28s} {st.accept_length:6.2f} {st.prepare_s:8.2f} {st.gen_s:8.1f} "
                f"{st.exposed_gen_s:8.1f} {st.logprob_s:8.1f} {st.train_s:7.1f} {st.adapt_s:6.2f} "
                f"{st.step_s:8.1f} {f[f'{mode}.gen_speedup.{config}']:6.2f} "
                f"{f[f'{mode}.e2e_speedup.{config}']:6.2f} "
                + (f"{f[f'{mode}.ceiling.{config}']:7.2f}" if mode == "sync" else f"{'-':>7s}")
            )
        share = rows["plain"].gen_share
        if mode == "sync":
            lines.append(f"  generation is {share:.1%} of the step without speculation; "
                         "ceiling = 1 / (R_gen / alpha + 1 - R_gen), the paper's bound")
        else:
            lines.append(f"  training waits for rollouts {share:.1%} of the step without speculation; "
                         "gen = rollout time at the generation GPUs' full throughput")
    return "\n".join(lines)


def format_comparisons(comparisons: list[Comparison]) -> str:
    if not comparisons:
        return ""
    lines = ["projected vs published",
             f"  {'figure':30s} {'projected':>9s} {'published':>9s} {'error':>7s}  status"]
    for c in comparisons:
        if not c.gated:
            status = "not gated"
        else:
            status = "ok" if c.ok else f"OFF (> {c.tolerance:.0%})"
        if c.calibrated:
            status += ", fitted to it"
        lines.append(f"  {c.figure:30s} {c.projected:9.4g} {c.published:9.4g} {c.rel_err:+7.1%}  {status}")
        if c.overrides:
            lines.append(f"      variant: {' '.join(c.overrides)}")
        if c.source:
            lines.append(f"      source: {c.source}")
        if c.note:
            lines.append(f"      note: {c.note}")
    return "\n".join(lines)


def ceiling_check(result: SimResult) -> list[str]:
    """Lines for every sync row whose end-to-end speedup exceeds the paper's ceiling (none
    expected: the model's generation speedup never exceeds the acceptance length)."""
    bad = []
    for mode, rows in result.rows.items():
        if mode != "sync":
            continue
        share = rows["plain"].gen_share
        for config, st in rows.items():
            bound = step_ceiling(share, st.accept_length)
            e2e = result.figures[f"{mode}.e2e_speedup.{config}"]
            if e2e > bound * (1 + 1e-6):
                bad.append(f"{mode}.{config}: e2e {e2e:.3f} above ceiling {bound:.3f}")
    return bad
