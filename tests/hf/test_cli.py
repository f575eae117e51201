"""The command line on a Hugging Face model: ``pipetrain profile hf:DIR --meta`` (built on the
meta device, a layer at a time), ``pipetrain plan`` of that profile, the
``pipetrain.hf.task:text`` task trained from the plan, and (slow) ``pipetrain train`` in two
processes followed by ``pipetrain consolidate --hf``, loaded back by transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import pipetrain
from partitioner import Plan
from pipetrain.hf.task import text
from pipetrain.tools.cli import main
from tests.hf.models import BEFORE_5, LLAMA_LIKE, transformers

TEXT = "examples/data/kjv-gospels-acts.txt.gz"  # byte-level: vocabulary 256


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, Path]:
    """A byte-level Llama saved with weights, and a 2-stage plan made from its meta profile."""
    root = tmp_path_factory.mktemp("planned")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**LLAMA_LIKE, "vocab_size": 256})
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    assert main(["profile", f"hf:{root / 'model'}", "--meta", "--input-shape", "2,16",
                 "--input-dtype", "int64", "--input-high", "256", "--repeats", "1",
                 "--warmup", "0", "-o", str(root / "profile.json")]) == 0
    assert main(["plan", str(root / "profile.json"), "--stages", "2", "--microbatches", "2",
                 "-o", str(root / "plan.json")]) == 0
    return root / "model", root / "plan.json"


def test_profile_names_the_models_parts(planned) -> None:
    _, plan = planned
    names = [layer["name"] for layer in json.loads(
        (plan.parent / "profile.json").read_text())["layers"]]
    assert names == ["model.embed_tokens:Embedding", "model.layers.0:LlamaDecoderLayer",
                     "model.layers.1:LlamaDecoderLayer", "model.norm:LlamaRMSNorm",
                     "lm_head:Linear"]
    assert sum(Plan.load(plan).balance) == 5


def test_plan_of_a_model_says_to_profile_it_first(planned, capsys) -> None:
    folder, _ = planned
    assert main(["plan", f"hf:{folder}", "--stages", "2", "--microbatches", "2"]) == 2
    assert f"pipetrain profile hf:{folder} --meta" in capsys.readouterr().err


def test_the_text_task_trains_from_the_plan(planned) -> None:
    """The task's model starts from the directory's weights: its first loss is the model's."""
    folder, plan = planned
    task = text(str(folder), TEXT, batch=4, seq=16)
    (ids, mask), targets = task.batch(0)
    assert ids.shape == (4, 16) and int(ids.max()) < 256
    expected = transformers.AutoModelForCausalLM.from_pretrained(folder)(
        ids, attention_mask=mask, labels=ids).loss.item()
    pipe = pipetrain.Pipeline(task.model, plan=plan, devices=["cpu", "cpu"],
                              loss_fn=task.loss_fn, optimizer=task.optimizer, **task.options)
    assert abs(float(pipe.train_step((ids, mask), targets)) - expected) < 1e-5
    losses = [float(pipe.train_step(*task.batch(step))) for step in range(1, 4)]
    assert all(torch.isfinite(torch.tensor(losses)))


def test_a_config_alone_trains_from_transformers_initialization(planned, tmp_path) -> None:
    folder, plan = planned
    transformers.AutoConfig.from_pretrained(folder).save_pretrained(tmp_path)
    task = text(str(tmp_path), TEXT, batch=4, seq=16)
    assert "weights" not in task.options and task.options["init_seed"] == 0
    pipe = pipetrain.Pipeline(task.model, plan=plan, devices=["cpu", "cpu"],
                              loss_fn=task.loss_fn, optimizer=task.optimizer, **task.options)
    state = pipe.module.state_dict()
    assert torch.equal(state["model.norm.weight"], torch.ones(32))  # transformers' rule
    assert 0.01 < float(state["model.embed_tokens.weight"].std()) < 0.03  # std 0.02
    assert abs(float(pipe.train_step(*task.batch(0))) - 5.545) < 0.05  # ln 256: near uniform


def test_tokens_beyond_the_vocabulary_are_refused(planned, tmp_path) -> None:
    folder, _ = planned
    ids = tmp_path / "ids.npy"
    np.save(ids, np.array([1, 2, 300] * 20))
    with pytest.raises(ValueError, match="token id 300, beyond the model's vocabulary of 256"):
        text(str(folder), str(ids), batch=2, seq=8)


@pytest.mark.slow  # two processes importing transformers, then a third to consolidate
def test_train_command_then_consolidate(planned, tmp_path) -> None:
    folder, plan = planned
    kwargs = json.dumps({"model": str(folder), "tokens": TEXT, "batch": 4, "seq": 16})
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "pipetrain", "train", "pipetrain.hf.task:text", "--kwargs",
         kwargs, "--plan", str(plan), "--steps", "3", "--checkpoint-dir",
         str(tmp_path / "ckpt")], capture_output=True, text=True, timeout=300, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "trained to step 3" in done.stdout
    assert main(["consolidate", str(tmp_path / "ckpt"), "--hf", str(folder), "-o",
                 str(tmp_path / "out")]) == 0
    _, info = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", output_loading_info=True)
    assert not any(info.values())


@pytest.mark.parametrize(("name", "extra"), [
    ("Mixtral", {"num_local_experts": 4}),
    ("Qwen2Moe", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                  "shared_expert_intermediate_size": 16}),
    ("Gemma3Text", {"head_dim": 8}),  # its embedding scale: made on the CPU, the rest meta
])
def test_profile_on_meta_of_experts_and_scaled_embeddings(name, extra, tmp_path, capsys) -> None:
    """Mixtures of experts run torch's grouped matrix product, whose meta kernel takes only
    bfloat16: a float32 model's meta forward still gives its shapes."""
    made = getattr(transformers, f"{name}Config")(**LLAMA_LIKE, pad_token_id=0, **extra)
    built = transformers.AutoModelForCausalLM.from_config(made)
    built.save_pretrained(tmp_path / "model")
    done = main(["profile", f"hf:{tmp_path / 'model'}", "--meta", "--input-shape", "2,16",
                 "--input-dtype", "int64", "--input-high", "64", "--repeats", "1",
                 "--warmup", "0", "-o", str(tmp_path / "profile.json")])
    if BEFORE_5:  # 4.56's experts route by value, its Gemma 3 blocks take tables made outside
        why = "cannot run on the meta device with" if name != "Gemma3Text" else "with"
        assert done == 2
        assert f"{why} transformers 4." in capsys.readouterr().err
        return
    assert done == 0
    layers = json.loads((tmp_path / "profile.json").read_text())["layers"]
    block = type(built.model.layers[0]).__name__
    assert [layer["name"] for layer in layers][1:3] == [f"model.layers.0:{block}",
                                                       f"model.layers.1:{block}"]
    hidden, masks = 2 * 16 * 32 * 4, 2 * (2 * 16 * 8)  # fp32 hidden, int64 mask and positions
    assert layers[1]["activation_bytes"] == hidden + masks
