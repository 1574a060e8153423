"""The demo's records turned into its outputs: summary.json (arms, last third, end to end, fleet,
baselines) and acceptance.png."""

from __future__ import annotations

import json
from pathlib import Path

from draftadapt.config import ConfigError
from draftadapt.rl.arms import FIXED_K_ARM, throughput
from draftadapt.rl.config import DemoConfig


def fleet_summary(fleet, history: list[dict]) -> dict:
    """engines=N: per step the draft and policy version each engine served after the boundary,
    and per broadcast version its size, wall time and any refusals."""
    rows = [h["fleet/versions"] for h in history if "fleet/versions" in h]
    return {
        "engines": len(fleet.names),
        "served_draft_version_per_step": [r["draft_version"] for r in rows],
        "policy_version_per_step": [r["policy_version"] for r in rows],
        "max_skew": max((r["skew"] for r in rows), default=0),
        "broadcasts": [{"version": w.version, "policy_version": w.policy_version, "nbytes": w.nbytes,
                        "broadcast_ms": w.broadcast_ms, "refused": w.refused} for w in fleet.swaps],
        "engine_restarts": fleet.restarts,
    }

def load_baseline(path: str) -> dict:
    """A finished ``spec=false`` run's summary (checked before the run starts, not after)."""
    return load_finished(path, "baseline", "a spec=false run", lambda s: not s.get("spec", True),
                         "run `draftadapt demo --out DIR spec=false` on the same world and seed")

def load_sync(path: str) -> dict:
    """A finished synchronous run's summary, to set beside an asynchronous one."""
    return load_finished(path, "sync", "a synchronous spec=true run", lambda s: s.get("spec", True) and "async" not in s,
                         "run `draftadapt demo --out DIR` (async_lag=0) on the same world and seed")

def load_finished(path: str, key: str, what: str, fits, how: str) -> dict:
    f = Path(path) / "summary.json"
    if not f.is_file():
        raise ConfigError(f"{key}={path}: no summary.json there; pass the OUT of a finished run ({how})")
    s = json.loads(f.read_text())
    if not fits(s) or "end_to_end" not in s:
        raise ConfigError(f"{key}={path} is not {what} (its summary has spec={s.get('spec')}, "
                          f"async={'async' in s}); {how}")
    return s

def end_to_end(history: list[dict]) -> dict:
    """Means per RL step of what the user's RL step pays (measurement arms excluded), over steps
    2 on when there are two or more: step 1 carries the engines' warm-up (on SmolLM2 its RL step
    took 103 s against 60 s a step after), which no later step pays. ``from_step`` says which."""
    first = 1 if len(history) > 1 else 0
    steps = history[first:]
    n = max(1, len(steps))
    e = {key: sum(h[f"stage/{key}"] for h in steps) / n
         for key in ("rl_step_s", "gen_s", "exposed_gen_s", "train_s", "adapt_s")}
    e["from_step"] = first + 1
    e["gen_share"] = e["gen_s"] / e["rl_step_s"] if e["rl_step_s"] > 0 else float("nan")
    # in an asynchronous run the adapter shares the step with the generation: no sum leaves it out
    asynchronous = any("async/engine_version" in h for h in history)
    e["rl_step_without_adapter_s"] = None if asynchronous else e["gen_s"] + e["train_s"]
    e["adapt_share"] = e["adapt_s"] / e["rl_step_s"] if e["rl_step_s"] > 0 else float("nan")
    return e

def whole_run(adapted: list[float], frozen: list[float], published: list[bool]) -> dict:
    """What the whole run served, drift included (the last third hides the dip while the policy
    moves): per-step acceptance lengths of the adapted and frozen arms (nan = nothing drafted)
    and, per step, whether a draft was published after it (steps count from 1)."""
    pairs = [(a, f) for a, f in zip(adapted, frozen) if a == a and f == f]
    if not pairs:
        return {}
    a_mean = sum(a for a, _ in pairs) / len(pairs)
    f_mean = sum(f for _, f in pairs) / len(pairs)
    start = pairs[0][0]
    return {
        "adapted_mean": a_mean, "frozen_mean": f_mean, "adapted_over_frozen": a_mean / f_mean,
        # the deepest dip of the adapted draft, and the mean it kept, against its first step's
        "adapted_worst_over_start": min(a for a, _ in pairs) / start,
        "adapted_retention": a_mean / start,
        "first_publish_step": next((i + 1 for i, p in enumerate(published) if p), None),
    }

