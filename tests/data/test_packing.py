"""Packed documents (``torchrig.data.PackedDocuments``, ``data.pack``): rows that are nearly full, documents that
never see each other (a packed batch's loss is the token-weighted mean of each document's loss alone, for a
plain model masked by ``document_mask`` and for GPT-2), exact and elastic resume, and the one-line refusals."""

from __future__ import annotations

import importlib.util
import json
import shutil
import warnings
from collections import Counter

import pytest
import torch

from helpers import dist_procs
from helpers import packed_lm as P
from helpers.recipe_helpers import cli

from torchrig.data import DataError, Mixture, PackedDocuments, document_ids, document_mask
from torchrig.data.packing import check_model, pack_rows

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


def mixed_corpus(n: int = 1200, seed: int = 0) -> list[list[int]]:
    """Mostly short documents, some of a few hundred tokens and a few longer than a row of 256 (doc i's tokens are
    i * 10_000 + j + 1: each token names its document and place; 0 is the padding)."""
    g = torch.Generator().manual_seed(seed)
    short = torch.randint(1, 60, (n,), generator=g)
    long = torch.randint(60, 700, (n,), generator=g)
    lengths = torch.where(torch.rand(n, generator=g) < 0.8, short, long).tolist()
    return [[i * 10_000 + j + 1 for j in range(k)] for i, k in enumerate(lengths)]


def segments(rows: PackedDocuments) -> list[list[int]]:
    """Every document piece of every row (the padding, token 0, left out), read back through its position ids."""
    out = []
    for ids, docs in zip(rows.input_ids, document_ids(rows.position_ids)):
        for d in docs.unique().tolist():
            piece = ids[(docs == d) & (ids != 0)]
            if len(piece):
                out.append(piece.tolist())
    return out


def test_packing_fills_rows_and_keeps_each_document_whole_or_in_row_sized_pieces():
    docs = mixed_corpus()
    rows = PackedDocuments(docs, 256)
    assert rows.used >= 0.95, rows.describe()
    assert rows.describe() == (f"packed 1,200 documents ({rows.pieces:,} pieces) into {len(rows):,} rows of 256 "
                               f"tokens: {100 * rows.used:.1f} % of tokens used")
    pieces = [d[i:i + 256] for d in docs for i in range(0, len(d), 256)]
    assert sorted(segments(rows)) == sorted(pieces)  # each piece once, whole, in order
    row = rows[0]
    assert set(row) == {"input_ids", "labels", "position_ids"} and row["input_ids"].shape == (256,)
    starts = rows.position_ids == 0
    assert (rows.labels[starts] == -100).all() and (rows.labels[:, 0] == -100).all()
    real = rows.labels != -100
    assert torch.equal(rows.labels[real], rows.input_ids[real]) and int(real.sum()) == len(sum(pieces, [])) - len(pieces)
    again = PackedDocuments(docs, 256)  # a pure function of the documents and the row length
    assert all(torch.equal(getattr(rows, k), getattr(again, k)) for k in ("input_ids", "labels", "position_ids"))
    assert pack_rows([3, 5, 2, 4, 6], 8) == [[4, 2], [1, 0], [3]]  # best-fit decreasing, ties by index


def _alone_mean(model, docs, forward) -> torch.Tensor:
    """The token-weighted mean of each document's loss computed alone (a row of its own, no padding)."""
    total, count = 0.0, 0
    for doc in (d for d in docs if len(d) > 1):  # a lone token predicts nothing
        ids = torch.tensor([doc])
        total = total + forward(model, ids, torch.arange(len(doc))[None]) * (len(doc) - 1)
        count += len(doc) - 1
    return total / count


def _plain(model, ids, pos):
    return P.lm_loss(model(ids, pos), ids)


