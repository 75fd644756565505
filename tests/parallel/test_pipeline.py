"""Pipeline parallelism (``parallel.pp``): stages cut from the user's model, every schedule against one process,
pipeline × data parallelism, checkpoints, and the one-line refusals.

The multi-process runs are real gloo process groups on the CPU (tests/helpers/pipeline_worker.py).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from torch import nn

import torchrig
from torchrig.config import Config, ConfigError, set_key, validate
from torchrig.parallel import ParallelConfigError, plan_stages

from helpers import dist_procs
from helpers import pipeline_worker as W


def run_scenario(tmp_path, scenario: str):
    return dist_procs.scenario(tmp_path, scenario, W.SCENARIOS[scenario][1], dist_procs.HELPERS / "pipeline_worker.py")


@pytest.fixture(scope="module")
def pp_run(tmp_path_factory):
    """One pair of processes for every pp=2 test: each schedule, the Sequential, GPT-2, then the checkpoints."""
    return run_scenario(tmp_path_factory.mktemp("pp"), "pp")


def merged(out, name: str, ranks) -> dict:
    """The whole model's parameters from the ranks' parts (every rank of a pipeline holds its stages' names; the
    replicas of a stage hold the same values, bitwise)."""
    whole: dict = {}
    for rank in ranks:
        for k, v in torch.load(out / f"{name}-{rank}.pt").items():
            assert k not in whole or torch.equal(whole[k], v), f"{name}: the replicas of {k} differ"
            whole[k] = v
    return whole


def one_process(tmp_path, scenario: str, name: str, dp: int) -> tuple:
    """One process on the same micro-batches: the parameters, evaluation and predictions."""
    make_model, data, extra = W.runs(W.SAMPLES * dp, scenario)[name]
    extra = {k: v for k, v in extra.items() if not k.startswith("parallel.")}
    t = torchrig.Trainer(W.build(make_model), **W.settings(tmp_path / f"one-{name}", batch_size=W.BATCH * dp, **extra))
    t.fit(data)
    ev = t.evaluate(W.eval_data(data))
    ev.update({k: v for k, v in t.history[-1].items() if k.startswith("train/") and k != "train/loss"})
    predicted = t.predict(data.tensors[0][:10]) if isinstance(data, torch.utils.data.TensorDataset) else None
    params = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    t.close()
    return params, ev, predicted


def check_against_one_process(tmp_path, out, scenario: str, tolerance: float, names=None,
                              predicted_tolerance=None) -> None:
    degrees, world = W.SCENARIOS[scenario]
    dp = W.data_parallel(scenario)
    seen = [json.loads((out / f"seen-{rank}.json").read_text()) for rank in range(world)]
    for name in names or W.runs(1, scenario):
        ref, ev, predicted = one_process(tmp_path, scenario, name, dp)
        for rank in range(world):  # every rank has the last stage's evaluation and training metrics (dp=1: the same
            # batches as one process; a micro-batch a new schedule runs twice, to learn its shapes, counted once)
            got_ev = {**seen[rank][name]["eval"], **seen[rank][name]["train"]}
            assert got_ev.keys() == ev.keys()
            assert dp > 1 or all(abs(got_ev[k] - v) < tolerance for k, v in ev.items()), (name, got_ev, ev)
            assert not any(seen[rank][name]["outlived"]), (name, rank)  # nothing of the forward outlives backward
        got = merged(out, name, range(world))
        assert got.keys() == ref.keys(), (name, sorted(set(got) ^ set(ref)))
        worst = max((ref[k] - got[k]).abs().max().item() for k in ref)
        assert worst < tolerance, f"{scenario} {name}: parameters differ from one process by {worst:.3g}"
        start = W.build(W.runs(1, scenario)[name][0]).state_dict()
        assert max((start[k] - got[k]).abs().max().item() for k in ref) > 1e-3  # the steps changed them
        if predicted is not None:  # every rank returns the last stage's predictions
            for rank in range(world):
                assert torch.allclose(torch.load(out / f"{name}-predicted-{rank}.pt"), predicted,
                                      atol=predicted_tolerance or tolerance)


@pytest.mark.slow
def test_every_schedule_matches_one_process(tmp_path, pp_run):
    """pp=2 with gpipe, 1f1b, interleaved 1F1B and both zero-bubble schedules (two stages per rank where they take
    them), an nn.Sequential (clipped by the norm over both stages) and a Hugging Face GPT-2 split by name: after an
    epoch of AdamW steps over 93 samples (a last micro-batch of 1) with tokens counted on padded sequences, the
    parameters, evaluation and predictions are one process's with the same micro-batches, within 1e-6."""
    check_against_one_process(tmp_path, pp_run, "pp", 1e-6)
    seen = json.loads((pp_run / "seen-1.json").read_text())
    assert seen["tokens-1f1b"]["stages"] == [1] and seen["tokens-interleaved_1f1b"]["stages"] == [1, 3]
    assert seen["tokens-zbv_zero_bubble"]["stages"] == [1, 2]  # a V: rank 1 holds the middle two
    assert len(seen["sequential"]["outlived"]) >= 24 and "train/accuracy" in seen["sequential"]["train"]


