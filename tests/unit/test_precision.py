"""engine_dtype: the rollout engines' serving dtype for a precision setting (draftadapt/precision.py)."""

from __future__ import annotations

import json

import pytest
import torch

from draftadapt.precision import engine_dtype


def _model(tmp_path, name, hidden_size, dtype="float32"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": hidden_size, "torch_dtype": dtype}))
    return d


def test_auto_serves_bf16_only_where_this_cpu_multiplies_it_and_the_model_is_wide(tmp_path, monkeypatch):
    """AMX tiles (Xeon) or avx512_bf16 (EPYC) and a model >= 512 wide: bf16; a CPU with neither, or
    the toy's 128, the model's own dtype."""
    wide, narrow = _model(tmp_path, "smollm2", 576), _model(tmp_path, "toy", 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for amx, avx512_bf16 in ((True, True), (False, True), (False, False)):
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda amx=amx: amx)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda v=avx512_bf16: v)
        assert engine_dtype("auto", wide) == ("bfloat16" if avx512_bf16 else None)  # None: the model's own dtype
        assert engine_dtype("auto", narrow) is None
        assert engine_dtype("bf16", narrow) == "bfloat16" and engine_dtype("fp32", wide) == "float32"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert engine_dtype("auto", wide) is None  # a GPU serves the checkpoint's dtype


def test_a_bad_setting_is_named_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"engine precision 'half': use 'auto' .* 'bf16' or 'fp32'"):
        engine_dtype("half", _model(tmp_path, "m", 576))
