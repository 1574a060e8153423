"""The attack table of an adversarial user, replayed against the real engine, a DraftAdapter and a
real sidecar process: every bad input ends in a clear refusal or a quarantine, the engine's
acceptance afterwards equals the baseline, and what follows is still processed.

Acceptance is measured on the same prompts with the same seeds each time; the prefix cache is
dropped at every swap, so two measurements of one draft see the same state (tolerance below).
The engine runs with 32-token KV blocks and 150-token prompts so that prompts do hit the prefix
cache (with vLLM's CPU default of 128-token blocks and Eagle dropping the last matched block, the
toy's prompts never do).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draftadapt.adapter import DraftAdapter
from draftadapt.data.store import DraftStore
from draftadapt.drafts.formats import META_FILE, WEIGHTS_FILE
from draftadapt.engine.rollout import DraftSwapError
from draftadapt.draft_init import init_draft
from draftadapt.spool import SpoolCursor, SpoolReader, SpoolWriter
from draftadapt.toy.model import build_model

from .conftest import REPO, TINY, edit_manifest, small_cfg, flipped_copy, start_engine, start_sidecar, stop_engine, tiny_target, toy_prompts, write_shard

pytestmark = pytest.mark.integration
K = 3
# Two measurements of one draft on the same prompts and seeds, each after a swap (fresh prefix
# cache), differ only by float noise of batch composition: measured 0.000 here; 0.02 leaves room
# while a stale or damaged draft moves it by 0.3 or more.
SAME = 0.02


def acceptance(engine, prompts) -> float:
    res = engine.generate(prompts, temperature=1.0, max_tokens=48, seed=7)
    return res.acceptance.acceptance_length


def long_prompts(engine, toy_target, n: int = 24, length: int = 150) -> list[list[int]]:
    """Token prompts of ``length`` made of consecutive toy prompts: four 32-token blocks each."""
    base = [engine.tokenizer(p).input_ids for p in toy_prompts(toy_target, 64)]
    out = []
    for i in range(n):
        ids, j = [], i
        while len(ids) < length:
            ids += base[j % len(base)]
            j += 1
        out.append(ids[:length])
    return out


@pytest.fixture(scope="module")
def world(toy_target, trained_head, tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    store = DraftStore(root / "drafts")
    v1 = store.publish(trained_head, 0)[1]
    v2 = store.publish(trained_head, 0)[1]
    engine = start_engine(toy_target, trained_head, method="eagle3", k=K, block_size=32)
    engine.swap_draft(v2)
    prompts = long_prompts(engine, toy_target)
    baseline = acceptance(engine, prompts)
    yield {"root": root, "engine": engine, "v1": v1, "v2": v2, "prompts": prompts, "baseline": baseline}
    stop_engine(engine)


def refused(world, draft: Path, match: str, **kw) -> None:
    engine = world["engine"]
    before = engine.draft_state()
    with pytest.raises(DraftSwapError, match=match):
        engine.swap_draft(draft, **kw)
    assert engine.draft_state() == before
    assert acceptance(engine, world["prompts"]) == pytest.approx(world["baseline"], abs=SAME)


def test_baseline_is_a_trained_draft(world):
    # the attacks below would hide behind an untrained head (~1.0); this one is well above it
    assert world["baseline"] > 1.3
    assert acceptance(world["engine"], world["prompts"]) == pytest.approx(world["baseline"], abs=SAME)


def test_a_draft_built_for_another_target_is_refused(world, tmp_path):
    foreign = tmp_path / "qwen3"
    shutil.copytree(world["v2"], foreign)
    meta = json.loads((foreign / META_FILE).read_text())
    # what an export for the qwen3 toy writes: same sizes and vocabulary, another architecture
    edit_manifest(foreign, target={**meta["target"], "model_type": "qwen3"}, lineage=None, version=None)
    refused(world, foreign, "built for another target.*model_type")
    nameless = tmp_path / "nameless"
    shutil.copytree(world["v2"], nameless)
    edit_manifest(nameless, target=None)
    refused(world, nameless, "does not say which target")


def test_non_finite_tensors_are_refused(world, tmp_path):
    bad = tmp_path / "nan"
    shutil.copytree(world["v2"], bad)
    sd = load_file(str(bad / WEIGHTS_FILE))
    name = sorted(k for k in sd if sd[k].is_floating_point())[0]
    sd[name][0, 0] = float("nan")
    save_file(sd, str(bad / WEIGHTS_FILE))
    edit_manifest(bad)  # sha256 recomputed: only the values are wrong
    refused(world, bad, "NaN or Inf")


def test_an_older_version_of_the_same_store_needs_an_explicit_rollback(world):
    refused(world, world["v1"], "older than version 2.*rollback=True")
    engine = world["engine"]
    res = engine.swap_draft(world["v1"], rollback=True)
    assert res.version == 1
    engine.swap_draft(world["v2"])  # forward again: allowed
    assert engine.draft_version == 2
    assert acceptance(engine, world["prompts"]) == pytest.approx(world["baseline"], abs=SAME)


def test_a_manifest_without_sha256_is_refused(world, tmp_path):
    flipped = flipped_copy(world["v2"], tmp_path / "nosha")
    edit_manifest(flipped, sha256=None)
    refused(world, flipped, "no sha256")


def test_no_stale_draft_state_after_a_swap(world, tmp_path):
    """A -> B -> A measures A's acceptance: B's draft KV for the cached prompts is gone.

    B has large random weights, so its KV (cached with the prompts' blocks) is far from A's; an
    engine that kept it would serve A's drafts over B's KV for the cached prefix."""
    engine = world["engine"]
    other = tmp_path / "random"
    shutil.copytree(world["v2"], other)
    sd = load_file(str(other / WEIGHTS_FILE))
    g = torch.Generator().manual_seed(3)
    sd = {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() and v.ndim == 2 else v) for k, v in sd.items()}
    save_file(sd, str(other / WEIGHTS_FILE))
    edit_manifest(other, lineage=None, version=None)
    engine.swap_draft(other)
    engine.llm.reset_prefix_cache()  # whatever the swap does, the cache now fills with B's KV
    b = acceptance(engine, world["prompts"])
    assert b < world["baseline"] - 0.3, (b, world["baseline"])  # B really is another draft
    cached = engine.llm.generate([{"prompt_token_ids": world["prompts"][0]}], use_tqdm=False)[0].num_cached_tokens
    assert cached >= 96, cached  # the prompts do hit the prefix cache with B's KV in it
    engine.swap_draft(world["v2"])
    assert acceptance(engine, world["prompts"]) == pytest.approx(world["baseline"], abs=SAME)


# ---------------------------------------------------------------------- the adapter's door


def toy_rollouts(n: int, seed: int) -> list[tuple[list[int], list[int]]]:
    rng = random.Random(seed)
    return [([1] + [rng.randrange(4, 60) for _ in range(6)], [rng.randrange(4, 60) for _ in range(rng.randrange(10, 30))])
            for _ in range(n)]


@pytest.fixture(scope="module")
def adapter_dirs(toy_target, trained_head, tmp_path_factory):
    return {"out": tmp_path_factory.mktemp("adapter_door") / "drafts"}


def test_observe_refuses_bad_rollouts_and_adds_nothing(toy_target, trained_head, adapter_dirs):
    adapter = DraftAdapter(toy_target, trained_head, adapter_dirs["out"], small_cfg())
    good = toy_rollouts(12, 0)
    width = len(adapter.capture.aux_layer_ids) * adapter.policy.config.hidden_size
    cases = [
        ([*good[:3], ([1, 2], [9999])], None, "rollout 3 has token ids \\[9999\\] outside the policy's vocabulary"),
        ([*good[:2], ([1, 2], [-1])], None, "rollout 2 has token ids \\[-1\\]"),
        ([*good[:1], ([1] * 10, [5] * 100_000)], None, "rollout 1 has 100010 tokens, over the policy's max_position_embeddings"),
        (good[:2], [torch.zeros(len(p) + len(r), width + 1) for p, r in good[:2]], "rollout 0 is .* wide"),
        (good[:2], [torch.zeros(len(p) + len(r), width) for p, r in good[:1]] + [torch.zeros(3, width)],
         "rollout 1 has shape \\(3, "),
        (good[:2], [torch.zeros(len(p) + len(r), width) for p, r in good[:1]]
         + [torch.full((len(good[1][0]) + len(good[1][1]), width), float("nan"))], "rollout 1 holds NaN"),
    ]
    for rollouts, hidden, match in cases:
        with pytest.raises(ValueError, match=match):
            adapter.observe(rollouts, policy_version=0, hidden_states=hidden)
        assert len(adapter.replay) == 0
    assert adapter.observe(good, policy_version=0) == 12  # good input still goes in


def test_update_policy_refuses_unfit_weights_and_keeps_its_own(toy_target, trained_head, adapter_dirs, tmp_path):
    adapter = DraftAdapter(toy_target, trained_head, tmp_path / "drafts", small_cfg())
    sd = load_file(str(toy_target / "model.safetensors"))
    before = {k: v.clone() for k, v in adapter.policy.state_dict().items()}
    name = sorted(k for k in sd if sd[k].ndim == 2)[0]
    nan = {**sd, name: sd[name].clone().fill_(float("nan"))}
    wrong = {**sd, name: torch.zeros(3, 3)}
    missing = {k: v for k, v in sd.items() if k != name}
    ints = {**sd, name: sd[name].to(torch.int64)}
    for weights, match in ((nan, "NaN or Inf"), (wrong, "wrong shape"), (missing, "missing"), (ints, "not floating")):
        with pytest.raises(ValueError, match=match):
            adapter.update_policy(weights, version=1)
        assert adapter.policy_version == 0
        after = adapter.policy.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before), match


def test_a_non_finite_round_rolls_back_to_the_live_draft(toy_target, trained_head, tmp_path):
    adapter = DraftAdapter(toy_target, trained_head, tmp_path / "drafts", small_cfg())
    adapter.observe(toy_rollouts(24, 1), policy_version=0)
    with torch.no_grad():  # a stand-in for gradients that blew up: the trainer's weights go NaN
        next(p for p in adapter.trainer.draft.parameters() if p.requires_grad).fill_(float("nan"))
    m = adapter.run_round()
    assert m["adapt/rolled_back"] == 1.0 and m["adapt/published"] == 0.0
    live = adapter.live_draft().state_dict()
    assert all(torch.equal(v, live[k]) for k, v in adapter.trainer.draft.state_dict().items())
    assert not adapter.trainer.has_optimizer_state()
    adapter.observe(toy_rollouts(24, 2), policy_version=0)
    m = adapter.run_round()  # the next round trains on finite weights
    assert m.get("adapt/rolled_back", 0.0) == 0.0 and m["train/loss"] == pytest.approx(m["train/loss"])
    assert adapter.trainer.weights_finite()


def test_a_restarted_adapter_resumes_from_its_newest_draft_and_optimizer(toy_target, trained_head, tmp_path):
    out = tmp_path / "drafts"
    cfg = small_cfg()
    cfg.validation.margin = 0.99  # the point here is the restart: publish whatever the round gives
    first = DraftAdapter(toy_target, trained_head, out, cfg)
    first.observe(toy_rollouts(24, 3), policy_version=0)
    assert first.run_round(force=True)["adapt/published"] == 1.0
    first.wait_published()  # the round's publish is written beside the next round (publish_background)
    latest = DraftStore(out, readonly=True).latest()
    weights = {k: v.clone() for k, v in first.trainer.draft.state_dict().items()}
    moments = first.trainer.resume_state()["optimizer"]["state"]
    del first  # what a SIGKILL leaves once the write has landed: the store and the trainer state beside it

    again = DraftAdapter(toy_target, trained_head, out, small_cfg())
    assert again.resumed_from == "checkpoint" and again.live_version == latest.version
    now = again.trainer.draft.state_dict()
    assert all(torch.equal(weights[k], now[k]) for k in weights)  # the first candidate starts here
    assert again.trainer.has_optimizer_state()
    restored = again.trainer.resume_state()["optimizer"]["state"]
    assert restored.keys() == moments.keys()
    assert all(torch.equal(moments[i]["exp_avg"], restored[i]["exp_avg"]) for i in moments)


def test_another_targets_draft_or_output_dir_is_refused(toy_target, trained_head, tmp_path):
    from draftadapt.drafts.formats import DraftFormatError

    other = tiny_target(tmp_path / "tiny")
    with pytest.raises(DraftFormatError, match="another target"):
        DraftAdapter(other, trained_head, tmp_path / "a", small_cfg())
    assert not (tmp_path / "a").exists() or not DraftStore(tmp_path / "a", readonly=True).versions()
    DraftAdapter(toy_target, trained_head, tmp_path / "b", small_cfg())  # publishes v1 for the toy
    foreign = init_draft(other, "eagle3", tmp_path / "tiny_draft", seed=0, draft_vocab=32)
    with pytest.raises(DraftFormatError, match="holds drafts built for another target"):
        DraftAdapter(other, foreign, tmp_path / "b", small_cfg())


# ---------------------------------------------------------------------- the sidecar process


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "draftadapt.cli", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def sidecar_world(tmp_path: Path):
    """A tiny target, a draft for it, a spool with its writer, the drafts' output dir."""
    target = tiny_target(tmp_path / "target")
    draft = init_draft(target, "eagle3", tmp_path / "draft0", draft_vocab=32)
    spool, out = tmp_path / "spool", tmp_path / "drafts"
    return target, draft, spool, out, SpoolWriter(spool, writer_id="rl")


def test_the_sidecar_quarantines_bad_input_and_processes_what_follows(tmp_path):
    target, draft, spool, out, writer = sidecar_world(tmp_path)
    rng = random.Random(0)
    good = [write_shard(writer, 0, rng).stem]
    bad_id = writer.write_rollouts(step=1, policy_version=0, prompt_ids=[[1, 5, 6]], response_ids=[[9999, 7]]).stem
    too_long = writer.write_rollouts(step=2, policy_version=0, prompt_ids=[[1, 5]], response_ids=[[7] * 100_000]).stem
    wide = writer.write_rollouts(step=3, policy_version=0, prompt_ids=[[1, 5]], response_ids=[[7, 8]],
                                 aux_hidden=torch.zeros(4, 5)).stem
    sd = build_model(TINY, seed=0).state_dict()
    name = sorted(k for k in sd if sd[k].ndim == 2)[0]
    writer.write_policy(1, {**sd, name: torch.zeros(2, 2)})                                   # wrong shape
    writer.write_policy(2, {k: v for k, v in sd.items() if k != name})                        # missing tensor
    writer.write_policy(3, {**sd, name: torch.full_like(sd[name], float("nan"))})            # NaN
    good += [write_shard(writer, s, rng).stem for s in (4, 5, 6)]
    writer.finish()

    with open(tmp_path / "sidecar.log", "w") as log:
        proc = start_sidecar(spool, out, target, draft, log)
        rc = proc.wait(timeout=600)
    text = (tmp_path / "sidecar.log").read_text()
    assert rc == 0, text[-3000:]
    reasons = SpoolReader(spool).quarantined()
    assert "9999" in reasons[bad_id] and "outside the policy's vocabulary" in reasons[bad_id]
    assert "max_position_embeddings" in reasons[too_long]
    assert "wide" in reasons[wide]
    policy_reasons = [r for n, r in reasons.items() if n.startswith("p")]
    assert len(policy_reasons) == 3, reasons
    assert any("wrong shape" in r for r in policy_reasons) and any("missing" in r for r in policy_reasons)
    assert any("NaN or Inf" in r for r in policy_reasons)
    state = json.loads((out / ".sidecar" / "state.json").read_text())
    cursor = SpoolCursor.from_dict(state["cursor"])
    assert all(n in cursor for n in good) and state["policy_version"] == 0
    assert DraftStore(out, readonly=True).versions()[-1] >= 2  # rounds ran and published


def test_a_killed_sidecar_restarts_from_its_newest_draft_and_trainer_state(tmp_path):
    target, draft, spool, out, writer = sidecar_world(tmp_path)
    rng = random.Random(1)
    for s in range(6):
        write_shard(writer, s, rng)
    log = open(tmp_path / "sidecar.log", "w")
    proc = start_sidecar(spool, out, target, draft, log, "exit_when_finished=false")
    store = DraftStore(out, readonly=True)
    deadline = time.monotonic() + 300
    # a trained version and its trainer state: the writer saves the state just after the version's
    # rename (publish.py), and a kill between the two (once in CI) leaves the previous state
    resume = out / ".trainer" / "resume.pt"
    while ((store.latest() is None or store.latest().version < 2 or not resume.is_file())
           and time.monotonic() < deadline):
        time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    newest = store.latest().version
    assert newest >= 2  # v1 is the starting draft: at least one trained version
    saved = torch.load(out / ".trainer" / "resume.pt", weights_only=True)
    assert saved["optimizer"]["state"], "no optimizer state beside the newest draft"

    for s in range(6, 8):
        write_shard(writer, s, rng)
    writer.finish()
    proc = start_sidecar(spool, out, target, draft, log)
    rc = proc.wait(timeout=600)
    log.close()
    text = (tmp_path / "sidecar.log").read_text()
    assert rc == 0, text[-3000:]
    resumed = [line for line in text.splitlines() if "adapter: resumed from version" in line]
    assert resumed and f"version {saved['draft_version']} (checkpoint)" in resumed[-1], resumed
    assert store.latest().version > newest  # and it went on publishing


def test_the_sidecar_refuses_another_targets_draft(toy_target, trained_head, tmp_path):
    target = tiny_target(tmp_path / "target")
    (tmp_path / "spool").mkdir()
    proc = run_cli("sidecar", "--spool", str(tmp_path / "spool"), "--out", str(tmp_path / "drafts"),
                   "--target", str(target), "--draft", str(trained_head))
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "another target" in last and str(trained_head) in last
    assert not DraftStore(tmp_path / "drafts", readonly=True).versions()  # nothing relabelled


@pytest.mark.parametrize("args", [
    ("sidecar", "--spool", "{tmp}", "--out", "{tmp}/o", "--target", "notamodel", "--draft", "notamodel"),
    ("sidecar", "--spool", "{tmp}", "--out", "{tmp}/o", "--target", "{tmp}", "--draft", "{tmp}"),
    ("draft", "init", "--target", "notamodel", "--out", "{tmp}/o"),
    ("draft", "init", "--target", "{tmp}", "--out", "{tmp}/o"),
    ("eval", "--target", "/nonexistent", "--draft", "/nonexistent"),
])
def test_cli_errors_are_one_line_naming_the_thing_and_the_fix(args, tmp_path):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    proc = run_cli(*args)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --target "), lines
    bad = args[args.index("--target") + 1]
    assert bad in lines[0] and ("model directory" in lines[0]), lines[0]