@pytest.mark.slow
def test_pipeline_checkpoints_resume_bitwise_and_load_in_one_process(tmp_path, pp_run):
    """pp=2 saves through DCP (each rank its stages' names) beside a whole model.safetensors: resumed mid-epoch (step 4
    of 6) in the same layout it ends bitwise where the uninterrupted run ended, and one process evaluates it."""
    parts, whole, resumed = resumed_parts(pp_run, 2)
    assert set(parts[0]["whole"]).isdisjoint(parts[1]["whole"])  # each rank its own stage
    final, weights = check_resumed_and_consolidated(pp_run, whole, resumed, "resumed at step 4 of pp=2")
    bare = W.TokenNet()
    bare.load_state_dict(weights)  # plain PyTorch, one process
    t = torchrig.Trainer(W.TokenNet(), **W.settings(tmp_path / "eval", loss=W.token_loss))
    torchrig.load_weights(t.model, final)  # what torchrig evaluate / predict do with a checkpoint
    assert t.evaluate(W.eval_data(W.padded_tokens()))["loss"] > 0
    x = W.padded_tokens().tensors[0][:10]
    assert torch.equal(t.predict(x), bare(x).detach())
    t.close()


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_in_one_process_within_1e_6(tmp_path, pp_run):
    """The pp=2 checkpoint of step 4 (mid-epoch; each rank wrote its stage's weights and AdamW state by name)
    resumed in one process ends where the uninterrupted pp=2 run ended, up to float rounding."""
    resume_in_one_process(tmp_path, pp_run, 2, W.TokenNet, "pp=2")


def resume_in_one_process(tmp_path, out, ranks: int, model: type, layout: str) -> None:
    """The checkpoint of step 4 that the ``ranks`` processes of ``out`` wrote, resumed in one process, ends within
    1e-6 of their uninterrupted run (step 12)."""
    _, whole, _ = resumed_parts(out, ranks)
    ckpt = out / "whole" / "checkpoints" / "step-00000004"
    t = torchrig.Trainer(W.build(model), **W.settings(tmp_path / "one", loss=W.token_loss, epochs=2, resume=str(ckpt),
                                                      **{"checkpoint.save_final": False},
                                                      resume_changes="allow"))  # the worker's class was __main__'s
    t.fit(W.padded_tokens())
    got = t.model.state_dict()
    assert t.global_step == 12 and got.keys() == whole.keys()
    worst = max(float((got[k] - whole[k]).abs().max()) for k in whole)
    assert worst < 1e-6, f"{layout} step 4 resumed in one process: {worst:.3g} from the {layout} run"
    t.close()


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_under_fsdp2_on_two_processes_within_1e_6(tmp_path, pp_run):
    """The pp=2 checkpoint of step 4 (mid-epoch) resumed without a pipeline, sharded by FSDP2 over 2 processes
    (parallel.dp_shard=2, half the batch per rank: the same global batches), ends where the uninterrupted pp=2 run
    ended, up to float rounding."""
    resume_in_two_processes(tmp_path, pp_run, "sharded", "dp_shard=2")


