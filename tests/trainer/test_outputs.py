"""Any model output, any batch: Hugging Face models with their own loss, tuple / dict outputs,
dict batches chosen by forward's signature, and the structure of predict."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import dist_procs
from helpers.hf_worker import QUIET, bert, classification_data, gpt2, lm_data, params, settings
from torch import nn
from torch.utils.data import Dataset, TensorDataset

import torchrig
from torchrig.config import ConfigError
from torchrig.data.batches import BatchError
from torchrig.optim.losses import AutoLoss
from torchrig.trainer.outputs import OutputError

pytest.importorskip("transformers")


def _losses(trainer) -> list:
    return [row["train/loss"] for row in trainer.history]


def _hf_trainer(model, run_dir, **kw):
    return torchrig.Trainer(model, **settings(run_dir, **kw))


# ----------------------------------------------------------------------------- Hugging Face models


def test_bert_trains_with_its_own_loss_and_predicts_stacked_logits(tmp_path):
    model = bert()
    trainer = _hf_trainer(model, tmp_path / "bert", epochs=2)  # optimizer="adamw", no loss, no step function
    assert isinstance(trainer.loss_fn, AutoLoss)
    data, held_out = classification_data(64), classification_data(13, seed=1)
    trainer.fit(data)
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.01, losses
    assert "train/accuracy" in trainer.history[-1]

    result = trainer.evaluate(held_out)
    batch = {k: torch.stack([s[k] for s in held_out]) for k in held_out[0]}
    model.eval()
    with torch.no_grad():
        ref = model(**batch)  # labels included: the model's own loss
    assert result["loss"] == pytest.approx(float(ref.loss), rel=1e-4)  # 13 samples: batches of 4+4+4+1, weighted
    assert result["accuracy"] == pytest.approx(float((ref.logits.argmax(1) == batch["labels"]).float().mean()))

    pred = trainer.predict(held_out)  # a ModelOutput: its logits, as probabilities, as for a tensor output
    assert isinstance(pred, torch.Tensor) and pred.shape == (13, 2)
    assert torch.allclose(pred, ref.logits.softmax(-1), atol=1e-5)
    everything = trainer.predict(held_out, outputs="all")  # the structure: a dict of per-sample fields
    assert set(everything) == {"logits"} and torch.allclose(everything["logits"], pred)
    raw = trainer.predict(held_out, activation="none", outputs="all")
    assert torch.allclose(raw["logits"], ref.logits, atol=1e-5)
    assert torch.allclose(trainer.predict(held_out, activation="none"), ref.logits, atol=1e-5)


def test_bert_with_return_dict_false_trains_with_the_loss_its_tuple_starts_with(tmp_path):
    """``return_dict=False``: the model returns ``(loss, logits)`` given labels and ``(logits,)`` without; the
    first trains under loss=auto, the logits feed the metrics and predict, as with a ModelOutput."""
    data, held_out = classification_data(64), classification_data(13, seed=1)
    runs = {}
    for name, return_dict in (("dict", True), ("tuple", False)):
        model = bert()
        model.config.return_dict = return_dict
        trainer = _hf_trainer(model, tmp_path / name, epochs=2)
        trainer.fit(data)
        runs[name] = (trainer, params(model))
    (dict_run, dict_params), (tuple_run, tuple_params) = runs["dict"], runs["tuple"]
    for k in dict_params:
        assert torch.allclose(dict_params[k], tuple_params[k], atol=1e-6), k
    assert tuple_run.history[-1]["train/accuracy"] == pytest.approx(dict_run.history[-1]["train/accuracy"])
    assert tuple_run.evaluate(held_out)["loss"] == pytest.approx(dict_run.evaluate(held_out)["loss"], rel=1e-5)
    pred = tuple_run.predict(held_out, outputs="all")  # no labels: (logits,), a tuple of per-sample fields
    assert isinstance(pred, tuple) and pred[0].shape == (13, 2)
    assert torch.allclose(pred[0], dict_run.predict(held_out), atol=1e-5)
    assert torch.allclose(tuple_run.predict(held_out), dict_run.predict(held_out), atol=1e-5)


def test_a_tuple_starting_with_a_scalar_is_loss_and_prediction_unless_output_key_says_otherwise():
    from torchrig.trainer.outputs import unpack

    loss, logits, hidden = torch.tensor(0.5), torch.randn(4, 3), torch.randn(4, 8)
    assert unpack((loss, logits, hidden))[0] is logits and unpack((loss, logits, hidden))[1] is loss
    assert unpack((logits, hidden)) == (logits, None)
    assert unpack((loss, logits, hidden), 2) == (hidden, None)
    assert unpack((torch.tensor(3), logits))[1] is None  # an integer scalar is no loss


def test_gpt2_causal_lm_learns_from_labels(tmp_path):
    trainer = _hf_trainer(gpt2(), tmp_path / "gpt2", epochs=2, lr=3e-3, metrics=[])
    trainer.fit(lm_data(48))
    losses = _losses(trainer)
    assert losses[-1] < losses[0] - 0.3, losses
    result = trainer.evaluate(lm_data(10, seed=1))
    assert set(result) == {"loss"} and result["loss"] < losses[0]
    pred = trainer.predict(lm_data(10, seed=1), activation="none", outputs="all")
    assert set(pred) == {"logits"}  # the key/value cache and the loss are not per-sample fields
    assert pred["logits"].shape == (10, 16, 100)
    assert torch.equal(trainer.predict(lm_data(10, seed=1), activation="none"), pred["logits"])


def test_gpt2_accuracy_compares_each_next_token_and_skips_unlabelled_positions(tmp_path):
    """A causal LM's accuracy is over ``logits[:, :-1]`` against ``labels[:, 1:]`` (what its loss trains), with
    the class dimension last as Hugging Face returns it, and positions labelled -100 left out."""
    model = gpt2()
    trainer = _hf_trainer(model, tmp_path / "gpt2", epochs=2, lr=3e-3)
    trainer.fit(lm_data(48))
    held_out = lm_data(10, seed=1)
    for i, sample in enumerate(held_out):
        sample["labels"] = sample["labels"].clone()
        sample["labels"][: 3 + i % 4] = -100  # a prompt that is not scored
    result = trainer.evaluate(held_out)
    batch = {k: torch.stack([s[k] for s in held_out]) for k in held_out[0]}
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    pred, labels = logits[:, :-1].argmax(-1), batch["labels"][:, 1:]
    valid = labels != -100
    expected = float(((pred == labels) & valid).sum()) / float(valid.sum())
    assert result["accuracy"] == pytest.approx(expected, abs=1e-6)
    assert 0.2 < trainer.history[-1]["train/accuracy"] <= 1.0  # counting sequences: learnt, not 1/vocab


def test_user_loss_replaces_the_models_own(tmp_path):
    """A loss the user gives is called on the logits; the labels are then not passed to forward."""
    auto = _hf_trainer(bert(), tmp_path / "auto", metrics=[])
    doubled = _hf_trainer(bert(), tmp_path / "doubled", metrics=[],
                          loss=lambda logits, y: 2 * F.cross_entropy(logits, y))
    data = classification_data(12)
    assert doubled.evaluate(data)["loss"] == pytest.approx(2 * auto.evaluate(data)["loss"], rel=1e-5)
    doubled.fit(data)  # metrics=[] with a ModelOutput: nothing reads the output but the loss
    assert doubled.global_step == 3  # 12 samples, batches of 4, one epoch


def test_ddp_two_ranks_equal_one_process(tmp_path):
    out = tmp_path / "pair"
    results = dist_procs.pair("ddp", out, out / "init-store", timeout=120, worker=dist_procs.HELPERS / "hf_worker.py")
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    print(f"worker pair: {results[0].seconds:.1f} s")
    ddp = torch.load(out / "ddp.pt", weights_only=False)
    for name, build, data, metrics in (("bert", bert, classification_data, ["accuracy"]),
                                       ("gpt2", gpt2, lm_data, [])):
        one = _hf_trainer(build(), tmp_path / name, batch_size=8, metrics=metrics)
        one.fit(data(32))
        assert ddp[name]["steps"] == one.global_step == 4
        mine = params(one.model)
        worst = max(float((v - mine[k]).abs().max()) for k, v in ddp[name]["params"].items())
        # float rounding only, amplified by AdamW's normalised steps: the ranks weigh their token means by their
        # counts, the one process leaves its whole batch's mean as it is (~2.5e-6 here)
        assert worst < 5e-6, (name, worst)
        ev = one.evaluate(data(13, seed=1))
        assert ddp[name]["eval"] == pytest.approx(ev, rel=1e-5)
        pred = one.predict(data(13, seed=1))  # 7 + 6 samples on the ranks, back in data order
        assert torch.allclose(ddp[name]["predict"], pred, atol=1e-5)


# ----------------------------------------------------------------------------- tuple and dict outputs


class TupleNet(nn.Module):
    """Returns (features, logits) or (logits, features)."""

    def __init__(self, logits_first: bool = False):
        super().__init__()
        self.body, self.head, self.logits_first = nn.Linear(8, 6), nn.Linear(6, 4), logits_first

    def forward(self, x):
        f = torch.tanh(self.body(x))
        return (self.head(f), f) if self.logits_first else (f, self.head(f))


class DictNet(TupleNet):
    def __init__(self, key: str = "logits"):
        super().__init__()
        self.key = key

    def forward(self, x):
        f, logits = super().forward(x)
        return {"features": f, self.key: logits, "loss": None}


def test_tuple_output_with_output_key_trains_like_a_tensor_output(make_trainer, data, tmp_path):
    torch.manual_seed(0)
    ref = make_trainer(TupleNet(logits_first=True), run_dir=str(tmp_path / "ref"))
    ref.fit(data)  # the prediction is element 0 by default
    torch.manual_seed(0)
    picked = make_trainer(TupleNet(), output_key=1, run_dir=str(tmp_path / "picked"))
    picked.fit(data)
    for p, q in zip(ref.model.parameters(), picked.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert picked.history[-1]["train/accuracy"] == ref.history[-1]["train/accuracy"]

    x = data.tensors[0]
    pred = picked.predict(x, outputs="all")
    f, logits = picked.model(x)
    assert torch.allclose(picked.predict(x), logits.softmax(-1), atol=1e-6)  # the prediction alone by default
    assert isinstance(pred, tuple) and len(pred) == 2
    assert torch.allclose(pred[0], f, atol=1e-6)  # other fields as they are
    assert torch.allclose(pred[1], logits.softmax(-1), atol=1e-6)  # probabilities for the prediction only


def test_dict_output_logits_or_output_key(make_trainer, data, tmp_path):
    torch.manual_seed(0)
    by_logits = make_trainer(DictNet(), run_dir=str(tmp_path / "a"))
    by_logits.fit(data)
    torch.manual_seed(0)
    by_key = make_trainer(DictNet("scores"), output_key="scores", run_dir=str(tmp_path / "b"))
    by_key.fit(data)
    for p, q in zip(by_logits.model.parameters(), by_key.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    x = data.tensors[0]
    pred = by_key.predict(TensorDataset(x, data.tensors[1]), outputs="all")  # (x, y) evaluation data: y dropped
    out = by_key.model(x)
    assert torch.allclose(by_key.predict(x), out["scores"].softmax(-1), atol=1e-6)
    assert set(pred) == {"features", "scores"}  # the None loss is not a per-sample field
    assert torch.allclose(pred["scores"], out["scores"].softmax(-1), atol=1e-6)
    assert torch.allclose(pred["features"], out["features"], atol=1e-6)

    with pytest.raises(OutputError, match=r"output_key='logit': the model's dict has keys \['features', 'scores', 'loss'\]"):
        make_trainer(DictNet("scores"), output_key="logit", run_dir=str(tmp_path / "c")).fit(data)
    with pytest.raises(OutputError, match=r"set output_key to the key of the prediction"):
        make_trainer(DictNet("scores"), run_dir=str(tmp_path / "d")).fit(data)
    with pytest.raises(OutputError, match=r"output_key=2: the model returned a tuple of 2 elements"):
        make_trainer(TupleNet(), output_key=2, run_dir=str(tmp_path / "e")).fit(data)


def test_custom_loss_with_no_metrics_on_a_model_output(make_trainer, data):
    from transformers.modeling_outputs import SequenceClassifierOutput

    class Wrapped(TupleNet):
        def forward(self, x):
            return SequenceClassifierOutput(logits=super().forward(x)[1])

    seen = []

    def loss(logits, y):
        seen.append(type(logits))
        return F.cross_entropy(logits, y)

    trainer = make_trainer(Wrapped(), loss=loss, metrics=[])
    trainer.fit(data)
    assert trainer.global_step == 5 and set(seen) == {torch.Tensor}
    assert trainer.predict(data.tensors[0]).shape == (40, 4)  # a callable loss: raw logits
    with pytest.raises(ValueError, match=r'^predict\(outputs=\'everything\'\): expected "prediction" \(the '
                                         r'prediction tensor, the default\) or "all"'):
        trainer.predict(data.tensors[0], outputs="everything")


# ----------------------------------------------------------------------------- dict batches


class Images(Dataset):
    def __init__(self, x, y, extra=None):
        self.x, self.y, self.extra = x, y, extra

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        item = {"image": self.x[i], "label": self.y[i]}
        if self.extra is not None:
            item["mask"] = self.extra[i]
        return item


class MaskedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, mask):
        return self.fc(x * mask)


def test_image_label_dict_batches_with_forward_x(make_trainer, data, tmp_path):
    x, y = data.tensors
    torch.manual_seed(0)
    ref = make_trainer(run_dir=str(tmp_path / "ref"))
    ref.fit(data)
    trainer = make_trainer(run_dir=str(tmp_path / "dict"))
    trainer.fit(Images(x, y))  # the one key left besides the label goes to forward(x) by position
    for p, q in zip(ref.model.parameters(), trainer.model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert trainer.evaluate(Images(x, y)) == pytest.approx(ref.evaluate(data))
    assert torch.allclose(trainer.predict(Images(x, y)), ref.predict(x))


def test_dict_batch_that_does_not_fit_forward_names_keys_and_signature(make_trainer, data, tmp_path):
    x, y = data.tensors
    with pytest.raises(BatchError) as err:
        make_trainer(MaskedNet()).fit(Images(x, y))
    msg = str(err.value)
    assert "\n" not in msg
    assert msg == ("dict batch with keys ['image'] (besides the label) does not fit forward(x, mask): no value for "
                   "'mask'; set data.input_keys to the batch keys forward takes, in order, and data.label_key to "
                   "the target's key")
    rows = [{"a": x[i], "b": x[i], "label": y[i]} for i in range(len(x))]
    with pytest.raises(BatchError, match=r"keys \['a', 'b'\] \(besides the label\) does not fit forward\(x, mask\); set"):
        make_trainer(MaskedNet(), run_dir=str(tmp_path / "ab")).fit(rows)

    # keys forward does not name are passed positionally in the order data.input_keys gives
    mask = torch.ones_like(x)
    trainer = make_trainer(MaskedNet(), input_keys=["image", "mask"], run_dir=str(tmp_path / "keys"))
    trainer.fit(Images(x, y, mask))
    assert trainer.global_step == 5
    with pytest.raises(BatchError, match=r"data.input_keys=\['image', 'noise'\]: the batch has no key 'noise'"):
        make_trainer(MaskedNet(), input_keys=["image", "noise"], run_dir=str(tmp_path / "bad")).fit(Images(x, y, mask))


def test_forward_signature_picks_keys_and_label_key_renames_the_target(make_trainer, data, tmp_path):
    x, y = data.tensors

    class Named(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x, mask=None):
            return self.fc(x if mask is None else x * mask)

    rows = [{"x": x[i], "idx": torch.tensor(i), "cls": y[i]} for i in range(len(x))]
    trainer = make_trainer(Named(), label_key="cls")  # 'idx' is not a parameter of forward: left out
    trainer.fit(rows)
    assert trainer.global_step == 5
    assert trainer.evaluate(rows)["accuracy"] == pytest.approx(trainer.evaluate(data)["accuracy"])
    with pytest.raises(ValueError, match="training batches carry no target"):
        make_trainer(Named(), run_dir=str(tmp_path / "nolabel")).fit(rows)  # no known label key, none set


# ----------------------------------------------------------------------------- predict inputs and activations


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 4), nn.Linear(3, 4)

    def forward(self, x1, x2):
        return self.a(x1) + self.b(x2)


def test_predict_two_input_tuples_uses_both(make_trainer):
    g = torch.Generator().manual_seed(0)
    x1, x2, y = torch.randn(10, 8, generator=g), torch.randn(10, 3, generator=g), torch.randint(0, 4, (10,), generator=g)
    trainer = make_trainer(TwoInputs(), batch_size=4)
    trainer.fit((x1, x2, y))  # training: the last element is the target
    expected = trainer.model(x1, x2).softmax(-1)
    assert torch.allclose(trainer.predict((x1, x2)), expected, atol=1e-6)  # both elements are inputs
    assert torch.allclose(trainer.predict((x1, x2, y)), expected, atol=1e-6)  # a third element: the target


@pytest.mark.parametrize("loss,activation", [(nn.CrossEntropyLoss(), "softmax"), (nn.NLLLoss(), "exp"),
                                             ("cross_entropy", "softmax"), (nn.MSELoss(), "none"),
                                             (lambda out, y: F.cross_entropy(out, y), "none")])
def test_predict_probabilities_for_classification_losses_named_or_objects(make_trainer, data, loss, activation):
    trainer = make_trainer(loss=loss, metrics=[])
    x = data.tensors[0]
    logits = trainer.model(x)
    expected = {"softmax": logits.softmax(-1), "exp": logits.exp(), "none": logits}[activation]
    assert torch.allclose(trainer.predict(x), expected, atol=1e-6)


def test_bce_with_logits_object_gives_sigmoid(make_trainer):
    x = torch.randn(12, 8)
    trainer = make_trainer(nn.Linear(8, 1), loss=nn.BCEWithLogitsLoss(), metrics=[])
    assert torch.allclose(trainer.predict(x), torch.sigmoid(trainer.model(x)), atol=1e-6)


# ----------------------------------------------------------------------------- config keys


@pytest.mark.parametrize("key,value,expected", [
    ("output_key", -1, "config key 'output_key': expected an index >= 0 or a key name or null, got -1"),
    ("output_key", "", "config key 'output_key': expected an index >= 0 or a key name or null, got ''"),
    ("input_keys", [], "config key 'data.input_keys': expected a non-empty list of batch keys or null, got []"),
    ("input_keys", ["x", 3], "config key 'data.input_keys': expected a non-empty list of batch keys or null, "
                             "got ['x', 3]"),
    ("label_key", "", "config key 'data.label_key': expected a non-empty string or null, got ''"),
])
def test_config_keys_are_validated(key, value, expected):
    with pytest.raises(ConfigError) as err:
        torchrig.Trainer(nn.Linear(2, 2), **{key: value}, **QUIET)
    assert str(err.value) == expected


def test_config_keys_from_yaml_and_set(tmp_path):
    cfg = torchrig.load_config(overrides=["output_key=1", "data.input_keys=[image, mask]", "data.label_key=cls"])
    assert (cfg.output_key, cfg.data.input_keys, cfg.data.label_key) == (1, ["image", "mask"], "cls")
    assert torchrig.load_config(overrides=["output_key=logits"]).output_key == "logits"
    assert torchrig.load_config().loss == "auto"
