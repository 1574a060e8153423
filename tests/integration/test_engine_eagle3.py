"""Eagle-3 drafts in a real vLLM engine: metrics, in-place swaps, bad files, policy updates."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from draftadapt.drafts.formats import DraftFormatError, META_FILE, WEIGHTS_FILE
from draftadapt.engine.rollout import DraftSwapError
from draftadapt.draft_init import init_draft

from .conftest import edit_manifest, flipped_copy, start_engine, stop_engine, toy_prompts

pytestmark = pytest.mark.integration
K = 3


@pytest.fixture(scope="module")
def drafts(toy_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("eagle3")
    v0 = init_draft(toy_target, "eagle3", root / "v0", fmt="speculators", seed=0, draft_vocab=48)
    v1 = init_draft(toy_target, "eagle3", root / "v1", fmt="speculators", seed=1, draft_vocab=48)
    for d, version in ((v1, 1),):  # give v1 its own version number in the manifest
        import json

        meta = json.loads((d / META_FILE).read_text())
        meta["version"] = version
        (d / META_FILE).write_text(json.dumps(meta))
    return {"v0": v0, "v1": v1, "root": root}


@pytest.fixture(scope="module")
def engine(toy_target, drafts):
    eng = start_engine(toy_target, drafts["v0"], method="eagle3", k=K)
    yield eng
    stop_engine(eng)


def test_generate_reports_spec_metrics_as_deltas(engine, toy_target):
    prompts = toy_prompts(toy_target, 16)
    first = engine.generate(prompts, temperature=1.0, max_tokens=48, seed=0)
    second = engine.generate(prompts[:4], temperature=1.0, max_tokens=48, seed=0)
    for res in (first, second):
        s = res.acceptance
        assert s.drafts > 0
        assert s.draft_tokens == K * s.drafts
        assert len(s.accepted_per_pos) == K
        assert sum(s.accepted_per_pos) == s.accepted_tokens
        assert 0 <= s.accepted_tokens <= s.draft_tokens
        # The rate is the counters' own arithmetic (1 + accepted / drafts = 1 + the per-position
        # rates), and vLLM counts position i only when 0..i-1 were accepted too, so the per-position
        # counts never rise. (With these untrained drafts no bound on the length itself is safe.)
        assert s.acceptance_length == pytest.approx(1.0 + sum(s.per_position), abs=1e-9)
        assert all(a >= b for a, b in zip(s.accepted_per_pos, s.accepted_per_pos[1:])), s.accepted_per_pos
        assert res.num_tokens > 0
    # deltas, not cumulative: 4 prompts cannot need more verification steps than 16 did
    assert second.acceptance.drafts < first.acceptance.drafts


def test_swap_changes_live_checksum_and_is_exact(engine, drafts):
    before = engine.draft_state()
    assert before["checksum"] == engine.live_checksum
    swapped = engine.swap_draft(drafts["v1"])
    assert swapped.version == 1
    assert swapped.checksum != before["checksum"]
    assert engine.draft_state()["checksum"] == swapped.checksum
    back = engine.swap_draft(drafts["v0"])
    # the same file read back gives the same checksum: the weights serve exactly as written
    assert back.checksum == before["checksum"]
    assert back.version == 0


def test_bad_files_change_nothing(engine, drafts, toy_target, tmp_path):
    live = engine.draft_state()["checksum"]
    # 1a. truncated weights: the header no longer covers the file
    trunc = tmp_path / "trunc"
    shutil.copytree(drafts["v1"], trunc)
    data = (trunc / WEIGHTS_FILE).read_bytes()
    (trunc / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])
    with pytest.raises(DraftSwapError, match="not a readable safetensors file"):
        engine.swap_draft(trunc)
    # 1b. bytes flipped inside the tensor data (same length, header intact, names and shapes fit):
    # the worker hashes the bytes it loads against the manifest's sha256 and refuses them
    flipped = flipped_copy(drafts["v1"], tmp_path / "flipped")
    with pytest.raises(DraftSwapError, match="sha256 does not match"):
        engine.swap_draft(flipped)
    # 2. corrupt bytes with a manifest that agrees (sha256 of the garbage): the header does not parse
    garbage = tmp_path / "garbage"
    shutil.copytree(drafts["v1"], garbage)
    (garbage / WEIGHTS_FILE).write_bytes(b"\x00\x01not safetensors" * 64)
    edit_manifest(garbage, version=9)
    with pytest.raises(DraftSwapError, match="safetensors"):
        engine.swap_draft(garbage)
    # 3. a draft of another shape (other draft vocabulary)
    other = init_draft(toy_target, "eagle3", tmp_path / "other", seed=2, draft_vocab=32)
    with pytest.raises(DraftSwapError, match="does not fit"):
        engine.swap_draft(other)
    # 4. a file that would write the draft's shared embed_tokens (i.e. the policy's)
    from safetensors.torch import save_file

    own = tmp_path / "own"
    shutil.copytree(drafts["v1"], own)
    sd = load_file(str(own / WEIGHTS_FILE))
    sd["embed_tokens.weight"] = torch.zeros(64, 256)
    save_file(sd, str(own / WEIGHTS_FILE))
    edit_manifest(own, version=5)
    with pytest.raises(DraftSwapError, match="embed_tokens"):
        engine.swap_draft(own)
    # 5. missing manifest
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(drafts["v1"] / WEIGHTS_FILE, bare / WEIGHTS_FILE)
    with pytest.raises(DraftSwapError, match="complete published draft"):
        engine.swap_draft(bare)
    assert engine.draft_state()["checksum"] == live
    res = engine.generate(toy_prompts(toy_target, 2), temperature=0.0, max_tokens=16)
    assert res.acceptance.drafts > 0


def test_greedy_identical_with_and_without_speculation(engine, plain_engine, toy_target):
    prompts = toy_prompts(toy_target, 24)
    speculated = engine.generate(prompts, temperature=0.0, max_tokens=64)
    plain = plain_engine.generate(prompts, temperature=0.0, max_tokens=64)
    assert speculated.acceptance.drafts > 0 and plain.acceptance.drafts == 0
    assert [r.token_ids for r in speculated.rollouts] == [r.token_ids for r in plain.rollouts]


def test_policy_update_in_place_keeps_draft(engine, toy_target):
    prompts = toy_prompts(toy_target, 8)
    original = load_file(str(toy_target / WEIGHTS_FILE))
    base = engine.generate(prompts, temperature=0.0, max_tokens=48)
    draft_before = engine.draft_state()
    policy_before = engine.policy_checksum()

    g = torch.Generator().manual_seed(0)
    moved = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.dim() == 2 else v for k, v in original.items()}
    result = engine.update_policy(moved, checks=True)
    assert result["policy_checksum"] != policy_before
    # the head shares the target's embed_tokens (by design, written in its manifest); everything
    # the draft owns is untouched by the policy update
    assert draft_before["shared"] == ["model.embed_tokens.weight"]
    assert result["draft"]["checksum"] == draft_before["checksum"]
    changed = engine.generate(prompts, temperature=0.0, max_tokens=48)
    assert [r.token_ids for r in changed.rollouts] != [r.token_ids for r in base.rollouts]

    restored = engine.update_policy(original, checks=True)
    assert restored["policy_checksum"] == policy_before
    assert restored["draft"]["checksum"] == draft_before["checksum"]
    again = engine.generate(prompts, temperature=0.0, max_tokens=48)
    assert [r.token_ids for r in again.rollouts] == [r.token_ids for r in base.rollouts]


def test_policy_tensors_go_in_as_they_are_in_any_dtype(engine, toy_target, tmp_path, monkeypatch):
    """An in-process engine takes the trainer's tensors: no file is written, and bf16 tensors
    serve exactly as the same values loaded from a file (the engine casts into its own dtype)."""
    import draftadapt.engine.rollout as rollout
    from safetensors.torch import save_file

    assert engine.in_process and engine.dtype == "float32"  # the toy target says float32
    prompts = toy_prompts(toy_target, 8)
    original = load_file(str(toy_target / WEIGHTS_FILE))
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in original.items()}
    rounded = tmp_path / "rounded.safetensors"
    save_file({k: v.float() for k, v in as_bf16.items()}, str(rounded))

    def no_file(_weights):
        raise AssertionError("an in-process update wrote a policy file")

    monkeypatch.setattr(rollout, "policy_file", no_file)
    try:
        engine.update_policy(as_bf16)
        from_tensors = engine.generate(prompts, temperature=0.0, max_tokens=48)
        checksum_tensors = engine.policy_checksum()
        engine.update_policy(rounded)
        from_file = engine.generate(prompts, temperature=0.0, max_tokens=48)
        assert engine.policy_checksum() == checksum_tensors
        assert [r.token_ids for r in from_tensors.rollouts] == [r.token_ids for r in from_file.rollouts]
        # the trainer's tensors are the engine's inputs, never modified by the load
        assert all(torch.equal(as_bf16[k], original[k].to(torch.bfloat16)) for k in original)
    finally:
        engine.update_policy(original)


def _tied_copy(toy_target, out, weights):
    """The toy target with its output head tied to ``embed_tokens`` (as Llama-3.2-1B and the
    small Qwen models ship), serving ``weights``."""
    import json
    from safetensors.torch import save_file

    shutil.copytree(toy_target, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["tie_word_embeddings"] = True
    (out / "config.json").write_text(json.dumps(cfg))
    save_file(weights, str(out / WEIGHTS_FILE))
    return out


def test_a_tied_output_head_follows_the_policy_update(toy_target, tmp_path):
    """vLLM's CPU path serves the output head from a packed copy of its weight; a tied head gets
    no checkpoint tensor of its own, so the reload must re-pack it. Before the fix the updated
    engine sampled from the new embeddings and the old head's logits (another distribution than
    the policy's). After an update, greedy tokens and log-probs equal an engine started on the
    new weights, with an Eagle-3 head serving beside it. (It tells the fix only where vLLM packs
    the head: the CPU path with oneDNN or AMX, as here; a GPU serves from the weight itself.)"""
    original = {k: v for k, v in load_file(str(toy_target / WEIGHTS_FILE)).items() if k != "lm_head.weight"}
    g = torch.Generator().manual_seed(3)
    moved = dict(original)
    moved["model.embed_tokens.weight"] = original["model.embed_tokens.weight"] + 0.5 * torch.randn(
        original["model.embed_tokens.weight"].shape, generator=g)
    tied = _tied_copy(toy_target, tmp_path / "tied", original)
    tied_moved = _tied_copy(toy_target, tmp_path / "tied-moved", moved)
    head = init_draft(tied, "eagle3", tmp_path / "head", fmt="speculators", seed=0, draft_vocab=48)
    prompts = toy_prompts(toy_target, 8)

    def run(engine):
        out = engine.generate(prompts, temperature=0.0, max_tokens=24, logprobs=True)
        return [r.token_ids for r in out.rollouts], [lp for r in out.rollouts for lp in r.logprobs]

    engine = start_engine(tied, head, in_process=True)
    try:
        before = run(engine)
        engine.update_policy(moved)
        updated = run(engine)
    finally:
        stop_engine(engine)
    fresh = start_engine(tied_moved, head, in_process=True)
    try:
        reference = run(fresh)
    finally:
        stop_engine(fresh)
    assert updated[0] != before[0]  # the update changed what serves
    assert updated[0] == reference[0]
    assert max(abs(a - b) for a, b in zip(updated[1], reference[1])) < 1e-4  # float32 toy


class _Lines(logging.Handler):
    """What a logger passes on (after its own filters), as text."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_reload_warns_only_for_modules_that_should_have_loaded(engine, drafts, toy_target, monkeypatch):
    """vLLM's layerwise reload warns "<class>: Failed to load weights" for every module a load
    leaves unfilled. Swaps and policy updates leave out the rotary buffers and the embeddings
    shared with the target on purpose: no line (a demo log had 36). A policy update that misses a
    module's weights keeps its line."""
    import draftadapt.engine.worker_ext as worker_ext

    assert engine.in_process  # the reload, and its logging, run in this process
    original = load_file(str(toy_target / WEIGHTS_FILE))
    log = logging.getLogger(worker_ext.RELOAD_LOGGER)
    seen = _Lines()
    log.addHandler(seen)
    # the lines must reach the handler for the empty list below to mean anything: no earlier test
    # may leave vLLM's loggers silenced (tests/conftest.py checks after every test; it was
    # VLLM_LOGGING_LEVEL=ERROR from TRL's import, draftadapt/integrations/__init__.py)
    assert not log.disabled and log.getEffectiveLevel() <= logging.WARNING, (log.disabled, log.getEffectiveLevel())
    try:
        engine.swap_draft(drafts["v1"])
        engine.update_policy(original)
        engine.swap_draft(drafts["v0"])
        quiet = list(seen.lines)
        # the same swap with nothing expected: vLLM does warn, under this logger and message (so
        # the filter matches what vLLM writes, and the empty list above is not an empty logger)
        monkeypatch.setattr(worker_ext, "expected_unloaded", lambda model, shared=frozenset(): set())
        engine.swap_draft(drafts["v1"])
        unfiltered = list(seen.lines)
        monkeypatch.undo()
        seen.lines.clear()
        partial = {k: v for k, v in original.items() if k != "model.layers.0.mlp.down_proj.weight"}
        engine.update_policy(partial)
    finally:
        log.removeHandler(seen)
        engine.swap_draft(drafts["v0"])
        engine.update_policy(original)
    assert quiet == []
    assert "RotaryEmbedding: Failed to load weights" in unfiltered, unfiltered
    assert seen.lines == ["RowParallelLinear: Failed to load weights"]
    assert not log.filters  # the filter lives only inside our reload call