def resume_in_two_processes(tmp_path, pp_out, how: str, layout: str) -> list:
    """The pp=2 checkpoint of step 4 in ``pp_out`` resumed by two processes of the worker's ``resume_{how}`` (in
    ``layout``): each ends within 1e-6 of the uninterrupted pp=2 run (step 12). Returns what each saved."""
    _, whole, _ = resumed_parts(pp_out, 2)
    ckpt = pp_out / "whole" / "checkpoints" / "step-00000004"
    out = tmp_path / how
    for r in dist_procs.processes([f"resume_{how}", str(out), str(ckpt)], 2, out, tmp_path / "store",
                                  worker=dist_procs.HELPERS / "pipeline_worker.py"):
        assert r.returncode == 0, r.output[-3000:]
    saved = [torch.load(out / f"{how}-{rank}.pt") for rank in (0, 1)]
    for got in saved:
        assert got["step"] == 12 and got["params"].keys() == whole.keys()
        worst = max(float((got["params"][k] - whole[k]).abs().max()) for k in whole)
        assert worst < 1e-6, f"pp=2 step 4 resumed at {layout}: {worst:.3g} from the pp=2 run"
    return saved


@pytest.mark.slow
def test_a_pipeline_checkpoint_resumes_at_tp2_within_1e_6(tmp_path, pp_run):
    """The pp=2 checkpoint of step 4 (mid-epoch; AdamW state keyed by parameter name) resumed without a pipeline,
    split by the model's own tensor-parallel plan over 2 processes (parallel.tp=2, parallel.tp_plan=auto: both ranks
    see the whole batch, the same global batches), ends where the uninterrupted pp=2 run ended, up to float
    rounding."""
    ckpt = pp_run / "whole" / "checkpoints" / "step-00000004"
    assert json.loads((ckpt / "meta.json").read_text())["optimizer_keys"] == "by_name"
    for got in resume_in_two_processes(tmp_path, pp_run, "tp", "tp=2"):
        assert got["plan"] == {"embed": "embedding_rowwise", **{f"blocks.{i}.fc": "colwise_rep" for i in range(4)},
                               "head": "colwise_rep"}


@pytest.mark.slow
def test_pipeline_times_data_parallel_matches_one_process(tmp_path):
    """pp=2 × dp_replicate=2 on four processes: each pipeline sees half of every global batch, its stages'
    gradients averaged with the other replica's, loss counts summed over the two data-parallel ranks only; one
    process with a micro-batch twice as large agrees within 1e-5."""
    check_against_one_process(tmp_path, run_scenario(tmp_path, "pp_dp"), "pp_dp", 1e-5)


@pytest.mark.slow
def test_pipeline_times_fsdp_matches_one_process_and_resumes_bitwise(tmp_path):
    """pp=2 × dp_shard=2 on four processes: FSDP2 shards each stage over its two data-parallel ranks (gradients
    reduce-scattered once per schedule step, clipped by the norm over both stages and both shards); one process
    with a micro-batch twice as large agrees within 1e-5. Its checkpoint (DCP by name, the whole
    model.safetensors) resumed mid-epoch in the same layout ends bitwise where the uninterrupted run ended."""
    out = run_scenario(tmp_path, "pp_fsdp")
    check_against_one_process(tmp_path, out, "pp_fsdp", 1e-5)
    _, whole, resumed = resumed_parts(out, 4)
    check_resumed_and_consolidated(out, whole, resumed, "pp=2 × dp_shard=2 resumed at step 4")


@pytest.fixture(scope="module")
def pp_tp_run(tmp_path_factory):
    """Four processes at pp=2 × tp=2: the runs against one process, then the checkpoints."""
    return run_scenario(tmp_path_factory.mktemp("pp_tp"), "pp_tp")


@pytest.mark.slow
def test_pipeline_times_hsdp_matches_one_process_and_resumes_bitwise(tmp_path):
    """pp=2 × dp_replicate=2 × dp_shard=2 on eight processes: FSDP2 shards each stage over 2 ranks and all-reduces
    its gradients over the 2 replicas itself (HSDP on the (dp_replicate, dp_shard) sub-mesh; the pipeline's step
    does not average them again). SGD clipped by the norm over both stages and all shards = one process with a
    micro-batch four times as large, within 1e-5; the replicas end bitwise equal; the mid-epoch checkpoint
    resumes bitwise in the same layout."""
    out = run_scenario(tmp_path, "pp_hsdp")
    for rank in range(8):
        seen = json.loads((out / f"seen-{rank}.json").read_text())["tokens"]
        assert seen["mesh"] == ["dp_replicate", "dp_shard"] and seen["placements"] == ["R", "S(0)"]
        assert not seen["step_averages"]
    check_against_one_process(tmp_path, out, "pp_hsdp", 1e-5)
    _, whole, resumed = resumed_parts(out, 8)
    check_resumed_and_consolidated(out, whole, resumed, "pp=2 × dp_replicate=2 × dp_shard=2 resumed at step 4")


