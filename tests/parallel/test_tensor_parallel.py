"""The ``parallel`` section: degrees on one device mesh, tensor-parallel plans, and exactness against one process.

The multi-process runs are real gloo process groups on the CPU (tests/helpers/parallel_worker.py).
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from torch import nn

import torchrig
from torchrig.config import Config, ConfigError, set_key, validate
from torchrig.parallel import ParallelConfigError, resolve_degrees, tensor_parallel

from helpers import dist_procs
from helpers import parallel_worker as W


def degrees(world: int, strategy: str = "auto", **given) -> dict:
    p = types.SimpleNamespace(**{"dp_replicate": "auto", "dp_shard": "auto", "tp": 1, "pp": 1, **given})
    return resolve_degrees(p, strategy, world)


def test_degrees_take_the_rest_of_the_ranks():
    assert degrees(4, tp=2) == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 2, "pp": 1}
    assert degrees(4, "fsdp", tp=2) == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1}
    assert degrees(8, dp_shard=2, tp=2) == {"dp_replicate": 2, "dp_shard": 2, "cp": 1, "tp": 2, "pp": 1}
    assert degrees(8, dp_replicate=1, tp=-1) == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 8, "pp": 1}
    assert degrees(2, "ddp") == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 1}  # dist.strategy alone
    assert degrees(2, "fsdp") == {"dp_replicate": 1, "dp_shard": 2, "cp": 1, "tp": 1, "pp": 1}


@pytest.mark.parametrize("world, given, words", [
    (3, dict(tp=2), "config key 'parallel': tp=2 needs a multiple of 2 processes, but the job has 3"),
    (4, dict(dp_replicate=2, dp_shard=1, tp=2, pp=2), "config key 'parallel': dp_replicate=2 × tp=2 × pp=2 needs exactly 8 "
                                                    "processes, but the job has 4; start 8 with torchrig launch"),
    (4, dict(dp_replicate=1, dp_shard=1, tp=2), "config key 'parallel': dp_replicate × dp_shard × cp × tp × pp = 1 × 1 × 1 × 2 × 1 = 2 "
                                       "processes, but the job has 4; set one degree to -1"),
])
def test_degrees_that_do_not_fit_the_world_name_the_key(world, given, words):
    with pytest.raises(ParallelConfigError) as err:
        degrees(world, **given)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


@pytest.mark.parametrize("sets, words", [
    ({"parallel.tp": -1, "parallel.dp_shard": -1}, "config key 'parallel.tp': -1 (the rest of the ranks) is "
                                                    "already given to parallel.dp_shard"),
    ({"parallel.tp": 2, "parallel.tp_plan": "auto", "dist.strategy": "dp"}, "config key 'dist.strategy': 'dp'"),
    ({"parallel.dp_shard": 2, "dist.strategy": "ddp"}, "config key 'parallel.dp_shard': 2 shards the model, but "
                                                        "dist.strategy=ddp replicates it"),
    ({"parallel.tp": 2}, "config key 'parallel.tp_plan': parallel.tp=2 splits the layers a plan names, and no "
                         "plan is set"),
])
def test_bad_combinations_are_one_line_naming_the_key(sets, words):
    cfg = Config()
    for k, v in sets.items():
        set_key(cfg, k, v)
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_plans_are_checked_against_the_model():
    block = W.Block()
    assert tensor_parallel.resolve(block, {"attn.*": "colwise"}, 2) == {
        "attn.q": "colwise", "attn.k": "colwise", "attn.v": "colwise", "attn.o": "colwise"}
    cases = [
        ({"attn.qq": "colwise"}, "config key 'parallel.tp_plan': 'attn.qq' matches no module of Block; did you mean "
                                 "'attn.q'"),
        ({"attn.q": "columnwise"}, "config key 'parallel.tp_plan': style 'columnwise' of 'attn.q' is not one of"),
        ({"norm1": "colwise"}, "config key 'parallel.tp_plan': module 'norm1' is a LayerNorm; the style 'colwise' "
                               "splits nn.Linear and nn.Embedding layers only"),
    ]
    for plan, words in cases:
        with pytest.raises(ParallelConfigError, match="^" + words):
            tensor_parallel.resolve(block, plan, 2)
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.tp_plan': module 'head' \(rowwise\) has 16 "
                                                  r"input features, which parallel.tp=3 does not divide"):
        tensor_parallel.resolve(block, {"head": "rowwise"}, 3)
    with pytest.raises(ParallelConfigError, match="^config key 'parallel.tp_plan': auto, but Block declares no "
                                                  "tensor-parallel plan"):
        tensor_parallel.resolve(block, "auto", 2)
    # heads a rank would hold in part: a head_dim the split output features do not hold whole, or a head count
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.tp': 4 does not divide the 2 attention heads "
                                                  r"\(of 8 features\) of module 'attn': 'attn.q' has 16 output features"):
        tensor_parallel.resolve(W.Block(dim=16, heads=2), {"attn.q": "colwise"}, 4)
    counted = W.Block()
    counted.attn.num_heads = 3
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.tp': 2 does not divide the 3 attention heads "
                                                  r"of module 'attn' \(num_heads\)"):
        tensor_parallel.resolve(counted, {"attn.q": "colwise"}, 2)
    assert tensor_parallel.resolve(counted, {"head": "colwise"}, 2) == {"head": "colwise"}  # attention left whole


def test_auto_plans_of_torchrig_models_and_hugging_face_models():
    from torchrig.models.small import MLP
    from torchrig.models.text import BertClassifier

    assert tensor_parallel.resolve(MLP(depth=2, dropout=0.1), "auto", 2) == {"net.1": "colwise", "net.4": "rowwise"}
    bert = BertClassifier(vocab_size=50, num_classes=3, layers=2)
    assert tensor_parallel.resolve(bert, "auto", 2) == {
        "encoder.0.mlp.0": "colwise", "encoder.0.mlp.2": "rowwise", "encoder.1.mlp.0": "colwise",
        "encoder.1.mlp.2": "rowwise"}
    if not W.has_transformers():
        return
    plan = tensor_parallel.resolve(W.llama(), "auto", 2)
    assert plan["model.layers.0.self_attn.q_proj"] == "colwise" and plan["model.layers.0.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.tp': 4 does not divide the model's 2 "
                                                  r"attention heads \(num_key_value_heads\)"):
        tensor_parallel.resolve(W.llama(), "auto", 4)
    from helpers.pipeline_worker import gpt2  # GPT-2's layers are transformers Conv1D: no plan, and none would split

    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.tp_plan': auto, but GPT2LMHeadModel "
                                                  r"declares no tensor-parallel plan, and its layers are transformers "
                                                  r"Conv1D .*; use parallel.pp or dist.strategy=fsdp for this model$"):
        tensor_parallel.resolve(gpt2(), "auto", 2)


def one_process(tmp_path, scenario: str, name: str, dp: int, **extra) -> dict:
    """The parameters of one process trained on every rank's samples of each step (a batch ``dp`` times larger)."""
    make_model, data, plan = W.runs(W.BATCH * W.STEPS * dp, scenario)[name]
    extra.update({k: v for k, v in plan.items() if not k.startswith("parallel.")})  # the loss
    t = torchrig.Trainer(W.build(make_model), **W.settings(tmp_path / f"one-{name}", batch_size=W.BATCH * dp, **extra))
    t.fit(data)
    return W.params(t.model), *W.inference(t, data)


