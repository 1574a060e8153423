"""Methods mixed into every vLLM worker (``worker_extension_cls``), called via ``collective_rpc``.

Across a process boundary arguments are file paths, never tensors (tensor arguments fail to
pickle across the RPC: ``cannot pickle memoryview objects``); an in-process engine's worker takes
the trainer's tensors themselves (docs/design.md, "Weight path"). Weights are loaded in place with
vLLM's layerwise reload: a plain ``load_weights`` fails on CPU because the CPU GEMM path repacks
weights (``Attempted to load weight ... into parameter (torch.Size([0]))``).
"""

from __future__ import annotations

import hashlib
import logging
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from draftadapt.fileio import known_sha256
from draftadapt.tensors import all_finite



# Elements per slice a full checksum widens to float64 at a time: 8 MiB of scratch, whatever the
# model's size (a whole-tensor float64 copy of an 8B model's embedding alone is 4 GiB).
CHECKSUM_CHUNK = 1 << 20
# Elements per parameter the routine fingerprint reads (every ceil(n / SAMPLE)-th).
CHECKSUM_SAMPLE = 1 << 16


def module_checksum(module: torch.nn.Module, exclude: set[str] = frozenset(), full: bool = False) -> str:
    """A fingerprint of the weights a module serves with, as read back from its parameters.

    Per parameter: its size, its min and max over every element (one fast pass: NaN, Inf or any
    out-of-range value anywhere shows), and the float64 sum and sum of squares of a fixed sample
    of at most ``CHECKSUM_SAMPLE`` elements in logical order. It changes when a module is
    overwritten, zeroed, freed or reloaded from other weights, which is what a lost draft looks
    like (docs/design.md, "Weight path"); ``full=True`` sums every element instead, in slices of
    ``CHECKSUM_CHUNK`` (O(1) extra memory either way). Layout-independent: CPU GEMM repacking
    permutes storage but keeps values. ``exclude``: parameter names left out (a draft's modules
    shared with the target).
    """
    h = hashlib.sha256()
    for name, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
        if p.numel() == 0 or name in exclude:
            continue
        flat = p.detach().reshape(-1)
        n = flat.numel()
        lo, hi = torch.aminmax(flat)
        if full:
            parts = (flat[i:i + CHECKSUM_CHUNK] for i in range(0, n, CHECKSUM_CHUNK))
        else:
            parts = (flat[:: -(-n // CHECKSUM_SAMPLE)],)
        total = squares = 0.0
        for part in parts:
            x = part.to(torch.float64)
            total += float(x.sum())
            squares += float(torch.dot(x, x))
        h.update(f"{name}:{n}:{float(lo):.9e}:{float(hi):.9e}:{total:.9e}:{squares:.9e};".encode())
    return h.hexdigest()[:16]


def _read_checkpoint(path: str, sha256: str | None) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file, hashed against ``sha256`` first. The file is mapped,
    not read into a bytes copy. A file this process hashed itself (a draft it just published,
    unchanged since: fileio.known_sha256) is not hashed again."""
    import mmap

    from safetensors.torch import load_file

    if sha256 is not None and known_sha256(path) != sha256:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as view:
            if hashlib.sha256(view).hexdigest() != sha256:
                raise ValueError(f"{path}: sha256 does not match the manifest; refusing to load it")
    return load_file(path)


# vLLM's layerwise reload warns "<module class>: Failed to load weights" for every module the
# checkpoint did not fill. Two kinds are left out on purpose on every swap and policy update:
# rotary embeddings (buffers computed at start-up, no weights) and a draft's modules that are the
# target's own (shared embed_tokens; writing them would overwrite the policy; docs/design.md,
# "Shared modules"). Only those are silenced, and only during our reload; any other is loud.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_FAILED_MSG = "%s: Failed to load weights"


def expected_unloaded(model: torch.nn.Module, shared: set[str] = frozenset()) -> set[str]:
    """Class names of the modules a reload of ``model`` leaves untouched on purpose.

    A module is expected not to load if it owns no parameters (only buffers: rotary embeddings)
    or every parameter it owns is in ``shared`` (names in ``model``, shared with the target). A
    class name counts only if every module of that class is expected, since the warning carries
    nothing but the class name.
    """
    expected: dict[str, bool] = {}
    for prefix, m in model.named_modules():
        own = _own_param_names(prefix, m)
        has_buffers = any(True for _ in m.buffers(recurse=False))
        ok = (not own and has_buffers) or (bool(own) and all(n in shared for n in own))
        if own or has_buffers:
            cls = type(m).__name__
            expected[cls] = expected.get(cls, True) and ok
    return {cls for cls, ok in expected.items() if ok}


def tied_names(model: torch.nn.Module) -> set[str]:
    """Parameter names of the modules of ``model`` every parameter of which an earlier module owns
    (a tied output head: ``lm_head.weight`` is ``embed_tokens.weight``)."""
    owner: set[int] = set()
    tied: set[str] = set()
    for prefix, m in model.named_modules():
        own = list(m.named_parameters(recurse=False))
        if own and all(id(p) in owner for _, p in own):
            tied.update(_own_param_names(prefix, m))
        owner.update(id(p) for _, p in own)
    return tied


def _own_param_names(prefix: str, m: torch.nn.Module) -> list[str]:
    return [f"{prefix}.{n}" if prefix else n for n, _ in m.named_parameters(recurse=False)]


def _keeps_weight(m: torch.nn.Module) -> bool:
    """A module the CPU GEMM path packed without dropping its weight (vocabulary embeddings and
    output heads; linear layers keep only the packed copy)."""
    w = getattr(m, "weight", None)
    return isinstance(w, torch.Tensor) and w.numel() > 0


class _DropExpectedUnloaded(logging.Filter):
    def __init__(self, classes: set[str]):
        super().__init__()
        self.classes = frozenset(classes)

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == RELOAD_FAILED_MSG and record.args and record.args[0] in self.classes)


@contextmanager
def quiet_expected_unloaded(classes: set[str]):
    """Drop the reload's "Failed to load weights" warnings for ``classes`` inside the block."""
    logger = logging.getLogger(RELOAD_LOGGER)
    f = _DropExpectedUnloaded(classes)
    logger.addFilter(f)
    try:
        yield
    finally:
        logger.removeFilter(f)


class WorkerCall:
    """The extension's methods the engine calls by name through vLLM's ``collective_rpc``, each
    spelled here once (defined on :class:`DraftAdaptWorkerExtension` below)."""

    DRAFT_STATE = "da_draft_state"  # the live draft's checksum, version and shared modules
    LOAD_DRAFT = "da_load_draft"  # a published draft file into the running drafter
    LOAD_POLICY = "da_load_policy"  # new policy weights, in place
    POLICY_CHECKSUM = "da_policy_checksum"  # a fingerprint of the served policy
    DRAFTER_IDLE = "da_drafter_idle"  # skip the drafter's pass on steps that draft no token


class DraftAdaptWorkerExtension:
    """In-place weight updates for the draft and the policy, and read-back of what serves."""

    def _da_reload(self, model: torch.nn.Module, weights: dict[str, torch.Tensor], model_config,
                   shared: set[str] = frozenset()) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        quiet = quiet_expected_unloaded(expected_unloaded(model, shared | tied_names(model)))
        # The CPU GEMM path serves an output head from a packed copy of its weight, made once
        # after loading (``cpu_linear``). Drop the vocabulary-sized ones before the reload (the
        # reload packs the loaded modules afresh; keeping the old copies until then doubled the
        # update's peak memory) and re-pack a tied head, which no checkpoint tensor reaches: it
        # would go on serving the old policy's logits (docs/design.md, "Weight path").
        repack = [m for name, m in model.named_modules()
                  if getattr(m, "cpu_linear", None) is not None and _keeps_weight(m)
                  and not all(n in shared for n in _own_param_names(name, m))]
        with set_current_vllm_config(self.vllm_config), torch.no_grad(), quiet:
            for m in repack:
                m.cpu_linear = None
            try:
                initialize_layerwise_reload(model)
                model.load_weights(iter(weights.items()))
                finalize_layerwise_reload(model, model_config)
            finally:
                for m in repack:  # not reloaded (tied to a module that was), or the load failed
                    if m.cpu_linear is None and not m.weight.is_meta:
                        m.quant_method.process_weights_after_loading(m)

    def _da_shared(self, draft: torch.nn.Module) -> set[str]:
        """Draft parameter names that are the target's own tensors (vLLM shares identical embeddings;
        every name of a tensor the draft holds twice, a tied head's too)."""
        target = {id(p) for p in self.get_model().parameters()}
        return {n for n, p in draft.named_parameters(remove_duplicate=False) if id(p) in target}

    def da_draft_state(self, full: bool = False) -> dict:
        draft = self.get_draft_model()
        if draft is None:
            return {"checksum": None, "version": None, "shared": []}
        shared = self._da_shared(draft)
        return {"checksum": module_checksum(draft, shared, full), "version": getattr(self, "_da_draft_version", None),
                "shared": sorted(shared)}

    def da_load_draft(self, path: str, sha256: str | None, version: int | None) -> dict:
        """Load a published draft file into the running drafter; returns the new state and ms.

        A tensor aimed at a module the draft shares with the target (e.g. ``embed_tokens``) would
        overwrite the policy: refused, unless it equals what serves already (then it is a no-op).
        """
        t0 = time.perf_counter()
        draft = self.get_draft_model()
        if draft is None:
            raise RuntimeError("this engine was started without a draft; nothing to swap")
        weights = _read_checkpoint(path, sha256)
        bad = [name for name, t in weights.items() if not all_finite(t)]
        if bad:
            raise ValueError(f"{path}: tensors {bad[:4]} hold NaN or Inf; a draft like that accepts nothing")
        shared = self._da_shared(draft)
        if shared:
            params = dict(draft.named_parameters())
            for ckpt_name in list(weights):
                hit = [n for n in shared if n.endswith(ckpt_name.removeprefix("model."))]
                if not hit:
                    continue
                live = params[hit[0]]
                if live.shape == weights[ckpt_name].shape and torch.equal(live.detach().cpu(), weights[ckpt_name].to(live.dtype)):
                    del weights[ckpt_name]
                    continue
                raise ValueError(
                    f"{path}: {ckpt_name} would overwrite the target's shared {hit[0]} (the policy); "
                    "export the draft without it (shared embeddings) or with its own distinct copy from the start"
                )
        self._da_reload(draft, weights, self.vllm_config.speculative_config.draft_model_config, shared)
        self._da_draft_version = version
        ms = (time.perf_counter() - t0) * 1e3
        return {"checksum": module_checksum(draft, shared), "version": version, "worker_ms": ms,
                "shared": sorted(shared)}

    def da_load_policy(self, weights: str | dict[str, torch.Tensor], checksum: bool = False) -> dict:
        """New policy weights, in place: a safetensors path, or (in-process engine) the trainer's
        tensors themselves, in any float dtype (the loader copies each into its parameter's).
        ``checksum``: also read the served weights back (a pass over the whole model)."""
        t0 = time.perf_counter()
        model = self.get_model()
        if isinstance(weights, str):
            weights = _read_checkpoint(weights, None)  # a temporary file of ours, or the caller's own
        self._da_reload(model, weights, self.vllm_config.model_config)
        out = {"worker_ms": (time.perf_counter() - t0) * 1e3}
        if checksum:
            out["policy_checksum"] = module_checksum(model)
        return out

    def da_policy_checksum(self, full: bool = False) -> str:
        return module_checksum(self.get_model(), full=full)

    def da_drafter_idle(self, idle: bool | None) -> dict:
        """While ``idle``, a step whose scheduled draft length is 0 runs no drafter at all.

        vLLM runs the drafter's first pass even when its k table says 0 for the batch size
        ("Dynamic SD decided K=0"), to keep the drafter's KV cache in step with the target's; on
        this CPU that pass made a k = 0 step cost 1.16-1.65x a plain one (docs/design.md,
        "Stepping aside"). The engine turns idle on only while its whole table is 0, and changes
        the table only between generations, so no request that is ever drafted misses a pass:
        every request that lives through an idle generation is never drafted. Verification is
        untouched (no draft tokens are proposed, so every sampled token is the target's own).
        ``idle=None`` changes nothing. Returns whether the runner idles, how many steps it has
        run without the drafter so far, and how many steps drafted nothing for any request and
        so sampled without the rejection sampler (``draftadapt/engine/zero_draft.py``).
        """
        runner = self.model_runner
        if not hasattr(runner, "_da_propose"):
            runner._da_propose = runner.propose_draft_token_ids
            runner._da_drafter_idle, runner._da_idle_steps = False, 0

            def propose(scheduler_output, *args, **kwargs):
                if runner._da_drafter_idle and scheduler_output.num_spec_tokens_to_schedule == 0:
                    runner._da_idle_steps += 1
                    # what the proposer itself returns for K=0: no draft token for any request
                    return torch.empty(len(runner.input_batch.req_ids), 0, dtype=torch.int64, device=runner.device)
                return runner._da_propose(scheduler_output, *args, **kwargs)

            runner.propose_draft_token_ids = propose
        if idle is not None:
            runner._da_drafter_idle = bool(idle)
        return {"idle": runner._da_drafter_idle, "idle_steps": runner._da_idle_steps,
                "zero_draft_steps": getattr(runner, "_da_zero_draft_steps", 0)}
