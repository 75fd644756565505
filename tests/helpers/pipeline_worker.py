"""Models, data and the multi-rank runs of the pipeline-parallel tests (tests/parallel/test_pipeline.py).

    python tests/helpers/pipeline_worker.py pp OUT      # 2 processes (TEST_INIT, TEST_RANK, TEST_WORLD)
    python tests/helpers/pipeline_worker.py pp_dp OUT   # 4 processes: pp=2 × dp_replicate=2
    python tests/helpers/pipeline_worker.py pp_fsdp OUT # 4 processes: pp=2 × dp_shard=2 (FSDP2 in each stage)
    python tests/helpers/pipeline_worker.py pp_hsdp OUT # 8 processes: pp=2 × dp_replicate=2 × dp_shard=2 (HSDP)
    python tests/helpers/pipeline_worker.py pp_fsdp_stages OUT  # 4 processes: pp=2 × dp_shard=2, 2 stages per rank
    python tests/helpers/pipeline_worker.py resume_sharded OUT CHECKPOINT  # 2 processes: a pp=2 checkpoint, dp_shard=2
    python tests/helpers/pipeline_worker.py resume_tp OUT CHECKPOINT       # 2 processes: a pp=2 checkpoint, tp=2

Each run trains with the ``parallel`` settings of its entry in :func:`runs` and saves this rank's parameters
(``NAME-RANK.pt``), what it evaluated and predicted, for the test to compare with one process trained on the same
micro-batches (in the test's own process).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from helpers.parallel_worker import (QUIET, SEQ, VOCAB, Tokens, build, has_transformers,  # noqa: E402
                                     local_fraction)

DIM, CLASSES = 16, 4
SAMPLES, BATCH, ACCUMULATE = 93, 4, 4  # 24 loaded batches, the last of 1 sample: 6 optimizer steps an epoch


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(DIM), nn.Linear(DIM, DIM)

    def forward(self, h):
        return h + F.gelu(self.fc(self.norm(h)))


class TokenNet(nn.Module):
    """A label per token, over blocks in a ModuleList: the embedding goes to the first stage, the head to the last.
    Its tensor-parallel plan (``parallel.tp_plan=auto``) splits the embedding's rows, each block's layer and the head
    by output features."""

    tp_plan = {"embed": "embedding_rowwise", "blocks.*.fc": "colwise_rep", "head": "colwise_rep"}

    def __init__(self, blocks: int = 4):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(blocks)])
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class SplitBlock(nn.Module):
    """A block whose MLP a tensor-parallel plan splits: ``up`` by columns, ``down`` by rows."""

    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, h):
        return h + self.down(F.gelu(self.up(self.norm(h))))


class SplitTokenNet(TokenNet):
    """The token model with a tensor-parallel plan over every stage: the embedding's rows, each block's MLP, the
    head's columns (gathered)."""

    tp_plan = {"embed": "embedding_rowwise", "blocks.*.up": "colwise", "blocks.*.down": "rowwise",
               "head": "colwise_rep"}

    def __init__(self, blocks: int = 4):
        super().__init__(blocks)
        self.blocks = nn.ModuleList([SplitBlock() for _ in range(blocks)])


def token_loss(output, target):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), target.reshape(-1), ignore_index=-100)


def padded_tokens(n: int = SAMPLES) -> TensorDataset:
    """Sequences of 2 to SEQ tokens padded to SEQ: the padding labelled -100, so every micro-batch has its own number
    of valid tokens (``loss_normalization: auto`` counts tokens)."""
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    labels = torch.randint(0, CLASSES, (n, SEQ), generator=g)
    lengths = torch.randint(2, SEQ + 1, (n,), generator=g)
    labels[torch.arange(SEQ)[None, :] >= lengths[:, None]] = -100
    return TensorDataset(ids, labels)