@pytest.mark.slow
def test_several_sharded_stages_per_rank_and_bf16_match_one_process(tmp_path):
    """pp=2 × dp_shard=2 on four processes with two FSDP2 stages per rank: interleaved 1F1B (stages 1 and 3 on one
    rank: while stage 3 runs, the embedding of stage 1 answers as a stand-in), zbv_zero_bubble (stages 1 and 4 on
    one rank, the embedding and the head) and interleaved zero bubble (both with their weight backward split off),
    SGD clipped by the norm over every stage and shard: one process with a micro-batch twice as large, within 1e-5,
    and the interleaved 1F1B run's mid-epoch checkpoint resumes bitwise. In
    bf16 (one stage per rank) it agrees with one process in bf16 within 1e-2: bf16 rounding alone puts one
    process's bf16 run 1.2e-3 from its fp32 run and this run 2.2e-3 from both, while the steps move the
    parameters by 0.44. ``dist.fsdp_cpu_offload``, ignored on the CPU, is said once per process, not per stage;
    each zero-bubble schedule's override of ``dist.fsdp_reshard_after_forward`` is said once."""
    out = run_scenario(tmp_path, "pp_fsdp_stages")
    check_against_one_process(tmp_path, out, "pp_fsdp_stages", 1e-5,
                              names=["tokens-interleaved_1f1b", "tokens-zbv_zero_bubble",
                                     "tokens-interleaved_zero_bubble"])
    check_against_one_process(tmp_path, out, "pp_fsdp_stages", 1e-2, names=["tokens-bf16"], predicted_tolerance=5e-2)
    seen = json.loads((out / "seen-0.json").read_text())
    assert seen["tokens-interleaved_1f1b"]["stages"] == [0, 2] and seen["tokens-zbv_zero_bubble"]["stages"] == [0, 3]
    for rank in range(4):
        err = (out / f"pp_fsdp_stages-{rank}.err").read_text()
        assert err.count("UserWarning: dist.fsdp_cpu_offload=true is ignored") == 1, err[-2000:]
        for schedule in ("zbv_zero_bubble", "interleaved_zero_bubble"):
            assert err.count("UserWarning: dist.fsdp_reshard_after_forward=true is ignored under "
                             f"parallel.pp_schedule={schedule}:") == 1, err[-2000:]
    _, whole, resumed = resumed_parts(out, 4)
    check_resumed_and_consolidated(out, whole, resumed, "pp=2 × dp_shard=2, 2 stages per rank, resumed at step 4")


