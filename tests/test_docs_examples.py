"""The Python examples of docs/your-code.md run as written, each in its own namespace, and do what
the page says they do."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

PAGE = Path(__file__).resolve().parent.parent / "docs" / "your-code.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def blocks() -> list[tuple[int, str]]:
    text = PAGE.read_text()
    return [(text[:m.start()].count("\n") + 2, m.group(1)) for m in BLOCK.finditer(text)]


def _check_bert(ns):
    assert ns["trainer"].global_step == 8
    pred = ns["trainer"].predict(ns["data"])
    assert pred.shape == (64, 2) and torch.allclose(pred, ns["trainer"].predict(ns["data"], outputs="all")["logits"])


def _check_two_inputs(ns):
    assert {k: tuple(v.shape) for k, v in ns["out"].items()} == {"logits": (20, 4), "features": (20, 6)}
    torch.testing.assert_close(ns["out"]["logits"].sum(1), torch.ones(20))  # probabilities


def _check_steplr(ns):
    assert ns["opt"].param_groups[0]["lr"] == pytest.approx(0.0125)


def _check_onecycle(ns):
    sch = ns["trainer"].schedulers["default"]
    assert ns["trainer"].total_steps == sch.total_steps == sch.last_epoch == 24


def _check_stream(ns):
    assert ns["trainer"].global_step == 64 and [h["step"] for h in ns["trainer"].history] == [32, 64]
    assert ns["capped"].global_step == 62 and ns["capped"].total_steps == 62


def _check_lossnorm(ns):
    assert (ns["full"] - ns["accumulated"]).abs().max() < 1e-6


def _check_dict_batches(ns):
    assert ns["trainer"].global_step == 1  # 32 samples, one batch of the default 64
    assert ns["trainer"].history[-1]["train/loss"] > 0


def _check_torchmetrics(ns):
    from sklearn.metrics import f1_score

    x, y, trainer = ns["x"], ns["y"], ns["trainer"]
    with torch.no_grad():
        pred = trainer.model(x[96:]).argmax(1)
    assert ns["scores"]["MulticlassF1Score"] == pytest.approx(f1_score(y[96:], pred, average="macro"), abs=1e-6)
    assert {"val/accuracy", "val/MulticlassF1Score", "val/precision_w", "val/acc_micro"} <= set(trainer.history[-1])


def _check_token_model(ns):
    lm, chars = ns["lm"], ns["Chars"]()
    assert ns["probs"].shape == (1, 8, 13) and ns["raw"].shape == (1, 8, 13)
    torch.testing.assert_close(ns["probs"].sum(-1), torch.ones(1, 8))  # softmax over the classes, the last dim
    ids, targets = (torch.stack(t) for t in zip(*[chars[i] for i in range(len(chars))]))
    with torch.no_grad():
        lm.model.eval()
        logits = lm.model(ids)
    accuracy = lm.evaluate(chars)["accuracy"]
    assert accuracy == pytest.approx((logits.argmax(-1) == targets).float().mean().item(), abs=1e-6)
    assert not torch.allclose(ns["raw"].sum(-1), torch.ones(1, 8))  # a loss of one's own: raw logits


def _check_mixture(ns):
    import json

    mix, trainer = ns["mix"], ns["trainer"]
    assert len(mix) == 360 and mix.quotas == [252, 108] and trainer.global_step == 12
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    shares = [(r["data/share/web"], r["data/share/code"]) for r in rows if r.get("kind") == "interval"]
    assert len(shares) == 3 and all(abs(w + c - 1) < 1e-12 for w, c in shares)
    assert abs(sum(w for w, _ in shares) / 3 - 0.7) < 1e-12  # the whole epoch: 252 of 360 exactly


def _check_packed(ns):
    rows, trainer = ns["rows"], ns["trainer"]
    assert rows.used >= 0.95 and trainer.global_step == -(-len(rows) // 8)
    assert trainer.history[-1]["train/loss"] > 0


CHECKS = {"PackedDocuments(docs": _check_packed, "BertForSequenceClassification": _check_bert, "MetricCollection": _check_torchmetrics, "TwoInputs": _check_two_inputs,
          "StepLR": _check_steplr, "one_cycle = ": _check_onecycle, "class Stream": _check_stream, "accumulated = run": _check_lossnorm,
          "input_keys=": _check_dict_batches, "class CharLM": _check_token_model,
          "Mixture(": _check_mixture}


pytestmark = pytest.mark.usefixtures("restore_threads")


def test_every_example_is_checked():
    for _, src in blocks():
        assert sum(marker in src for marker in CHECKS) == 1, src[:200]


@pytest.mark.parametrize("line,src", blocks(), ids=lambda v: str(v) if isinstance(v, int) else "")
def test_example_runs(line, src, tmp_path, monkeypatch, capsys):
    for package in ("transformers", "torchmetrics"):
        if package in src:
            pytest.importorskip(package)
    monkeypatch.chdir(tmp_path)
    ns: dict = {"__name__": "docs_example"}
    exec(compile(src, f"docs/your-code.md, block at line {line}", "exec"), ns)
    next(check for marker, check in CHECKS.items() if marker in src)(ns)