class ProbedLinear(nn.Linear):
    """A Linear that records, when the gradient reaches its output, whether the output's memory is still referenced
    (``alive``): nothing of the forward may outlive its backward."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.alive: list = []

    def forward(self, x):
        from torch.multiprocessing.reductions import StorageWeakRef

        out = super().forward(x)
        if out.requires_grad:
            memory = StorageWeakRef(out.untyped_storage())
            out.register_hook(lambda grad: self.alive.append(not memory.expired()))
        return out


def sequential() -> nn.Sequential:
    """Cut by ``auto`` after its second Linear: the second stage begins with an in-place ReLU on what it receives.
    Its head records whether its output outlives the backward."""
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 16), nn.ReLU(inplace=True),
                         ProbedLinear(16, CLASSES))


def outlived(model: nn.Module) -> list:
    """For each backward through a :class:`ProbedLinear` of ``model``, whether its output was still referenced."""
    return [alive for m in model.modules() if isinstance(m, ProbedLinear) for alive in m.alive]


def features(n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def llama() -> nn.Module:
    """A Hugging Face Llama of two decoder layers: its own tensor-parallel plan (``auto``), one layer a stage."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=DIM, n_layer=4, n_head=4, tie_word_embeddings=False,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(cfg)


SCHEDULES = {"gpipe": {}, "1f1b": {}, "interleaved_1f1b": {"parallel.pp_stages_per_rank": 2},
             "interleaved_zero_bubble": {}, "zbv_zero_bubble": {"parallel.pp_stages_per_rank": 2}}


def runs(samples: int, scenario: str = "pp") -> dict:
    """name -> (model factory, data of ``samples`` samples, settings). Under ``pp`` the token model runs every
    schedule; the four-process scenario trains it once, beside data parallelism."""
    if scenario in MORE_RUNS:
        return MORE_RUNS[scenario](samples)
    if scenario == "pp_dp":
        return {"tokens": (TokenNet, padded_tokens(samples), {"loss": token_loss, "parallel.pp_schedule": "1f1b"})}
    clipped = {"loss": token_loss, "parallel.tp_plan": "auto", "optimizer": "sgd", "lr": 0.5, "clip_grad_norm": 0.5}
    if scenario == "pp_dp_tp":  # eight processes: each stage split in two, its halves sharded (FSDP2) or replicated
        return {"split-sharded": (SplitTokenNet, padded_tokens(samples), {**clipped, "parallel.pp_schedule": "1f1b"}),
                "split-replicated": (SplitTokenNet, padded_tokens(samples),
                                     {**clipped, "parallel.pp_schedule": "1f1b", "parallel.dp_shard": 1,
                                      "parallel.dp_replicate": 2})}
    if scenario == "pp_tp":  # SGD clipped by the norm over both stages and both tensor-parallel halves of each
        return {"split-1f1b": (SplitTokenNet, padded_tokens(samples), {**clipped, "parallel.pp_schedule": "1f1b"}),
                "split-interleaved": (SplitTokenNet, padded_tokens(samples),
                                      {**clipped, "parallel.pp_schedule": "interleaved_1f1b",
                                       "parallel.pp_stages_per_rank": 2}),
                # the head split by class on the last stage, its cross-entropy computed split (loss parallelism)
                "split-loss-parallel": (sequential, features(samples),
                                        {"parallel.tp_plan": {"0": "colwise", "2": "rowwise",
                                                              "4": "colwise_loss_parallel"},
                                         "loss": "cross_entropy", "metrics": ["accuracy"], "clip_grad_norm": 0.5,
                                         "parallel.pp_schedule": "gpipe"}),
                **({"split-llama": (llama, Tokens(samples), {"parallel.tp_plan": "auto"})} if has_transformers() else {})}
    if scenario == "pp_fsdp":  # SGD clipped by the norm over both stages and both shards of each (AdamW would
        # hide a wrong norm: it undoes a constant scale of the gradients)
        return {"tokens": (TokenNet, padded_tokens(samples), {"loss": token_loss, "parallel.pp_schedule": "1f1b",
                                                              "optimizer": "sgd", "lr": 0.5, "clip_grad_norm": 0.5})}
    out = {f"tokens-{name}": (TokenNet, padded_tokens(samples), {"loss": token_loss, "parallel.pp_schedule": name,
                                                                 **extra})
           for name, extra in SCHEDULES.items()}
    # clipped by the norm of both stages' gradients together; accuracy from the last stage on every rank
    out["sequential"] = (sequential, features(samples), {"clip_grad_norm": 0.5, "metrics": ["accuracy"],
                                                         "parallel.pp_schedule": "gpipe"})
    if has_transformers():
        out["gpt2"] = (gpt2, Tokens(samples), {"parallel.pp_split": ["transformer.h.1"]})
    return out