@pytest.mark.slow
def test_pipeline_times_tensor_parallel_matches_one_process(tmp_path, pp_tp_run):
    """pp=2 × tp=2 on four processes: each stage's embedding, MLPs and head split over its two tensor-parallel ranks
    by the model's own plan (resolved on the whole model, applied to each rank's stages), with 1F1B and with
    interleaved 1F1B (two stages per rank); SGD clipped by the norm over both stages and both halves of each; and an
    nn.Sequential whose last layer is split by class with its cross-entropy computed split (loss parallelism, on the
    last stage), its accuracy measured there; and a Hugging Face Llama by its own plan (``auto``). One process with
    the same micro-batches agrees within 1e-5. Its checkpoint (DCP: each rank its stages' halves; the
    whole model.safetensors) resumed mid-epoch in the same layout ends bitwise where the uninterrupted run ended."""
    out = pp_tp_run
    check_against_one_process(tmp_path, out, "pp_tp", 1e-5)
    for rank in range(4):
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen["split-1f1b"]["plan"] == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up",
                                              "blocks.2.down", "blocks.2.up", "blocks.3.down", "blocks.3.up",
                                              "embed", "head"]  # the whole model's plan on every rank
        assert "model.layers.1.mlp.down_proj" in seen.get("split-llama", {"plan": ["model.layers.1.mlp.down_proj"]})["plan"]
        for name, held in seen.items():  # every rank holds half of its stages' split layers: under 0.6 of the rest
            assert held["local"] < 0.6, (name, rank, held["local"])
        assert seen["split-loss-parallel"]["loss_parallel"] and not seen["split-1f1b"]["loss_parallel"]
        from torchrig.observe.summary import size  # the summary's memory: what this rank holds of its stages
        memory = seen["split-1f1b"]["memory"]
        assert memory.startswith(f"(tp=2 × pp=2: this process's part): weights {size(seen['split-1f1b']['held'])} "
                                 f"+ gradients {size(seen['split-1f1b']['held'])} + sgd state"), memory
    _, whole, resumed = resumed_parts(out, 4)
    check_resumed_and_consolidated(out, whole, resumed, "pp=2 × tp=2 resumed at step 4")
    said = (out / "pp_tp-0.err").read_text()  # the start line names the layout and the schedule
    assert "· tp=2 × pp=2 (1f1b) ·" in said and "· tp=2 × pp=2 (interleaved_1f1b, 2 stages per rank) ·" in said
    meta = json.loads((out / "whole" / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert meta["layout"] == {"dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2, "pp": 2, "world_size": 4}
    assert meta["strategy"] == "none" and meta["sharded"]  # no data-parallel wrapper, not "fsdp"


@pytest.mark.slow
def test_a_pipeline_and_tensor_parallel_checkpoint_resumes_in_one_process_within_1e_6(tmp_path, pp_tp_run):
    """The pp=2 × tp=2 checkpoint of step 4 (mid-epoch; each rank wrote its stages' halves through DCP) resumed in one
    process, the halves joined by name, ends where the uninterrupted pp=2 × tp=2 run ended, up to float rounding."""
    resume_in_one_process(tmp_path, pp_tp_run, 4, W.SplitTokenNet, "pp=2 × tp=2")


@pytest.mark.slow
def test_pipeline_tensor_and_data_parallel_on_eight_processes_match_one_process(tmp_path):
    """pp=2 × dp_shard=2 × tp=2, and pp=2 × dp_replicate=2 × tp=2, on eight processes: each stage split in two by
    the model's plan, each half sharded by FSDP2 (or replicated, its gradients averaged) over two data-parallel
    ranks. One process with the same global batches agrees within 1e-5."""
    out = run_scenario(tmp_path, "pp_dp_tp")
    check_against_one_process(tmp_path, out, "pp_dp_tp", 1e-5)
    for rank in range(8):
        seen = json.loads((out / f"seen-{rank}.json").read_text())
        assert seen["split-sharded"]["local"] < 0.3 and seen["split-replicated"]["local"] < 0.6, (rank, seen)


def resumed_parts(out, ranks: int) -> tuple[list, dict, dict]:
    """Each rank's saved parameters (``resume-RANK.pt``: the uninterrupted run and the one resumed at step 4, both
    ending at step 12), and each set merged over the ranks."""
    parts = [torch.load(out / f"resume-{rank}.pt") for rank in range(ranks)]
    assert parts[0]["steps"] == (12, 12)
    return parts, merged_parts(parts, "whole"), merged_parts(parts, "resumed")


def check_resumed_and_consolidated(out, whole: dict, resumed: dict, what: str) -> tuple:
    """The resumed run ended bitwise where the uninterrupted one did, whose last checkpoint holds DCP shards and a
    whole model.safetensors equal to its parameters; returns that checkpoint and its weights."""
    from safetensors.torch import load_file

    assert whole.keys() == resumed.keys() and all(torch.equal(whole[k], resumed[k]) for k in whole), \
        f"{what}: not bitwise equal"
    final = out / "whole" / "checkpoints" / "step-00000012"
    assert (final / "sharded" / ".metadata").is_file()
    weights = load_file(str(final / "model.safetensors"))
    assert weights.keys() == whole.keys() and all(torch.equal(weights[k], whole[k]) for k in whole)
    return final, weights


def merged_parts(parts: list, key: str) -> dict:
    whole: dict = {}
    for part in parts:
        for k, v in part[key].items():
            assert k not in whole or torch.equal(whole[k], v), f"{key}: the shards' ranks disagree on {k}"
            whole[k] = v
    return whole


@pytest.mark.slow
def test_what_cannot_be_pipelined_is_one_line(pp_run):
    """A custom step function, and 1F1B with fewer micro-batches per step than stages, each refused in one line
    naming the key, on every rank."""
    for rank in (0, 1):
        said = json.loads((pp_run / f"refused-{rank}.json").read_text())
        assert said["step_fn"].startswith("config key 'parallel.pp': 2 cuts the model into stages that only the "
                                          "default step can run") and "Trainer(step_fn=...)" in said["step_fn"]
        assert said["accumulate"].startswith("config key 'accumulate': 1 micro-batch per optimizer step, which "
                                             "parallel.pp_schedule=1f1b cannot run over 2 stages")
        assert all("\n" not in line for line in said.values())


# ---------------------------------------------------------------------------------------------- the split
def test_auto_split_balances_parameters_and_keeps_names():
    """``auto`` cuts the longest ModuleList (or the Sequential itself) where the parameter counts are most even; the
    embedding counts with the first stage and the head with the last (1024 + 304 against 5 × 304 + 68)."""
    model = W.TokenNet(blocks=6)
    plan = plan_stages(model, "auto", 2)
    assert plan.container_name == "blocks" and plan.ranges == [(0, 1), (1, 6)]
    assert [u.name for u in plan.units] == ["embed", "head"] and [u.pre for u in plan.units] == [True, False]
    plan = plan_stages(W.sequential(), "auto", 2)
    assert plan.container_name == "" and plan.ranges == [(0, 1), (1, 5)]  # 144 against 272 + 68
    plan = plan_stages(W.TokenNet(blocks=4), ["blocks.1", "blocks.3"], 3)
    assert plan.ranges == [(0, 1), (1, 3), (3, 4)] and plan.describe().startswith("stage 1: blocks.0, stage 2")
    cfg = Config()  # an nn.Sequential's blocks by number, as YAML reads them: --set 'parallel.pp_split=[2]'
    set_key(cfg, "parallel.pp_split", "[2]")
    assert cfg.parallel.pp_split == ["2"] and plan_stages(W.sequential(), cfg.parallel.pp_split, 2).ranges == [(0, 2), (2, 5)]


class _MlpBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8), nn.Dropout(0.1))

    def forward(self, x):
        return x + self.mlp(x)


class _CharLM(nn.Module):
    """Three blocks, each with a four-layer ``mlp`` Sequential: longer than the stack of blocks itself."""

    def __init__(self):
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(11, 8), nn.ModuleList(_MlpBlock() for _ in range(3)), \
            nn.Linear(8, 11)


def test_auto_split_cuts_the_stack_of_blocks_not_a_longer_sequential_inside_a_block():
    plan = plan_stages(_CharLM(), "auto", 3)
    assert plan.container_name == "blocks" and plan.ranges == [(0, 1), (1, 2), (2, 3)]


@pytest.mark.parametrize("split, stages, words", [
    (["blocks.7"], 2, "config key 'parallel.pp_split': 'blocks.7' is not a module of TokenNet; did you mean "
                      "'blocks.3', 'blocks.2' or 'blocks.1'?"),
    (["blocks.2.fc"], 2, "config key 'parallel.pp_split': 'blocks.2.fc' is not a block (a child of an nn.ModuleList "
                         "or nn.Sequential) of TokenNet"),
    (["blocks.1", "blocks.2"], 2, "config key 'parallel.pp_split': 2 names (blocks.1, blocks.2) begin 3 stages, but "
                                  "the pipeline has 2 stages"),
    (["blocks.0"], 2, "config key 'parallel.pp_split': blocks.0 must be blocks after the first"),
    ("auto", 5, "config key 'parallel.pp': 5 stages, but TokenNet 'blocks' has 4 blocks"),
])
def test_bad_splits_are_one_line_naming_the_key(split, stages, words):
    with pytest.raises(ParallelConfigError) as err:
        plan_stages(W.TokenNet(), split, stages)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_tied_parameters_across_stages_are_refused():
    model = W.TokenNet()
    model.head.weight = nn.Parameter(torch.zeros(W.CLASSES, W.DIM))
    model.blocks[3].fc.weight = model.blocks[0].fc.weight  # one parameter in both stages
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.pp': blocks.0.fc.weight \(stage 1\) and "
                                                  r"blocks.3.fc.weight \(stage 2\) are one tied parameter"):
        plan_stages(model, "auto", 2)


