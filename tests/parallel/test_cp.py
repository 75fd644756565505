"""Context parallelism (``parallel.cp``): exactness against one process, checkpoints across cp degrees, refusals.

Real gloo process groups on the CPU (tests/helpers/cp_worker.py): one pair of processes (cp=2), one group of four
(dp_shard=2 × cp=2, dp_replicate=2 × cp=2); the one-process runs here. PyTorch's ring attention has no CPU kernel,
so the workers swap only its SDPA dispatch for a whole-sequence stand-in (see cp_worker); on a GPU the same runs
go through PyTorch's ring.
"""

from __future__ import annotations

import json

import pytest
import torch

import torchrig
from torchrig import parallel

from helpers import dist_procs
from helpers import cp_worker as W

WORKER = dist_procs.HELPERS / "cp_worker.py"


worst = dist_procs.worst


def group(scenario: str, out, n: int) -> None:
    dist_procs.group_ok(scenario, out, n, WORKER)


def fit_one(run_dir, losses=None, **kw):
    t = torchrig.Trainer(W.build(), callbacks=[losses] if losses is not None else None, **W.settings(run_dir, **kw))
    t.fit(W.Tokens(W.BATCH * W.STEPS // 2))
    return t


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The one-process run (checkpoints every 7 steps, which the pair resumes at cp=2), then the pair and the four."""
    out = tmp_path_factory.mktemp("cp")
    losses = W.Losses()
    t = fit_one(out / "one", losses, **W.EVERY)
    ev, predicted = t.evaluate(W.Tokens(6, seed=8)), t.predict(W.Tokens(6, seed=8).ids)
    torch.save((W.params(t.model), losses.seen, ev, predicted), out / "one.pt")
    group("pair", out, 2)
    group("four", out, 4)
    return out


@pytest.mark.slow
def test_cp2_equals_one_process_over_20_adamw_steps(runs):
    """cp=2 (DDP over the two cp ranks, one sample shard): the logged loss of each of the 20 steps and the final
    parameters within 1e-5 of one process; evaluation's loss equal, predictions gathered back in sequence order."""
    whole, losses, ev, predicted = torch.load(runs / "one.pt")
    got, got_predicted = torch.load(runs / "cp2.pt")
    seen = [json.loads((runs / f"pair-{r}.json").read_text()) for r in (0, 1)]
    assert len(losses) == 20 and seen[0]["steps"] == 20
    assert max(abs(a - b) for a, b in zip(seen[0]["losses"], losses)) < 1e-5
    assert worst(got, whole) < 1e-5
    assert seen[0]["eval"]["loss"] == pytest.approx(ev["loss"], abs=1e-5) and seen[0]["eval"] == seen[1]["eval"]
    assert got_predicted.shape == predicted.shape == (6, W.SEQ, W.VOCAB)
    assert (got_predicted - predicted).abs().max().item() < 1e-5
    assert [(s["sample_rank"], s["sample_ranks"], s["strategy"]) for s in seen] == [(0, 1, "ddp"), (0, 1, "ddp")]


@pytest.mark.slow
def test_the_split_is_pytorchs_load_balanced_one_and_gathers_back_in_order(runs):
    """A row of 24 positions on 2 ranks: rank 0 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2 (PyTorch's
    head-tail load balancer), the position ids say so, the loaded batch is left whole, and the gather restores it."""
    trips = [json.loads((runs / f"pair-{r}.json").read_text())["round_trip"] for r in (0, 1)]
    assert trips[0]["positions"] == [*range(0, 6), *range(18, 24)]
    assert trips[1]["positions"] == [*range(6, 18)]
    assert trips[1]["ids"][1] == [W.SEQ + p for p in range(6, 18)]
    assert all(t["whole_equal"] and t["loaded_left"] == W.SEQ for t in trips)


@pytest.mark.slow
def test_dp_shard_and_dp_replicate_with_cp2_equal_one_process(runs):
    """Four processes, two sample shards of 2 × two cp ranks: FSDP2 over the flattened (dp_shard, cp) sub-mesh and
    DDP over (dp_replicate, cp) each end within 1e-5 of one process, step by step and in the final parameters."""
    whole, losses, _, _ = torch.load(runs / "one.pt")
    for name, strategy, described in (("fsdp", "fsdp", "dp_shard=2 × cp=2"), ("ddp", "ddp", "dp_replicate=2 × cp=2")):
        got, got_losses, got_strategy, got_described = torch.load(runs / f"four-{name}.pt")
        assert (got_strategy, got_described) == (strategy, described)
        assert max(abs(a - b) for a, b in zip(got_losses, losses)) < 1e-5 and len(got_losses) == 20
        assert worst(got, whole) < 1e-5, name


@pytest.mark.slow
def test_checkpoints_resume_across_cp_degrees(runs, tmp_path):
    """One process's checkpoint of step 7 resumed at cp=2, and cp=2's resumed in one process: each ends within 1e-5
    of the uninterrupted one-process run."""
    whole = torch.load(runs / "one.pt")[0]
    got, steps = torch.load(runs / "one-to-cp2.pt")
    assert steps == 20 and worst(got, whole) < 1e-5
    t = fit_one(tmp_path / "cp2-to-one", epochs=2, resume=str(runs / "cp2" / "checkpoints" / "step-00000007"))
    assert t.global_step == 20 and worst(W.params(t.model), whole) < 1e-5


# ---------------------------------------------------------------------------------------------- one-line refusals
class _Mesh:
    """A two-rank cp mesh's size, for what is decided before any collective."""

    def size(self):
        return 2

    def get_group(self):
        return None


def _cp():
    return parallel.ContextParallel(_Mesh())


def _refused(fn) -> str:
    with pytest.raises(parallel.ParallelConfigError) as err:
        fn()
    return str(err.value)


def test_sequences_that_2cp_does_not_divide_and_padding_masks_are_refused_in_one_line():
    cp = _cp()
    batch = {"input_ids": torch.zeros(2, 25, dtype=torch.long), "labels": torch.zeros(2, 25, dtype=torch.long)}
    assert _refused(lambda: cp.prepare(batch, "labels")) == (
        "config key 'parallel.cp': 2 cuts each sequence into 2 × 2 equal chunks (the load-balanced ring), but the "
        "sequences are 25 tokens long; make them 24 or 28 tokens long (a multiple of 4), or set parallel.cp=1")
    padded = {"input_ids": torch.zeros(2, 24, dtype=torch.long), "attention_mask": torch.ones(2, 24)}
    padded["attention_mask"][1, 20:] = 0
    assert "attention_mask masks padding" in _refused(lambda: cp.prepare(padded))
    assert "but the batch is a dict with keys ['x', 'y']" in _refused(
        lambda: cp.prepare({"x": torch.zeros(2, 24), "y": torch.zeros(2)}))


def test_prepare_copies_the_sequences_adds_positions_and_shifts_a_causal_lms_labels():
    """An all-ones mask is dropped; the loaded batch is not touched (the split happens in place on copies);
    positions are those of the whole rows; a model that shifts its labels gets them shifted before the split."""
    cp = _cp()
    ids = torch.arange(8).view(2, 4) + 10
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones(2, 4), "n": 3}
    local, buffers = cp.prepare(batch, "labels", shift=True)
    assert sorted(local) == ["input_ids", "labels", "n", "position_ids", "shift_labels"]
    assert local["labels"] is local["shift_labels"] and local["labels"].tolist() == [[11, 12, 13, -100],
                                                                                     [15, 16, 17, -100]]
    assert local["position_ids"].tolist() == [[0, 1, 2, 3]] * 2 and local["input_ids"] is not ids
    assert len(buffers) == 3 and all(b.is_contiguous() for b in buffers)
    assert ids.tolist() == [[10, 11, 12, 13], [14, 15, 16, 17]]


def test_models_whose_attention_the_ring_cannot_split_are_refused_naming_the_module():
    cp = _cp()

    class WithMHA(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = torch.nn.ModuleDict({"attn": torch.nn.MultiheadAttention(8, 2)})

        def forward(self, input_ids, position_ids=None):
            return input_ids

    assert "block.attn is an nn.MultiheadAttention" in _refused(lambda: cp.check_model(WithMHA(), "auto", True))
    eager = W.TinyLM()
    eager.config = type("Config", (), {"_attn_implementation": "eager"})()
    assert "TinyLM runs attention_implementation='eager'" in _refused(lambda: cp.check_model(eager, "auto", True))
    assert "forward takes no position_ids" in _refused(lambda: cp.check_model(W.TinyLM(), "auto", False))
    assert _refused(lambda: cp.check_model(W.TinyLM(), "samples", True)).startswith(
        "config key 'loss_normalization': samples under parallel.cp=2")
    cp.check_model(W.TinyLM(), "tokens", True)  # SDPA, positions from the batch: accepted


@pytest.mark.parametrize("degrees, named", [
    ({"tp": 2}, "config key 'parallel.cp': 2 with tp=2 is not supported yet"),
    ({"pp": 2}, "config key 'parallel.cp': 2 with pp=2 is not supported yet"),
    ({"dp_replicate": 2, "dp_shard": 2}, "config key 'parallel.cp': 2 with dp_replicate=2 with dp_shard=2 (HSDP)"),
])
def test_compositions_not_tested_with_cp_are_refused(degrees, named):
    from types import SimpleNamespace

    p = SimpleNamespace(**{"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "cp": 2, **degrees})
    world = 2 * degrees.get("tp", 1) * degrees.get("pp", 1) * degrees.get("dp_replicate", 1) * degrees.get("dp_shard", 1)
    assert _refused(lambda: parallel.build_layout(p, "auto", world, torch.device("cpu"))).startswith(named)
    p = SimpleNamespace(dp_replicate="auto", dp_shard="auto", tp=1, pp=1, cp=2)
    assert "dist.strategy': 'none' cannot average the gradients of the parallel.cp=2 ranks" in _refused(
        lambda: parallel.build_layout(p, "none", 2, torch.device("cpu")))
    assert parallel.resolve_degrees(p, "fsdp", 8) == {"dp_replicate": 1, "dp_shard": 4, "cp": 2, "tp": 1,
                                                                 "pp": 1}