def settings(run_dir: Path, **extra) -> dict:
    kw = dict(optimizer="adamw", lr=0.01, batch_size=BATCH, accumulate=ACCUMULATE, epochs=1, seed=0,
              run_dir=str(run_dir), metrics=[], threads=1, num_workers=0, shuffle=False, **QUIET)
    kw.update(extra)
    return kw


# scenario -> (the parallel degrees, the processes it takes)
SCENARIOS = {"pp": ({"parallel.pp": 2}, 2), "pp_dp": ({"parallel.pp": 2, "parallel.dp_replicate": 2}, 4),
             "pp_fsdp": ({"parallel.pp": 2, "parallel.dp_shard": 2}, 4),
             "pp_tp": ({"parallel.pp": 2, "parallel.tp": 2}, 4),
             "pp_dp_tp": ({"parallel.pp": 2, "parallel.dp_shard": 2, "parallel.tp": 2}, 8)}


def data_parallel(scenario: str) -> int:
    """The data-parallel ranks of ``scenario``: its processes over the pipeline's and tensor-parallel ranks."""
    degrees, world = SCENARIOS[scenario]
    return world // (degrees["parallel.pp"] * degrees.get("parallel.tp", 1))


# FSDP2 stages beyond pp × dp_shard with one stage per rank: the token model with SGD clipped by the norm over every
# stage and shard (a wrong gradient norm shows), as pp_fsdp trains it
CLIPPED_SGD = {"loss": token_loss, "optimizer": "sgd", "lr": 0.5, "clip_grad_norm": 0.5}


def hsdp_runs(samples: int) -> dict:
    """pp=2 × dp_replicate=2 × dp_shard=2: each stage sharded over 2 ranks and replicated twice (HSDP)."""
    return {"tokens": (TokenNet, padded_tokens(samples), {**CLIPPED_SGD, "parallel.pp_schedule": "1f1b"})}


def stages_runs(samples: int) -> dict:
    """pp=2 × dp_shard=2 with two FSDP2-sharded stages per rank (interleaved 1F1B: stages 1 and 3 on the first
    rank, with ``dist.fsdp_cpu_offload`` on, which the CPU ignores with a warning; the V of zbv_zero_bubble: 1 and
    4, the embedding and the head on one rank; interleaved zero bubble), then one stage per rank in bf16."""
    data = padded_tokens(samples)
    return {"tokens-interleaved_1f1b": (TokenNet, data, {**CLIPPED_SGD, "parallel.pp_schedule": "interleaved_1f1b",
                                                         "parallel.pp_stages_per_rank": 2,
                                                         "dist.fsdp_cpu_offload": True}),
            "tokens-zbv_zero_bubble": (TokenNet, data, {**CLIPPED_SGD, "parallel.pp_schedule": "zbv_zero_bubble",
                                                        "parallel.pp_stages_per_rank": 2}),
            "tokens-interleaved_zero_bubble": (TokenNet, data, {**CLIPPED_SGD, "parallel.pp_stages_per_rank": 2,
                                                                "parallel.pp_schedule": "interleaved_zero_bubble"}),
            "tokens-bf16": (TokenNet, data, {**CLIPPED_SGD, "parallel.pp_schedule": "1f1b", "precision": "bf16"})}