@pytest.mark.parametrize("sets, words", [
    ({"parallel.pp": 2, "dist.strategy": "dp"}, "config key 'dist.strategy': 'dp' (nn.DataParallel, one process) "
                                                "cannot be combined with parallel.pp=2"),
    ({"parallel.pp": 2, "parallel.pp_stages_per_rank": 2}, "config key 'parallel.pp_stages_per_rank': 2 stages per "
                                                           "rank need a schedule that runs several"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "zbv_zero_bubble"},
     "config key 'parallel.pp_stages_per_rank': 1, but parallel.pp_schedule=zbv_zero_bubble runs exactly 2"),
    ({"parallel.pp": 2, "data.micro_batch_size": "auto"}, "config key 'data.micro_batch_size': 'auto' with "
                                                          "parallel.pp=2"),
    ({"parallel.pp": 2, "parallel.pp_schedule": "2f2b"}, "config key 'parallel.pp_schedule': expected one of gpipe"),
    ({"parallel.pp": 2, "precision": "fp16"}, "config key 'precision': fp16 with parallel.pp=2"),
    ({"parallel.pp": 2, "model.compile": True}, "config key 'model.compile': true with parallel.pp=2"),
])
def test_bad_combinations_are_one_line_naming_the_key(sets, words):
    cfg = Config()
    with pytest.raises(ConfigError) as err:
        for k, v in sets.items():
            set_key(cfg, k, v)
        validate(cfg)
    assert str(err.value).startswith(words) and "\n" not in str(err.value)


