"""A speculative step that drafted nothing samples like a plain one: installed in every vLLM process.

vLLM 0.32 sends every step of a speculative engine through its rejection sampler, also a step in
which no request has a draft token (every prefill step, and every step while the k table says
0). There the rejection sampler's output is its bonus token, drawn by the engine's ordinary
sampler from the target's logits, exactly as a plain engine draws it; but before returning it
the rejection sampler draws exponential noise over the whole vocabulary for every request
(``sample_recovered_tokens``: one ``[batch, vocab]`` tensor) and throws it away. On SmolLM2's
49,152-token vocabulary at 32 sequences that noise was 31 ms of a 186 ms step on a 2-core AMD
EPYC (cProfile, docs/results.md "Stepping aside"): most of what a k = 0 step cost over a plain
engine.

Lossless by construction: with no draft token there is nothing to accept or reject, and the
token (and its log-probability) is the ordinary sampler's draw from the same logits with the same
per-request generator, so a seeded request gets the same token either way. The draft-free path
is taken only when no request in the step has a draft; a step with any draft token goes through
the rejection sampler unchanged.

Guarded by version (0.32.x, whose ``GPUModelRunner._sample(logits, spec_decode_metadata)`` this
wraps; the CPU runner inherits it). ``DRAFTADAPT_DISABLE_ZERO_DRAFT_SAMPLER=1`` turns it off.
"""

from __future__ import annotations

import os

PATCHED_VERSIONS = ("0.32.",)
DISABLE_ENV = "DRAFTADAPT_DISABLE_ZERO_DRAFT_SAMPLER"
ACTIVE_ENV = "DRAFTADAPT_ZERO_DRAFT_SAMPLER_ACTIVE"


def drafted_nothing(spec_decode_metadata) -> bool:
    """Whether a step's speculative metadata holds no draft token for any request."""
    return spec_decode_metadata is not None and not any(spec_decode_metadata.num_draft_tokens)


def needed() -> bool:
    from draftadapt.engine.cpu_fix import plugin_wanted

    return plugin_wanted(DISABLE_ENV, PATCHED_VERSIONS, cpu_only=False)


def register() -> None:
    """The ``vllm.general_plugins`` entry point (loaded in every vLLM process, more than once)."""
    if not needed():
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    original = GPUModelRunner._sample
    if getattr(original, "_draftadapt_zero_draft", False):
        return

    def _sample(self, logits, spec_decode_metadata):
        if drafted_nothing(spec_decode_metadata):
            # logits hold one row per request (its bonus position), in request order
            self._da_zero_draft_steps = getattr(self, "_da_zero_draft_steps", 0) + 1
            spec_decode_metadata = None
        return original(self, logits, spec_decode_metadata)

    _sample._draftadapt_zero_draft = True
    _sample.__wrapped__ = original
    GPUModelRunner._sample = _sample
    os.environ[ACTIVE_ENV] = "1"