def sharding(t) -> dict:
    """How a Trainer's stages are sharded: the mesh dimensions and placements of a parameter (FSDP2: a DTensor),
    and whether the pipeline's step averages the gradients over the replicas itself."""
    param = next(t.model.parameters())
    mesh = getattr(param, "device_mesh", None)
    return {"mesh": list(mesh.mesh_dim_names) if mesh is not None else None,
            "placements": [str(pl) for pl in getattr(param, "placements", ())],
            "step_averages": t.step_fn.dp_group is not None}


MORE_RUNS = {"pp_hsdp": hsdp_runs, "pp_fsdp_stages": stages_runs}
# scenario -> the settings beside its degrees of its mid-epoch resume in the same layout
MORE_RESUMES = {"pp_hsdp": {}, "pp_fsdp_stages": {"parallel.pp_schedule": "interleaved_1f1b",
                                                  "parallel.pp_stages_per_rank": 2}}
SCENARIOS.update({"pp_hsdp": ({"parallel.pp": 2, "parallel.dp_replicate": 2, "parallel.dp_shard": 2}, 8),
                  "pp_fsdp_stages": ({"parallel.pp": 2, "parallel.dp_shard": 2}, 4)})


def eval_data(data):
    """The first 10 samples (for ``Trainer.evaluate`` / ``predict``)."""
    from torch.utils.data import Subset

    return Subset(data, range(10))