def test_degrees_that_do_not_fit_the_world_name_the_key():
    import types

    from torchrig.parallel import resolve_degrees

    p = types.SimpleNamespace(dp_replicate="auto", dp_shard="auto", tp=1, pp=2)
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel': pp=2 needs a multiple of 2 processes, but "
                                                  r"the job has 3"):
        resolve_degrees(p, "auto", 3)
    assert resolve_degrees(p, "auto", 4) == {"dp_replicate": 2, "dp_shard": 1, "cp": 1, "tp": 1, "pp": 2}


def test_what_fsdp2_cannot_shard_in_a_pipeline_is_one_line():
    """A parameter of the model itself (outside every submodule, which the first stage holds beside its blocks) is
    refused in one line naming the key."""
    from torchrig.parallel import Pipeline, shard_stages

    model = W.TokenNet()
    model.scale = nn.Parameter(torch.ones(W.DIM))
    pipe = Pipeline(model, plan_stages(model, "auto", 2), rank=0, pp=2, per_rank=1, schedule="gpipe", group=None,
                    device=torch.device("cpu"))
    with pytest.raises(ParallelConfigError) as err:
        shard_stages(pipe, torch.device("cpu"), None, None, None)
    assert str(err.value).startswith("config key 'parallel.dp_shard': scale belongs to TokenNet itself") \
        and "\n" not in str(err.value)


