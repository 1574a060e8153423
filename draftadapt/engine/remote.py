"""A RolloutEngine in a child process of its own, driven through a pipe.

Asynchronous RL generates while the trainer trains. In one process the two share Python's global
interpreter lock, and on a small model both are dispatch-bound: a generation thread beside the
policy update made each ~25% slower than alone (docs/design.md, "Asynchronous RL"). In a child
process the engine keeps its own interpreter; the host thread that waits for it blocks on the
pipe and holds nothing.

    engine = EngineProcess(target, draft, method="eagle3", num_speculative_tokens=3, threads=1)
    result = engine.generate(prompts, temperature=1.0, max_tokens=96, seed=0)  # as RolloutEngine
    engine.update_policy(policy.state_dict(), version=1)
    engine.close()

Every RolloutEngine method and attribute is reached the same way (``engine.policy_version``,
``engine.swap_draft(path)``, ...): the call runs in the child, its result or its exception comes
back. One call at a time: calls from several host threads are serialised.
"""

from __future__ import annotations

import inspect
import multiprocessing as mp
import os
import threading
import traceback
from typing import Any

import torch

_GET, _CALL, _SET_THREADS, _CLOSE = "get", "call", "set_threads", "close"


class EngineProcessError(RuntimeError):
    """The engine's child process failed or died; the message carries its traceback."""


def _serve(conn, kwargs: dict) -> None:
    """The child: one RolloutEngine, requests answered in order until close or the host goes."""
    from draftadapt.engine.rollout import RolloutEngine

    try:
        engine = RolloutEngine(**kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the host, which raises it
        conn.send(("error", exc, traceback.format_exc()))
        return
    conn.send(("ok", None, None))
    try:
        while True:
            try:
                op, name, args, kw = conn.recv()
            except EOFError:  # the host is gone: nothing left to serve
                return
            if op == _CLOSE:
                break
            try:
                if op == _GET:
                    value = getattr(engine, name)
                    out = ("callable", None, None) if callable(value) else ("ok", value, None)
                elif op == _SET_THREADS:
                    torch.set_num_threads(*args)
                    out = ("ok", torch.get_num_threads(), None)
                else:
                    out = ("ok", getattr(engine, name)(*args, **kw), None)
            except BaseException as exc:  # noqa: BLE001 - raised again in the host
                out = ("error", exc, traceback.format_exc())
            conn.send(out)
    finally:
        engine.close()
        try:
            conn.send(("ok", None, None))
        except (BrokenPipeError, OSError):
            pass


class EngineProcess:
    """A :class:`~draftadapt.engine.rollout.RolloutEngine` (same arguments) in a child process."""

    def __init__(self, *args, **kwargs):
        from draftadapt.engine.rollout import RolloutEngine

        # bind the arguments here: a wrong one fails in the host, with RolloutEngine's message
        bound = inspect.signature(RolloutEngine.__init__).bind(None, *args, **kwargs)
        bound.apply_defaults()
        params = {k: v for k, v in bound.arguments.items() if k != "self"}
        params["in_process"] = True  # the child runs vLLM in itself: one process, not three
        ctx = mp.get_context("spawn")  # vLLM and torch state are not fork-safe
        self._conn, child = ctx.Pipe()
        self._lock = threading.Lock()
        self._proc = ctx.Process(target=_serve, args=(child, params), name="draftadapt-engine", daemon=True)
        # The child reads the environment when it starts. OpenMP's passive waiting (the `draftadapt
        # pretrain` command sets it, a user may too; docs/design.md, "Asynchronous RL") made its
        # two-thread generation run on one core: 1600 tokens/s against 3300 with libgomp's default
        # short spin. Not inherited.
        wait_policy = os.environ.pop("OMP_WAIT_POLICY", None)
        try:
            self._proc.start()
        finally:
            if wait_policy is not None:
                os.environ["OMP_WAIT_POLICY"] = wait_policy
        child.close()
        self._closed = False
        self._reply()  # the engine started (or its error is raised here)

    def _reply(self) -> Any:
        try:
            status, value, tb = self._conn.recv()
        except EOFError:
            raise EngineProcessError(f"the engine process (pid {self._proc.pid}) died; exit code "
                                     f"{self._proc.exitcode}: see its log above") from None
        if status == "error":
            # the child's own exception type when it pickles (DraftSwapError and friends)
            if isinstance(value, BaseException):
                raise value from EngineProcessError(f"in the engine process:\n{tb}")
            raise EngineProcessError(f"in the engine process:\n{tb}")
        return status, value

    def _ask(self, op: str, name: str, args=(), kw=None) -> Any:
        if self._closed:
            raise EngineProcessError("this engine process is closed")
        with self._lock:
            self._conn.send((op, name, args, kw or {}))
            return self._reply()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        status, value = self._ask(_GET, name)
        if status != "callable":
            return value
        return lambda *args, **kw: self._ask(_CALL, name, args, kw)[1]

    def set_threads(self, n: int) -> int:
        """The child's torch threads for what it runs next (its generation); returns the count."""
        return self._ask(_SET_THREADS, "", (int(n),))[1]

    def close(self) -> None:
        if self._closed:
            return
        try:
            with self._lock:
                self._conn.send((_CLOSE, "", (), {}))
                self._conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            pass
        finally:
            self._closed = True
            self._conn.close()
            self._proc.join(timeout=60)
            if self._proc.is_alive():
                self._proc.kill()
