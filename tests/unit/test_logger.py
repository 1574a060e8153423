"""The metric logger: namespaced names, JSON lines, stdout, TensorBoard, rank gating."""

from __future__ import annotations

import io
import json

import pytest

from draftadapt.metrics.logger import JsonlLogger, MultiLogger, StdoutLogger, make_logger


def test_jsonl_and_stdout(tmp_path):
    buf = io.StringIO()
    logger = MultiLogger([JsonlLogger(tmp_path / "m.jsonl"), StdoutLogger(stream=buf)])
    logger.log_dict({"train/loss": 0.5, "accept/pos_0": 0.8}, step=3)
    logger.log("accept/simulated_length", float("nan"), step=4)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert rows[0]["step"] == 3 and rows[0]["train/loss"] == 0.5 and rows[0]["accept/pos_0"] == 0.8
    assert rows[1]["accept/simulated_length"] is None  # NaN is not valid JSON
    assert "step 3 | train/loss 0.5 | accept/pos_0 0.8" in buf.getvalue()


def test_names_must_be_namespaced(tmp_path):
    logger = make_logger(["jsonl"], tmp_path)
    with pytest.raises(ValueError, match="namespaced"):
        logger.log_dict({"loss": 1.0}, step=0)
    with pytest.raises(ValueError, match="unknown logger backend"):
        make_logger(["wandb"], tmp_path)


def test_tensorboard_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = make_logger(["tensorboard"], tmp_path)
    for step in range(3):
        logger.log_dict({"train/loss": 1.0 / (step + 1), "accept/simulated_length": 2.0 + step}, step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tb"))
    acc.Reload()
    assert {"train/loss", "accept/simulated_length"} <= set(acc.Tags()["scalars"])
    assert [e.value for e in acc.Scalars("accept/simulated_length")] == [2.0, 3.0, 4.0]


def test_disabled_on_other_ranks(tmp_path):
    logger = make_logger(["jsonl", "tensorboard"], tmp_path / "r1", enabled=False)
    logger.log_dict({"train/loss": 1.0}, step=0)
    logger.close()
    assert not (tmp_path / "r1").exists()
