"""draftadapt on a real local Ray cluster: two engine actors (real vLLM on CPU) kept on one draft
version by a DraftFleet, the adapter in its own actor, the step boundary between them.

Killed actors come back through Ray's own restarts (no mocks of Ray): an engine killed during a
generation loses no step and its new incarnation serves the newest draft; a killed adapter
resumes from its newest draft; a bad draft is refused by every engine, all keep the previous one.
"""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest
import torch

from draftadapt.drafts.formats import META_FILE
from draftadapt.draft_init import init_draft

from .conftest import flipped_copy, small_cfg, toy_prompts

ray = pytest.importorskip("ray", reason="the Ray extra is installed by scripts/setup.sh")

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(tmp_path_factory.mktemp("ray")), configure_logging=False)
    yield
    ray.shutdown()


def drifted(weights: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    """The policy after an 'update': every float tensor moved a little (a seeded step)."""
    g = torch.Generator().manual_seed(step)
    return {k: v + 1e-3 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in weights.items()}


def test_fleet_keeps_every_engine_on_the_newest_draft_through_kills(ray_cluster, toy_target, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from draftadapt.boundary import StepBoundary
    from draftadapt.data.store import DraftPackage, DraftStore, DraftVersion
    from draftadapt.integrations.ray import DraftFleet, RemoteAdapter

    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    fleet = DraftFleet(toy_target, draft, engines=2, cache_dir=tmp_path / "cache",
                       engine_kwargs={"method": "eagle3", "num_speculative_tokens": 3, "threads": 1,
                                      "max_num_seqs": 16, "seed": 0})
    adapter = RemoteAdapter(toy_target, draft, tmp_path / "drafts", cfg=small_cfg(), threads=1)
    boundary = StepBoundary(adapter, fleet)
    store = DraftStore(tmp_path / "drafts", readonly=True)
    prompts = toy_prompts(toy_target, 16)
    prompt_ids = [AutoTokenizer.from_pretrained(str(toy_target))(p).input_ids for p in prompts]
    weights = load_file(str(toy_target / "model.safetensors"))
    served_per_step, published = [], 0
    try:
        first_pids = {s["engine"]: s["pid"] for s in fleet.status()}
        adapter_pid = adapter.status()["pid"]
        for step in range(8):
            killer = None
            if step == 3:  # engine1 dies while it generates its shard
                victim = fleet.actors[1]
                killer = threading.Timer(1.0, lambda: ray.kill(victim, no_restart=False))
                killer.start()
            if step == 5:  # the adapter dies between steps; its next call is retried by Ray
                ray.kill(adapter.actor, no_restart=False)
            gen = fleet.generate(prompts, temperature=1.0, max_tokens=48, seed=100 * step)
            if killer is not None:
                killer.join()
            # one rollout per prompt, in prompt order, whichever engine generated it
            assert [r.prompt_token_ids for r in gen.rollouts] == prompt_ids
            boundary.report(gen.acceptance)
            weights = drifted(weights, step)
            res = boundary.after_update(gen.rollouts, sampled_version=step, weights=weights, version=step + 1)
            published += int(res.metrics.get("adapt/published", 0.0))
            newest = store.latest(max_policy_version=step + 1)
            v = fleet.versions()
            # every engine serves the newest draft the policy may serve, and the new policy, before
            # the next generation
            assert set(v["draft_version"].values()) == {newest.version}, (step, v, newest.version)
            assert set(v["policy_version"].values()) == {step + 1}, (step, v)
            assert v["skew"] == 0
            served_per_step.append(v["draft_version"])
            if step == 3:
                pids = {s["engine"]: s["pid"] for s in fleet.status()}
                assert pids["engine1"] != first_pids["engine1"], "engine1 was not restarted"
                assert pids["engine0"] == first_pids["engine0"]
                assert fleet.restarts >= 1
            if step == 5:
                st = adapter.status()
                assert st["pid"] != adapter_pid, "the adapter actor was not restarted"
                assert st["resumed_from"] in ("checkpoint", "published"), st
                assert st["live_version"] == newest.version and st["policy_version"] == step + 1, st
        # the adapter trained and published during the run, and each publish reached both engines
        assert published >= 2, published
        assert all(len(set(s.values())) == 1 for s in served_per_step)
        swaps = [s for s in fleet.swaps if not s.refused]
        assert len(swaps) >= published and all(s.broadcast_ms > 0 and set(s.engines) == {"engine0", "engine1"}
                                               for s in swaps)

        # a bad draft (bytes changed after its manifest was written) is refused by every engine
        live = store.latest()
        bad = flipped_copy(live.path, tmp_path / "bad")
        meta = json.loads((bad / META_FILE).read_text())
        meta["version"] = live.version + 1
        (bad / META_FILE).write_text(json.dumps(meta))
        package = DraftPackage.read(DraftVersion(live.version + 1, live.policy_version, bad, meta))

        class Offers:  # the adapter's side of a swap, offering this one package
            def newest_package(self, max_policy_version, newer_than=None):
                return package

        before = {s["engine"]: fleet.call("draft_state")[i]["checksum"] for i, s in enumerate(fleet.status())}
        (swap,) = fleet.swap(Offers())
        assert set(swap.refused) == {"engine0", "engine1"}, swap.engines
        assert all("sha256" in why for why in swap.refused.values()), swap.refused
        after = {s["engine"]: fleet.call("draft_state")[i]["checksum"] for i, s in enumerate(fleet.status())}
        assert after == before and set(fleet.versions()["draft_version"].values()) == {live.version}
        gen = fleet.generate(prompts[:4], temperature=1.0, max_tokens=16, seed=1)
        assert gen.acceptance.drafts > 0  # still drafting with the previous draft
    finally:
        fleet.close()
        adapter.close()
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def test_an_added_engine_comes_up_on_the_fleets_policy_and_draft(ray_cluster, toy_target, tmp_path):
    from safetensors.torch import load_file

    from draftadapt.adapter import DraftAdapter
    from draftadapt.integrations.ray import DraftFleet

    draft = init_draft(toy_target, "eagle3", tmp_path / "draft0", seed=0)
    fleet = DraftFleet(toy_target, draft, engines=1, engine_kwargs={"threads": 1, "max_num_seqs": 16})
    try:
        adapter = DraftAdapter(toy_target, draft, tmp_path / "drafts", small_cfg())
        weights = drifted(load_file(str(toy_target / "model.safetensors")), 0)
        fleet.update_policy(weights, version=1)
        adapter.update_policy(weights, version=1)
        v = adapter.publish(policy_version=1)
        (swap,) = fleet.swap(adapter)  # a local adapter works as well: the fleet reads its store
        assert swap.version == v and not swap.refused
        fleet.add_engine()
        versions = fleet.versions()
        assert versions["draft_version"] == {"engine0": v, "engine1": v}
        assert versions["policy_version"] == {"engine0": 1, "engine1": 1}
        # the new engine serves the same policy weights: greedy outputs agree token for token
        outs = [ray.get(a.generate.remote(toy_prompts(toy_target, 4), temperature=0.0, max_tokens=24))
                for a in fleet.actors]
        assert [r.token_ids for r in outs[0].rollouts] == [r.token_ids for r in outs[1].rollouts]
    finally:
        fleet.close()