def run_scenario(tmp_path, scenario: str):
    return dist_procs.scenario(tmp_path, scenario, W.SCENARIOS[scenario][1], dist_procs.HELPERS / "parallel_worker.py")


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory):
    """One pair of processes for every tp=2 test: the three models, then the checkpoint runs."""
    return run_scenario(tmp_path_factory.mktemp("tp"), "tp")


def check_against_one_process(tmp_path, out, scenario: str) -> None:
    degrees_, world = W.SCENARIOS[scenario]
    seen = json.loads((out / "seen.json").read_text())
    dp = world // degrees_["parallel.tp"]
    for name in W.runs(1, scenario):
        assert seen[name]["dp"] == dp
        assert seen[name]["local"] < 0.9  # the model was split: this rank holds a part of the planned layers
        extra = {k: v for k, v in degrees_.items() if not k.startswith("parallel.")}
        (ref, ev, predicted), got = one_process(tmp_path, scenario, name, dp, **extra), torch.load(out / f"{name}.pt")
        # dp=1: the same evaluation batches as one process, so the same loss (a token loss averaged over batches of
        # another size would weigh the batches otherwise)
        assert seen[name]["eval"].keys() == ev.keys()
        assert dp > 1 or all(abs(seen[name]["eval"][k] - v) < 1e-5 for k, v in ev.items()), (seen[name]["eval"], ev)
        if predicted is not None:  # predict of the split model, gathered over the data-parallel ranks only
            assert torch.allclose(torch.load(out / f"{name}-predicted.pt"), predicted, atol=1e-5)
        assert ref.keys() == got.keys()
        worst = max((ref[k] - got[k]).abs().max().item() for k in ref)
        assert worst < 1e-5, f"{scenario} {name}: parameters differ from one process by {worst:.3g}"
        start = W.params(W.build(W.runs(1, scenario)[name][0]))
        assert max((start[k] - got[k]).abs().max().item() for k in ref) > 1e-3  # 20 steps changed them


@pytest.mark.slow
def test_tensor_parallel_matches_one_process(tmp_path, tp_run):
    """tp=2 on two processes: an MLP (its own plan), a transformer block with attention (gradients clipped by
    their norm) and a Hugging Face Llama (``tp_plan: auto``) after 20 AdamW steps hold the parameters one
    process gets, within 1e-5."""
    check_against_one_process(tmp_path, tp_run, "tp")