def summarize(cfg: DemoConfig, history: list[dict], arms: dict, seconds: float, fresh: dict | None = None,
              rl_batch: tuple | None = None, baseline: dict | None = None,
              sync: dict | None = None) -> dict:
    """summary.json: the run's end-to-end step, each arm's acceptance and throughput, and the
    comparisons the run has material for (the RL batch, a spec=false baseline, sync, the drift)."""
    s = {"steps": len(history), "seconds": seconds, "spec": cfg.spec,
         "reward_per_step": [h["rl/reward"] for h in history],
         "accuracy_per_step": [h["rl/accuracy"] for h in history],
         "reply_tokens_per_step": [h.get("rl/reply_tokens") for h in history],
         "arms": {name: _arm(name, ms, max(1, len(history) // 3)) for name, ms in arms.items()},
         "end_to_end": end_to_end(history),
         "arms_measured_at": f"{cfg.eval.prompts} eval prompts every step"}
    if rl_batch is not None:
        s["rl_batch_arms"] = _rl_batch_arms(cfg, rl_batch)
    served = [h for h in history if "tps/rl_batch_served_over_plain" in h]
    if served:  # the end of each third: what the RL step served over no draft, at the RL batch
        s["served_over_plain_at_rl_batch"] = {
            "steps": [h["step"] + 1 for h in served],  # counted from 1, as the demo prints them
            "tokens_per_s": [h["tps/rl_batch_served_over_plain"] for h in served],
            "undrafted": [bool(h.get("k/served_undrafted")) for h in served]}
    if baseline is not None:
        s["vs_baseline"] = _vs_baseline(s["end_to_end"], baseline["end_to_end"])
    if cfg.async_lag:
        s["async"] = _async(cfg, history, s["end_to_end"], sync)
    if cfg.spec:
        _drift(s, history, fresh)
        s["guard"] = guard_summary(history)
    return s


def guard_summary(history: list[dict]) -> dict:
    """The served draft's checks per step (None where a step ran none): simulated against the
    frozen first draft, the engine's first-token acceptance against the simulated one, and the
    steps where the frozen draft went back in or a lost draft was swapped in again
    (docs/design.md, "Keep the better draft", "Notice a lost draft")."""
    def per_step(key: str) -> list:
        return [h.get(key) for h in history]

    return {"served_over_frozen_per_step": per_step("guard/served_over_frozen"),
            "first_measured_per_step": per_step("guard/first_measured"),
            "first_simulated_per_step": per_step("guard/first_simulated"),
            "reverted_steps": [h["step"] for h in history if h.get("guard/reverted")],
            "lost_draft_steps": [h["step"] for h in history if h.get("guard/lost_draft")]}


def _mean(xs) -> float:
    xs = [x for x in xs if x == x]  # drop nan (a step where nothing was drafted)
    return sum(xs) / len(xs) if xs else float("nan")


def _arm(name: str, ms: list[dict], last: int) -> dict:
    return {
        "acceptance_length_per_step": [m.get("acceptance_length") for m in ms],
        "mean_tokens_per_s": throughput(ms),
        "last_third_acceptance": _mean([m["acceptance_length"] for m in ms[-last:]]) if name != "plain" else None,
        # throughput: all tokens over all seconds (a mean of per-step rates over-weights
        # the short, noisy timings of this 2-core machine)
        "last_third_tokens_per_s": throughput(ms[-last:]),
    }


def _rl_batch_arms(cfg: DemoConfig, rl_batch: tuple) -> dict:
    p, f, a = rl_batch[:3]
    measured = [("plain", p), ("frozen", f), ("adapted", a)]
    out = {
        "measured_at": f"the last step's {cfg.grpo.prompts_per_step * cfg.grpo.group_size} rollout prompts "
                       f"(the RL batch), final policy",
        **{name: {"tokens_per_s": m["tokens_per_s"], "acceptance_length": m["acceptance_length"]}
           for name, m in measured},
        **{f"{name}_over_plain_tokens_per_s": m["tokens_per_s"] / p["tokens_per_s"] for name, m in measured[1:]},
    }
    if len(rl_batch) > 3:  # k_policy=online: the interleaved comparison (compare_k)
        out["online_vs_fixed_k"] = rl_batch[3]
    return out


def _vs_baseline(e: dict, b: dict) -> dict:
    """This run's end-to-end step ``e`` against a spec=false run's ``b``."""
    out = {
        "baseline_rl_step_s": b["rl_step_s"],
        "rl_step_speedup": b["rl_step_s"] / e["rl_step_s"],  # >= 1: the RL run is faster with draftadapt
        "gen_speedup": b["gen_s"] / e["gen_s"],
    }
    if e["rl_step_without_adapter_s"] is not None:
        out["rl_step_speedup_without_adapter"] = b["rl_step_s"] / e["rl_step_without_adapter_s"]
    return out


def _async(cfg: DemoConfig, history: list[dict], e: dict, sync: dict | None) -> dict:
    # every generation of the run, the pipeline's fill included (it is in step 0's exposed time)
    gen_s = e["gen_s"] + sum(h.get("async/fill_s", 0.0) for h in history) / max(1, len(history))
    out = {"lag": cfg.async_lag, "threads_each": cfg.async_threads, "step_s": e["rl_step_s"],
           "exposed_gen_s": e["exposed_gen_s"], "gen_s": gen_s,
           # the share of the generation hidden behind the policy update and the adapter
           "overlap": 1 - e["exposed_gen_s"] / gen_s if gen_s > 0 else float("nan")}
    if sync is not None:
        b = sync["end_to_end"]
        out["sync"] = {"run": cfg.sync, "step_s": b["rl_step_s"], "exposed_gen_s": b["gen_s"],
                       "last_third": sync.get("last_third")}
        out["speedup_over_sync"] = b["rl_step_s"] / e["rl_step_s"]
    return out


def _drift(s: dict, history: list[dict], fresh: dict | None) -> None:
    """The drafts against each other: whole_run, last_third and the fresh-final comparison, into ``s``."""
    a, f, p = s["arms"]["adapted"], s["arms"]["frozen"], s["arms"]["plain"]
    # the drafts compared at one k: under online k the adapted arm drafts up to k_max tokens where
    # its table says, the frozen arm k; the adapted draft at the frozen arm's k is its own arm
    same_k = s["arms"].get(FIXED_K_ARM, a)
    s["whole_run"] = whole_run(same_k["acceptance_length_per_step"], f["acceptance_length_per_step"],
                               [h.get("adapt/published", 0.0) > 0 for h in history])
    s["whole_run"]["adapted_arm"] = FIXED_K_ARM if same_k is not a else "adapted"
    s["last_third"] = {
        "adapted_over_frozen_acceptance": same_k["last_third_acceptance"] / f["last_third_acceptance"],
        "adapted_over_plain_tokens_per_s": a["last_third_tokens_per_s"] / p["last_third_tokens_per_s"],
    }
    for name in sorted(set(s["arms"]) - {"plain", "frozen", "adapted"}):  # model-free baselines, fixed k
        s["last_third"][f"{name}_over_plain_tokens_per_s"] = (s["arms"][name]["last_third_tokens_per_s"]
                                                              / p["last_third_tokens_per_s"])
    if FIXED_K_ARM in s["arms"]:
        s["last_third"]["online_over_fixed_k_tokens_per_s"] = (a["last_third_tokens_per_s"]
                                                               / s["arms"][FIXED_K_ARM]["last_third_tokens_per_s"])
    if fresh is not None:
        s["fresh_final"] = fresh
        s["last_third"]["adapted_over_fresh_final_acceptance"] = a["last_third_acceptance"] / fresh["acceptance_length"]
        s["adapted_final_over_fresh_final_acceptance"] = fresh["adapted_final_acceptance"] / fresh["acceptance_length"]


def plot(history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] + 1 for h in history]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    ax[0].plot(steps, [h["accept/length"] for h in history], "o-", label="adapted draft")
    ax[0].plot(steps, [h["accept/frozen_length"] for h in history], "s-", label="frozen pretrained draft")
    ax[0].axhline(1.0, color="gray", ls=":", label="no speculation")
    # a step's row is measured after its boundary swapped the draft it published in: the new draft
    # serves from that point on
    for i, h in enumerate(history):
        if h.get("adapt/published", 0.0) > 0:
            ax[0].axvline(steps[i] - 0.5, color="C0", alpha=0.25, lw=1,
                          label="draft published" if not any(x.get("adapt/published", 0.0) > 0 for x in history[:i]) else None)
    ax[0].set_xlabel("RL step")
    ax[0].set_ylabel("acceptance length (k=3, measured in vLLM)")
    ax[0].legend()
    ax[1].plot(steps, [h["rl/reward"] for h in history], "o-", color="C2")
    ax[1].set_xlabel("RL step")
    ax[1].set_ylabel("mean reward")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