def local_params(model: nn.Module) -> dict:
    """This rank's parameters, whole (FSDP2 shards gathered: collective over the shards' ranks)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in model.state_dict().items()}


def train(scenario: str, out: Path) -> None:
    from torchrig import Trainer

    degrees, world = SCENARIOS[scenario]
    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": world}
    dp = data_parallel(scenario)
    first, seen = None, {}
    for name, (make_model, data, extra) in runs(SAMPLES * dp, scenario).items():
        t = Trainer(build(make_model), **settings(out / name, **{**degrees, **extra}), **group)
        first = first or t
        t.fit(data)
        seen[name] = {"eval": t.evaluate(eval_data(data)), "stages": [st.index for st in t.layout.pipeline.stages],
                      "local": local_fraction(t.model), "plan": sorted(t.layout.plan),
                      "loss_parallel": t.step.loss_parallel,
                      "memory": " ".join(t.summary().split("memory per process")[1].split()),
                      "held": sum((p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in t.model.parameters()),
                      "train": {k: v for k, v in t.history[-1].items() if k.startswith("train/") and k != "train/loss"},
                      "outlived": outlived(t.model), **sharding(t)}
        x = data.tensors[0][:10] if isinstance(data, TensorDataset) else None
        if x is not None:
            torch.save(t.predict(x), out / f"{name}-predicted-{rank}.pt")
        torch.save(local_params(t.model), out / f"{name}-{rank}.pt")
    (out / f"seen-{rank}.json").write_text(json.dumps(seen))
    if scenario == "pp":
        resume(out, group)
        refusals(out, group)
    if scenario == "pp_fsdp":
        resume(out, group, degrees, dp)
    if scenario == "pp_tp":
        resume(out, group, {**degrees, "parallel.tp_plan": "auto"}, dp, SplitTokenNet)
    if scenario in MORE_RESUMES:
        resume(out, group, {**degrees, **MORE_RESUMES[scenario]}, dp)
    first.close()


def refusals(out: Path, group: dict) -> None:
    """What a Trainer refuses once the pipeline is built: a custom step function, and fewer micro-batches per
    optimizer step than 1F1B needs stages; each message saved (one line, the key named)."""
    from torchrig import Trainer

    said = {}
    cases = {"step_fn": dict(step_fn=lambda step, batch: {}), "accumulate": {"accumulate": 1}}
    for name, extra in cases.items():
        kw = settings(out / f"refused-{name}", **{"parallel.pp": 2, "loss": token_loss})
        kw.update(extra)
        try:
            Trainer(build(TokenNet), **kw, **group).close()
        except ValueError as exc:
            said[name] = str(exc)
    (out / f"refused-{group['rank']}.json").write_text(json.dumps(said))


def resume(out: Path, group: dict, degrees: Optional[dict] = None, dp: int = 1, model: type = TokenNet) -> None:
    """pp=2 (or ``degrees``, with ``dp`` data-parallel ranks): the token model trained 2 epochs (12 steps) with a
    checkpoint every 4 (DCP), then again from the checkpoint of step 4 (mid-epoch) in the same layout; each rank
    saves both final parameter sets."""
    from torchrig import Trainer

    degrees = degrees or {"parallel.pp": 2}
    kw = {**degrees, "loss": token_loss, "checkpoint.save_final": True, "checkpoint.every_steps": 4,
          "checkpoint.keep_last": 4, "epochs": 2}
    data = padded_tokens(SAMPLES * dp)
    t = Trainer(build(model), **settings(out / "whole", **kw), **group)
    t.fit(data)
    ckpt = out / "whole" / "checkpoints" / "step-00000004"
    kw.update({"checkpoint.every_steps": 0, "resume": str(ckpt)})
    t2 = Trainer(build(model), **settings(out / "resumed", **kw), **group)
    t2.fit(data)
    torch.save({"whole": local_params(t.model), "resumed": local_params(t2.model),
                "steps": (t.global_step, t2.global_step)}, out / f"resume-{group['rank']}.pt")


def resume_sharded(out: Path, checkpoint: Path) -> None:
    """2 processes, no pipeline: the pp=2 checkpoint ``checkpoint`` (step 4 of 12) resumed under FSDP2
    (``parallel.dp_shard=2``) with half the batch per rank (the same global batches); each rank saves the whole
    final parameters."""
    from torchrig import Trainer

    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": 2}
    kw = {"parallel.dp_shard": 2, "loss": token_loss, "epochs": 2, "batch_size": BATCH // 2, "resume": str(checkpoint),
          "checkpoint.save_final": False, "resume_changes": "allow"}
    t = Trainer(build(TokenNet), **settings(out / "sharded", **kw), **group)
    t.fit(padded_tokens())
    torch.save({"params": local_params(t.model), "step": t.global_step}, out / f"sharded-{rank}.pt")
    t.close()


def resume_tp(out: Path, checkpoint: Path) -> None:
    """2 processes, no pipeline: the pp=2 checkpoint ``checkpoint`` (step 4 of 12, optimizer state by name) resumed
    at ``parallel.tp=2`` with the model's own plan; both ranks see the whole batch (the same global batches); each
    rank saves the whole final parameters."""
    from torchrig import Trainer

    rank = int(os.environ["TEST_RANK"])
    group = {"init_method": os.environ["TEST_INIT"], "rank": rank, "world_size": 2}
    kw = {"parallel.tp": 2, "parallel.tp_plan": "auto", "loss": token_loss, "epochs": 2, "resume": str(checkpoint),
          "checkpoint.save_final": False, "resume_changes": "allow"}
    t = Trainer(build(TokenNet), **settings(out / "tp", **kw), **group)
    t.fit(padded_tokens())
    torch.save({"params": local_params(t.model), "step": t.global_step, "plan": t.layout.plan},
               out / f"tp-{rank}.pt")
    t.close()


if __name__ == "__main__":
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    if sys.argv[1] == "resume_sharded":
        resume_sharded(target, Path(sys.argv[3]))
    elif sys.argv[1] == "resume_tp":
        resume_tp(target, Path(sys.argv[3]))
    else:
        train(sys.argv[1], target)