def test_a_stage_answers_for_its_rank_s_other_stages_with_stand_ins():
    """With two stages per rank, a stage runs the modules around the blocks that it does not own as stand-ins
    (zeros of their shape), even when its rank holds them for its other stage (under FSDP2 they are that stage's
    shards), and gives the real ones back afterwards; the graph check still names a module of another stage that
    a stage's result depends on, on its own rank too."""
    from torchrig.parallel import Pipeline

    model = W.TokenNet()
    embed = model.embed
    calls = []
    embed.register_forward_hook(lambda *_: calls.append("embed"))
    pipe = Pipeline(model, plan_stages(model, "auto", 4), rank=0, pp=2, per_rank=2, schedule="interleaved_1f1b",
                    group=None, device=torch.device("cpu"))
    ids = W.padded_tokens(3).tensors[0]
    first, third = pipe.stages
    assert (first.index, third.index) == (0, 2)
    hidden = torch.randn(3, ids.shape[1], W.DIM, requires_grad=True)
    with pipe.running(lambda m, ids: m(ids)):
        out = third(hidden, mb=ids)  # checked: its first training forward
        assert calls == [] and out.shape == hidden.shape and model.embed is embed
        first(mb=ids)
    assert calls == ["embed"] and model.embed is embed and type(model.head).__name__ == "_Elsewhere"

    class HeadReadsEmbedding(W.TokenNet):
        def forward(self, ids):
            h = self.embed(ids)
            for block in self.blocks:
                h = block(h)
            return self.head(h + self.embed(ids))  # the last stage (on the first's rank in a V) reads stage 1's

    model = HeadReadsEmbedding()
    pipe = Pipeline(model, plan_stages(model, "auto", 4), rank=0, pp=2, per_rank=2, schedule="zbv_zero_bubble",
                    group=None, device=torch.device("cpu"))
    last = pipe.stages[1]
    assert last.index == 3 and last.last
    with pytest.raises(ParallelConfigError, match=r"^config key 'parallel.pp_split': stage 4's result depends on "
                                                  r"embed \(held by another stage\)"), pipe.running(lambda m, ids: m(ids).sum()):
        last(torch.randn(3, ids.shape[1], W.DIM, requires_grad=True), mb=ids)
    assert type(model.embed).__name__ == "Embedding"  # given back after the failed run


def test_an_error_inside_a_later_stage_is_one_line_naming_the_stage_and_the_block(tmp_path):
    """A stage ends its forward by an exception (the documented mechanism, caught around the forward call); any
    other error raised inside a stage comes out once under torchrig launch, naming the stage, the rank and the block
    that was running, with the error's own words."""
    (tmp_path / "stagefail.py").write_text(
        "from torch import nn\n\n\nclass Bad(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
        "        self.fc = nn.Linear(32, 32)\n\n    def forward(self, x):\n"
        "        raise ValueError('the hidden state has a NaN in row 3')\n\n\n"
        "def build(cfg):\n    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), Bad(), nn.Linear(32, 10))\n")
    r = dist_procs.torchrig(
        ["launch", "--nproc-per-node", "2", "--", "train", "--model", "stagefail:build", "--set", "parallel.pp=2",
         "--set", "parallel.pp_split=[3]", "--set", "accumulate=2", "--set", "max_steps=2", "--set", "log.progress=none",
         "--set", "log.summary=false", "--set", "log.tensorboard=false", "--set", "log.plot=false",
         "--set", f"run_dir={tmp_path / 'run'}", "--set", "dist.timeout=30"],
        timeout=240, env={"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        cwd=tmp_path)
    assert r.returncode != 0, r.output[-3000:]
    errors = [line for line in r.stderr.splitlines() if line.startswith("torchrig: error:")]
    assert errors == ["torchrig: error: pipeline stage 2 of 2 (rank 1) failed in block '3' (Bad): ValueError: the "
                      "hidden state has a NaN in row 3"], r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "StageOutput" not in r.output


def test_the_summary_of_a_pipeline_stage_gives_the_whole_model_and_this_process_s_share():
    from torchrig.observe.summary import model_summary
    from torchrig.parallel import Pipeline

    model = W.TokenNet()
    whole = sum(p.numel() for p in model.parameters())
    pipe = Pipeline(model, plan_stages(model, "auto", 2), rank=0, pp=2, per_rank=1, schedule="gpipe", group=None,
                    device=torch.device("cpu"))
    held = sum(p.numel() for p in model.parameters())
    assert pipe.whole_parameters == whole and 0 < held < whole
    lines = model_summary(model, whole=pipe.whole_parameters, layout="pp=2").splitlines()
    header = " ".join(" ".join(lines[:2]).split())  # wrapped at 80 columns
    assert header.startswith(f"torchrig: model TokenNet · {whole:,} parameters; this process's stages hold {held:,}, "
                             f"all trainable · ")
    assert [line.split()[:3] for line in lines if line.split()[:2] == ["this", "process"]] == \
        [["this", "process", f"{held:,}"]]  # the table's last row: this process's part, not the model's total