@torch.no_grad()
def test_a_packed_batch_of_a_plain_model_loses_what_its_documents_lose_alone():
    """``document_mask``: with the dense mask (scaled_dot_product_attention) the packed batch's loss is the
    token-weighted mean of each document's loss alone (float64, 1e-6); FlexAttention's BlockMask (eager, on the
    CPU) gives the same logits."""
    docs = [d for d in P.corpus() if len(d) <= P.LENGTH]
    batch = PackedDocuments(docs, P.LENGTH)[:]
    model = P.make_model().double()
    logits = model(batch["input_ids"], batch["position_ids"])
    alone = _alone_mean(model, docs, _plain)
    assert abs(P.lm_loss(logits, batch["labels"]).item() - alone.item()) < 1e-6
    model.flex = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's note that torch.compile fuses it
        assert (model(batch["input_ids"], batch["position_ids"]) - logits).abs().max().item() < 1e-10
    model.flex = False
    crossing = P.lm_loss(model(batch["input_ids"], torch.arange(P.LENGTH).expand(len(logits), -1)), batch["labels"])
    assert abs(crossing.item() - alone.item()) > 1e-3  # one causal mask over the row would not


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@torch.no_grad()
def test_gpt2_keeps_packed_documents_apart_by_their_position_ids_and_is_refused_with_a_cache_as_an_encoder_is():
    from transformers import GPT2Config, GPT2LMHeadModel

    docs = [d for d in P.corpus() if len(d) <= P.LENGTH]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=P.VOCAB, n_positions=P.LENGTH, n_layer=2, n_embd=16, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
                        initializer_range=0.3)  # weights large enough that attention matters
    model = GPT2LMHeadModel(config).double().train()
    model.loss_type = "ForCausalLM"
    batch = PackedDocuments(docs, P.LENGTH)[:]
    with pytest.raises(DataError, match=r"^packed documents: GPT2LMHeadModel has config.use_cache=True.*set "
                                        r"model.config.use_cache = False"):
        check_model(model, pipelined=False)
    def loss(ids, pos, labels):  # transformers computes its own loss in float32: this is the same one in float64
        return P.lm_loss(model(input_ids=ids, position_ids=pos).logits, labels)

    cached = loss(batch["input_ids"], batch["position_ids"], batch["labels"])  # transformers looks for documents
    model.config.use_cache = False  # only without a cache: with one they see each other
    check_model(model, pipelined=False)
    alone = _alone_mean(model, docs, lambda m, ids, pos: loss(ids, pos, ids))
    assert abs(loss(batch["input_ids"], batch["position_ids"], batch["labels"]).item() - alone.item()) < 1e-6
    assert abs(model(**batch).loss.item() - alone.item()) < 1e-5  # the model's own loss, in float32
    assert abs(cached.item() - alone.item()) > 1e-3
    from transformers import BertConfig, BertForMaskedLM  # an encoder: its mask ignores position ids

    bert = BertForMaskedLM(BertConfig(vocab_size=P.VOCAB, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=8, use_cache=False))
    with pytest.raises(DataError, match=r"^packed documents: BertForMaskedLM \(base BertModel\) does not build its "
                                        r"attention mask with transformers' create_causal_mask"):
        check_model(bert, pipelined=False)


