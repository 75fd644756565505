"""data.micro_batch_size: loaded batches cut into micro-batches, and ``auto`` halving on out-of-memory errors."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import dist_procs
from helpers import microbatch_worker as W
from torchrig import Trainer
from torchrig.config import ConfigError
from torchrig.trainer.microbatch import MicroBatchError, chunks

ATOL = 1e-6


def _fit(tmp_path, name, model, n=37, **extra):
    t = Trainer(model, **W.settings(tmp_path / name, **extra))
    t.fit(W.classification(n))
    t.close()
    return t, W.params(model)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _history_diff(a: list, b: list) -> float:
    keys = [k for k in a[0] if k.startswith("train/")]
    assert keys and len(a) == len(b)
    return max(abs(ra[k] - rb[k]) for ra, rb in zip(a, b) for k in keys)


def test_chunks_cut_every_tensor_of_nested_batches():
    batch = {"x": torch.arange(10).view(5, 2), "pair": (torch.arange(5), [torch.ones(5, 3)]), "scale": torch.tensor(2.0),
             "name": "b"}
    parts = chunks(batch, 2)
    assert [p["x"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["pair"][0] for p in parts]), torch.arange(5))
    assert [p["pair"][1][0].shape for p in parts] == [(2, 3), (2, 3), (1, 3)]
    assert all(p["scale"] is batch["scale"] and p["name"] == "b" for p in parts)
    assert chunks(batch, 5) == [batch] and chunks(batch, None) == [batch]


def test_fixed_micro_batch_equals_the_whole_batch(tmp_path):
    # 37 samples, batches of 8 cut into 3 + 3 + 2 (the last batch: 3 + 2), two batches per window
    _, want = _fit(tmp_path, "whole", W.Limited(None, p=0.0), accumulate=2)
    t, got = _fit(tmp_path, "cut", W.Limited(3, p=0.0), accumulate=2, **{"data.micro_batch_size": 3})
    assert t.model.oom == 0 and t.model.calls == 2 * (3 * 4 + 2)  # never more than 3 rows per forward
    assert _max_diff(got, want) < ATOL


def test_token_counts_of_cut_sequence_batches_equal_the_whole_batch(tmp_path):
    pytest.importorskip("transformers")
    from helpers import lossnorm_worker as L

    def fit(name, **extra):
        model = L.gpt2()
        t = Trainer(model, **L.settings(tmp_path / name, batch_size=3, loss=L.next_token_loss, **extra))
        t.fit(L.Sequences(10))
        t.close()
        return W.params(model)

    # each sequence's loss counts its valid tokens: pieces of one sequence weigh what they hold
    assert _max_diff(fit("cut", micro_batch_size=1, accumulate=2), fit("whole", accumulate=2)) < ATOL


def test_auto_halves_on_oom_and_equals_the_final_size_from_the_start(tmp_path, capsys):
    t, got = _fit(tmp_path, "auto", W.Limited(2), accumulate=2, **{"data.micro_batch_size": "auto"})
    out = capsys.readouterr().err
    assert "torchrig: out of memory at micro-batch 8; now 4 (accumulation x4)" in out
    assert "torchrig: out of memory at micro-batch 4; now 2 (accumulation x8)" in out
    assert t.windows.micro_batch_size == 2 and t.model.oom == 2
    # with dropout: the failed attempts' random draws, metric updates and logged sums do not count
    f, want = _fit(tmp_path, "fixed", W.Limited(2), accumulate=2, **{"data.micro_batch_size": 2})
    assert f.model.oom == 0
    assert _max_diff(got, want) < ATOL
    assert _history_diff(t.history, f.history) < ATOL


def test_auto_redoes_the_window_from_its_first_loaded_batch(tmp_path, capsys):
    # the 4th forward (the second loaded batch of the second window) is the first to run out of memory
    t, got = _fit(tmp_path, "auto", W.Limited(4, after=3, p=0.0), accumulate=2, **{"data.micro_batch_size": "auto"})
    assert "out of memory at micro-batch 8; now 4" in capsys.readouterr().err
    assert t.windows.micro_batch_size == 4 and t.model.oom == 1
    _, want = _fit(tmp_path, "fixed", W.Limited(None, p=0.0), accumulate=2, **{"data.micro_batch_size": 4})
    assert _max_diff(got, want) < ATOL


def test_resume_uses_the_saved_micro_batch_size(tmp_path, capsys):
    run = dict(accumulate=2, checkpoint_every=1, keep_last=20, **{"data.micro_batch_size": "auto"})
    _, want = _fit(tmp_path, "whole", W.Limited(2), **run)
    capsys.readouterr()
    _fit(tmp_path, "stopped", W.Limited(2), max_steps=3, **run)
    assert "now 2" in capsys.readouterr().err
    saved = tmp_path / "stopped" / "checkpoints" / "step-00000003"
    assert saved.is_dir()
    resumed = W.Limited(2)
    t, got = _fit(tmp_path, "stopped", resumed, resume=str(saved), **run)
    assert t.global_step > 3 and t.windows.micro_batch_size == 2
    assert resumed.oom == 0 and "out of memory" not in capsys.readouterr().err
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_out_of_memory_at_one_row_is_one_clear_line(tmp_path):
    with pytest.raises(MicroBatchError) as err:
        _fit(tmp_path, "none", W.Limited(0), **{"data.micro_batch_size": "auto"})
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("out of memory at a micro-batch of 1 row (data.micro_batch_size=auto, "
                           "data.batch_size=8)")


def test_config_is_checked(tmp_path):
    for bad in (0, "half", 2.5):
        with pytest.raises(ConfigError) as err:
            Trainer(W.Limited(None), **W.settings(tmp_path, **{"data.micro_batch_size": bad}))
        assert str(err.value) == (f"config key 'data.micro_batch_size': expected an integer >= 1 or 'auto' "
                                  f"or null, got {bad!r}")
    with pytest.raises(ConfigError, match="'data.micro_batch_size': 2 needs loss_normalization"):
        _fit(tmp_path, "mb", W.Limited(None), loss_normalization="micro_batches", **{"data.micro_batch_size": 2})


@pytest.mark.slow
def test_two_ranks_agree_when_only_one_runs_out_of_memory(tmp_path):
    out = tmp_path / "ddp"
    results = dist_procs.pair("ddp", out, tmp_path / "init-store", timeout=120,
                              worker=dist_procs.HELPERS / "microbatch_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    reports = [json.loads((out / f"report-{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["auto"]["size"] for r in reports] == [2, 2]
    assert [r["auto"]["oom"] for r in reports] == [0, 2]
    assert "torchrig: out of memory at micro-batch 8; now 4" in results[0].output
    assert _max_diff(torch.load(out / "auto.pt"), torch.load(out / "fixed.pt")) < ATOL
    assert _history_diff(reports[0]["auto"]["history"], reports[0]["fixed"]["history"]) < ATOL
    assert [r["auto_bn"]["size"] for r in reports] == [2, 2] and reports[1]["auto_bn"]["oom"] == 2
    assert _max_diff(torch.load(out / "auto_bn.pt"), torch.load(out / "fixed_bn.pt")) < ATOL
    for r in reports:  # refused on every rank before any forward: no rank is left waiting
        assert r["syncbn"].startswith("config key 'data.micro_batch_size': 'auto' cannot be used with SyncBatchNorm")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_real_cuda_oom_is_recovered(tmp_path, capsys, precision):
    """A real out-of-memory error from CUDA's allocator: the size halves until the window fits, and the run
    equals one configured with that size from the start (the failed attempts left nothing behind)."""
    free, _ = torch.cuda.mem_get_info()
    width = int(free // (6 * 4))  # one row's activations: a sixth of the free memory (float32, kept for backward)

    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.scale = torch.nn.Parameter(torch.full((1, 1), 1e-3))
            self.head = torch.nn.Linear(W.FEATURES, W.CLASSES)

        def forward(self, x):
            big = torch.exp(x[:, :1].float() * self.scale.expand(1, width))  # (rows, width): rows / 6 of the memory
            return self.head(x) + big.mean(dim=1, keepdim=True)

    def fit(name, size):
        model = Wide()
        t = Trainer(model, device="cuda", precision=precision,
                    **W.settings(tmp_path / name, epochs=1, metrics=[], **{"data.micro_batch_size": size}))
        t.fit(W.classification(16))
        t.close()
        torch.cuda.empty_cache()
        return t, {k: v.detach().cpu() for k, v in model.state_dict().items()}

    t, got = fit("auto", "auto")
    assert t.windows.micro_batch_size < 8 and "torchrig: out of memory at micro-batch 8" in capsys.readouterr().err
    assert all(torch.isfinite(v).all() for v in got.values())
    _, want = fit("fixed", t.windows.micro_batch_size)
    assert _max_diff(got, want) < ATOL