def test_engine_refuses_unfit_drafts(toy_target, known_target, tmp_path):
    # a draft exported for another target (the known-distribution target: other tokenizer size/hidden)
    foreign = init_draft(known_target, "draft_model", tmp_path / "foreign")
    with pytest.raises(DraftFormatError):
        start_engine(toy_target, foreign, method="draft_model")
    # a method mismatch is named, not served with acceptance 1.0
    e3 = init_draft(toy_target, "eagle3", tmp_path / "e3")
    with pytest.raises(DraftFormatError, match="method='eagle3'"):
        start_engine(toy_target, e3, method="draft_model")
    # a target without a tokenizer
    notok = tmp_path / "notok"
    shutil.copytree(toy_target, notok)
    for f in notok.glob("tokenizer*"):
        f.unlink()
    with pytest.raises(DraftFormatError, match="tokenizer"):
        start_engine(notok, None)


def test_closing_one_in_process_engine_leaves_the_others_serving(engine, drafts, toy_target):
    """In-process engines share this process's distributed groups; vLLM's shutdown of one tore
    them down under the others (the demo's fresh-reference pretrain closed its engine and the
    RL engine then failed with "pipeline model parallel group is not initialized")."""
    assert engine.in_process
    prompts = toy_prompts(toy_target, 8)
    before = engine.generate(prompts, temperature=0.0, max_tokens=24)
    other = start_engine(toy_target)
    assert other.in_process
    assert other.generate(prompts, temperature=0.0, max_tokens=24).num_tokens > 0
    stop_engine(other)
    after = engine.generate(prompts, temperature=0.0, max_tokens=24)
    assert [r.token_ids for r in after.rollouts] == [r.token_ids for r in before.rollouts]
    swapped = engine.swap_draft(drafts["v1"])  # the worker RPC path still works
    assert swapped.version == 1
    engine.swap_draft(drafts["v0"])