class NoPositions(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(P.VOCAB, 4)

    def forward(self, input_ids):
        return self.embed(input_ids)


def test_what_cannot_keep_packed_documents_apart_is_refused_in_one_line(tmp_path, capsys):
    from torchrig import Trainer

    with pytest.raises(DataError, match=r"^packed documents: NoPositions.forward\(input_ids\) has no position_ids "
                                        r"parameter.*torchrig.data.document_mask\(position_ids\)"):
        Trainer(NoPositions(), loss=P.lm_loss, run_dir=str(tmp_path / "run"), epochs=1, threads=1).fit(P.packed())
    with pytest.raises(DataError, match=r"^packed documents under parallel.pp: .*DocLM.*set parallel.pp=1"):
        check_model(P.make_model(), pipelined=True)
    with pytest.raises(DataError, match=r"data.input_keys=\['input_ids'\] leaves out position_ids"):
        check_model(P.make_model(), pipelined=False, input_keys=("input_ids",))
    with pytest.raises(DataError, match=r"^packed documents under parallel.cp=2: PyTorch's ring attention .*DocLM"):
        check_model(P.make_model(), pipelined=False, cp=2)  # the ring is causal over the whole row
    mixed = Mixture({"a": P.packed(), "b": P.packed()}, weights={"a": 1, "b": 1})
    with pytest.raises(DataError, match=r"^packed documents: NoPositions.forward"):  # packed inside a Mixture too
        Trainer(NoPositions(), loss=P.lm_loss, run_dir=str(tmp_path / "mixed"), epochs=1, threads=1).fit(mixed)
    with pytest.raises(DataError, match=r"^PackedDocuments: document 1 is a torch.float32 tensor"):
        PackedDocuments([[1, 2], torch.ones(3)], 8)
    rc, _, err = cli(["train", "--recipe", "text-classification", "--set", "data.pack=true", "--set",
                      f"run_dir={tmp_path / 'text'}"], capsys)
    assert rc != 0 and "config key 'data.pack': true, but the text-classification recipe does not pack: a text " \
                       "has one label" in err and len(err.strip().splitlines()) == 1, err


# ----------------------------------------------------------------------------- resume
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process: uninterrupted (a checkpoint at step CUT, mid epoch 2) and resumed from that checkpoint; two
    processes (one launch): resumed from it as well."""
    out = tmp_path_factory.mktemp("packed")
    threads = torch.get_num_threads()
    try:
        P.fit(out, "one")
        cut = out / "one" / "checkpoints" / f"step-{P.CUT:08d}"
        P.fit(out, "one_again", str(cut))
    finally:
        torch.set_num_threads(threads)
    shutil.copytree(cut, out / "one_to_two" / "checkpoints" / cut.name)
    for rank, r in enumerate(dist_procs.processes([str(out), f"one_to_two={cut}"], 2, out, out / "store",
                                                  timeout=240, worker=dist_procs.HELPERS / "packed_lm.py")):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    read = {name: [json.loads((out / f"{name}-rows-{r}.json").read_text()) for r in range(world)]
            for name, world in (("one", 1), ("one_again", 1), ("one_to_two", 2))}
    return {name: {"params": torch.load(out / f"{name}.pt"), "rows": [r["rows"] for r in ranks],
                   "steps": {r["step"] for r in ranks}} for name, ranks in read.items()}


def _by_step(rows_of_ranks: list, after: int = 0) -> dict:
    steps: dict = {}
    for rows in rows_of_ranks:
        for _, step, trained in rows:
            if step > after:
                steps.setdefault(step, Counter()).update(trained)
    return steps


def test_packed_rows_resume_mid_epoch_exactly(runs):
    one, again = runs["one"], runs["one_again"]
    assert one["steps"] == again["steps"] == {12}
    assert all(torch.equal(one["params"][k], again["params"][k]) for k in one["params"])  # bitwise
    start = P.make_model().state_dict()
    assert max((one["params"][k] - start[k]).abs().max().item() for k in start) > 1e-2  # and it learned
    assert _by_step(again["rows"]) == _by_step(one["rows"], after=P.CUT)


def test_packed_rows_resume_on_another_number_of_processes_with_the_next_global_batch(runs):
    one, two = runs["one"], runs["one_to_two"]
    assert two["steps"] == {12}
    assert max((one["params"][k] - two["params"][k]).abs().max().item() for k in one["params"]) < 1e-6
    assert min(_by_step(two["rows"])) == P.CUT + 1
    assert _by_step(two["rows"]) == _by_step(one["rows"], after=P.CUT)  # the same rows in each global batch
    seen = Counter(r for rows in one["rows"] for e, s, trained in rows if e == 1 and s <= P.CUT for r in trained)
    seen.update(r for rows in two["rows"] for _, _, trained in rows for r in trained)
    assert sorted(seen) == list(range(len(P.packed()))) and set(seen.values()) == {1}  # each row once in epoch 2