@pytest.mark.slow
def test_the_non_finite_decision_is_the_same_on_every_rank(tp_run):
    """One rank's piece of a split gradient is NaN: both ranks skip that step (on_nonfinite=skip), so the layers
    every rank holds whole stay equal."""
    r0, r1 = (json.loads((tp_run / f"nonfinite-{rank}.json").read_text()) for rank in (0, 1))
    assert (r0["skipped"], r1["skipped"]) == (1, 1) and r0["steps"] == r1["steps"] == 6
    assert r0["head"] == r1["head"]


@pytest.mark.slow
def test_the_cpu_alltoall_warning_is_not_shown(tp_run):
    """A forward that reshards a split activation makes torch's DTensor warn, from every rank, that gloo has no
    all-to-all (an all-gather does its work: known and harmless): not shown while torchrig runs the model."""
    for rank in (0, 1):
        assert (tp_run / f"reshards-{rank}").read_text() == "done"
        log = (tp_run / f"tp-{rank}.err").read_text() + (tp_run / f"tp-{rank}.out").read_text()
        assert "does not support alltoall" not in log, log[-3000:]


@pytest.mark.slow
def test_fsdp_times_tensor_parallel_matches_one_process(tmp_path):
    """dp_shard=2 × tp=2 on four processes: FSDP2 over the data-parallel sub-mesh, TP inside; loss counts and
    metrics reduced over the two data-parallel ranks only, so one process with a batch twice as large agrees."""
    check_against_one_process(tmp_path, run_scenario(tmp_path, "fsdp_tp"), "fsdp_tp")


def test_a_model_without_a_group_is_left_whole(tmp_path):
    """One process: the layout is one process, no mesh, and the model is neither split nor moved."""
    model = nn.Linear(4, 2)
    t = torchrig.Trainer(model, **W.settings(tmp_path / "one"))
    assert t.layout.mesh is None and t.layout.describe() == "one process" and t.wrapped is model
    assert t.layout.groups.dp_size() == 1 and t.plan.dp_size == 1
    t.close()
    t = torchrig.Trainer(nn.Linear(4, 2), tp_plan={"fc1": "colwise"}, dp_shard=1, dp_replicate=1, tp=1,
                         **W.settings(tmp_path / "keywords"))  # the Trainer's keywords of the parallel keys
    assert (t.cfg.parallel.tp_plan, t.cfg.parallel.dp_shard, t.cfg.parallel.tp) == ({"fc1": "colwise"}, 1, 1)
    t.close()


@pytest.mark.slow
def test_tensor_parallel_checkpoints_resume_exactly_and_load_in_one_process(tmp_path, tp_run):
    """tp=2 saves through DCP (every rank its shards) beside a whole model.safetensors: resumed mid-epoch in the
    same layout it ends bitwise where the uninterrupted run ended, and one process evaluates its weights."""
    from safetensors.torch import load_file

    out = tp_run
    saved = torch.load(out / "resume.pt")
    assert saved["steps"] == (20, 20)
    whole, resumed = saved["whole"], saved["resumed"]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole), "resumed at step 7 of tp=2: not bitwise equal"
    final = out / "whole" / "checkpoints" / "step-00000020"
    assert (final / "sharded" / ".metadata").is_file()
    weights = load_file(str(final / "model.safetensors"))
    assert weights.keys() == whole.keys() and all(torch.equal(weights[k], whole[k]) for k in whole)
    bare = W.Block()
    bare.load_state_dict(weights)  # plain PyTorch, one process
    t = torchrig.Trainer(W.Block(), **W.settings(tmp_path / "eval"))
    torchrig.load_weights(t.model, final)  # what torchrig evaluate / predict do with a checkpoint
    metrics = t.evaluate(W.features(16, W.SEQ, 16))
    assert all(torch.equal(p, q) for p, q in zip(t.model.state_dict().values(), whole.values()))
    x = W.features(16, W.SEQ, 16).tensors[0]
    assert torch.equal(t.predict(x), torch.softmax(bare(x), dim=1).detach()) and metrics["loss"] > 0


def test_the_documented_plan_is_a_valid_config(tmp_path):
    """The tensor-parallel example of docs/scaling-out.md loads and validates as written."""
    import re

    from torchrig.config import load_config

    text = (dist_procs.HELPERS.parents[1] / "docs" / "scaling-out.md").read_text()
    section = text[text.index("### Tensor parallelism"):]
    block = re.search(r"```yaml\n(.*?)```", section, re.S).group(1)
    (tmp_path / "tp.yaml").write_text(block)
    cfg = load_config(tmp_path / "tp.yaml")
    assert cfg.parallel.tp == 2 and cfg.parallel.tp_plan["layers.*.attn.o"] == "rowwise"
