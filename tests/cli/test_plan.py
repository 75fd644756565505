"""``torchrig plan``: a layout planned on one machine, on the meta device and PyTorch's fake process group.

Its figures per rank (weights, gradients, optimizer state) are checked against what the ranks of real runs hold
after one step of the same config: DDP, FSDP2 (dp_shard=2), tensor parallel (tp=2) and a pipeline (pp=2), two
gloo processes (tests/helpers/plan_worker.py); then the errors a launch would hit, all of them, and a layout of
1,024 processes planned in seconds.
"""

from __future__ import annotations

import json
import time

import pytest
from helpers import dist_procs
from helpers.dist_procs import HELPERS
from helpers.plan_worker import COMMON, LAYOUTS

from torchrig.cli import main
from torchrig.cli.plan import plan, report
from torchrig.recipes.run import build_config


def _cfg(*sets: str):
    return build_config(None, [*COMMON, *sets])


def test_the_plan_of_each_layout_is_what_the_real_ranks_hold_within_5_percent(tmp_path):
    out = tmp_path / "held"
    results = dist_procs.processes([str(out)], 2, out, tmp_path / "store", timeout=300,
                                   worker=HELPERS / "plan_worker.py", logs="plan")
    assert [r.returncode for r in results] == [0, 0], results[0].output[-3000:]
    real = [json.loads((out / f"held-{r}.json").read_text()) for r in (0, 1)]
    for name, sets in LAYOUTS.items():
        planned = plan(_cfg(*sets), 2)
        assert planned.errors == [], (name, planned.errors)
        for rank in (0, 1):
            stage = next(s for s in planned.stages if rank in s.ranks)
            for what in ("weights", "gradients", "optimizer"):
                want, got = real[rank][name][what], stage.memory[what]
                assert abs(got - want) <= 0.05 * want, (name, rank, what, got, want)
    assert planned.stages[0].memory["weights"] != planned.stages[1].memory["weights"]  # pp=2: each its stage


def test_every_error_the_launch_would_hit_is_listed_and_the_command_fails(capsys):
    planned = plan(_cfg("parallel.tp=4", "parallel.tp_plan=auto", "model.options.hidden=90", "parallel.pp=8"), 6)
    assert planned.errors == [
        "config key 'parallel.tp_plan': module 'net.1' (colwise) has 90 output features, which parallel.tp=4 does not "
        "divide; choose a tp that divides 90, or a size of the model that 4 divides",
        "config key 'parallel.pp': 8 stages, but MLP 'net' has 6 blocks; a stage needs one at least: lower parallel.pp "
        "(or parallel.pp_stages_per_rank)",
        "config key 'parallel': tp=4 × pp=8 needs a multiple of 32 processes, but the job has 6; start 32 (or a "
        "multiple) with torchrig launch --nproc-per-node, or lower the degrees"], planned.errors
    rc = main(["plan", "--nproc", "4", *[a for s in COMMON for a in ("--set", s)], "--set", "parallel.pp=2"])
    text = capsys.readouterr().out
    assert rc == 1 and "errors the launch would hit: 1\n  - config key 'accumulate': 1 micro-batch" in text, text
    assert "stage 2, ranks 2-3: weights " in text  # the memory is planned all the same


def test_a_layout_of_1024_processes_is_planned_in_seconds():
    t0 = time.perf_counter()
    planned = plan(_cfg("model.options.depth=6", "parallel.tp=8", "parallel.tp_plan=auto", "parallel.pp=4",
                        "dist.strategy=fsdp", "accumulate=8"), 1024)
    took = time.perf_counter() - t0
    assert planned.errors == [] and planned.layout == "dp_shard=32 × tp=8 × pp=4", report(planned)
    assert [s.ranks[:1] + s.ranks[-1:] for s in planned.stages] == [[0, 255], [256, 511], [512, 767], [768, 1023]]
    assert [s.in_flight for s in planned.stages] == [4, 3, 2, 1]
    text = report(planned)
    assert "parameter all_gather (FSDP2, forward and backward): 16 × " in text and "over 32 ranks" in text
    assert took < 60, f"{took:.1f}s"


def test_context_parallel_ranks_hold_half_the_activations_and_shard_with_the_data_ranks():
    """The language-model recipe (Hugging Face GPT-2 without a key/value cache) at dp_shard=2 against dp_shard=2 ×
    cp=2: the same micro-batch, its sequences split over two cp ranks; FSDP2 shards over all four ranks."""
    sets = ["recipe=language-model", "parallel.dp_shard=2", "lm.vocab_size=500"]
    alone, split = plan(build_config(None, sets), 2), plan(build_config(None, [*sets, "parallel.cp=2"]), 4)
    assert alone.errors == split.errors == [] and split.layout == "dp_shard=2 × cp=2"
    assert alone.stages[0].activations > 0 and split.stages[0].activations == alone.stages[0].activations / 2
    assert split.stages[0].memory["weights"] == pytest.approx(alone.stages[0].memory["weights"] / 2, rel=0.02)
    assert any(c.startswith("parameter all_gather (FSDP2") and c.endswith("over 4 ranks") for c in split.collectives)
    assert any("ring attention" in n for n in split.notes)
