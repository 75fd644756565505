"""What a load takes from a checkpoint's ``meta.json`` and DCP ``.metadata``, each field by its rule.

Both files come with the checkpoint, so a stranger may have written them (and fixed the checksums to
match): a layout of ``dp_replicate: 10**18`` or ``pp: 0``, a JSON file nested a million levels deep, or a
DCP piece placed at row 10**12 of a 32-row weight (which would leave the weight as it was before the load,
silently). Each is refused in one line naming the file, the field (or the parameter) and the value.
"""

from __future__ import annotations

import json
import pickle
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from helpers import TinyNet, record_checksums
from torch import nn

from torchrig.checkpoint import CheckpointError, read_checkpoint, read_meta, resolve
from torchrig.checkpoint import sharded

OTHER = "use another checkpoint (RUN_DIR/checkpoints/)"


@pytest.fixture
def checkpoint(make_trainer, data, run_dir) -> Path:
    make_trainer(epochs=1).fit(data)
    return resolve("latest", run_dir)


def _forge(ckpt: Path, **fields) -> Path:
    path = ckpt / "meta.json"
    meta = json.loads(path.read_text())
    meta.update(fields)
    path.write_text(json.dumps(meta))
    return path


BAD_FIELDS = [
    ({"layout": {"dp_replicate": 10 ** 18}}, "field 'layout.dp_replicate' is 1000000000000000000, not a number of "
                                             "processes (an integer from 1 to 1048576)"),
    ({"layout": {"dp_shard": -3}}, "field 'layout.dp_shard' is -3, not a number of processes (an integer from 1 to "
                                   "1048576)"),
    ({"layout": {"pp": 0}}, "field 'layout.pp' is 0, not a number of processes (an integer from 1 to 1048576)"),
    ({"layout": {"tp": True}}, "field 'layout.tp' is true, not a number of processes (an integer from 1 to 1048576)"),
    ({"world_size": 4, "layout": {"dp_replicate": 1, "dp_shard": 2, "tp": 1, "pp": 1, "world_size": 4}},
     "field 'layout' is {'dp_replicate': 1, 'dp_shard': 2, 'tp': 1, 'pp': 1, 'world_size': 4}, whose degrees "
     "(dp_replicate=1 × dp_shard=2 × tp=1 × pp=1) make 2 processes, not its world size 4"),
    ({"layout": [2, 2]}, "field 'layout' is [2, 2], not a mapping of degrees (dp_replicate, dp_shard, cp, tp, pp, "
                         "world_size)"),
    ({"world_size": "2"}, "field 'world_size' is '2', not a number of processes (an integer from 1 to 1048576)"),
    ({"step": -1}, "field 'step' is -1, not a step count (an integer from 0 to 9007199254740992)"),
    ({"strategy": "horovod"}, "field 'strategy' is 'horovod', not one of none, ddp, fsdp, dp"),
    ({"optimizer_keys": "by_position"}, "field 'optimizer_keys' is 'by_position', not 'by_name' (the one way "
                                        "torchrig keys them)"),
    ({"factories": {"model.factory": {"module": "m", "file": "f", "sha256": "x" * 64}}},
     "field 'factories.model.factory.sha256' is '" + "x" * 64 + "', not a sha256 (64 hexadecimal digits)"),
]


@pytest.mark.parametrize("fields, problem", BAD_FIELDS, ids=[str(i) for i in range(len(BAD_FIELDS))])
def test_each_used_field_is_held_to_its_rule(checkpoint, fields, problem):
    path = _forge(checkpoint, **fields)
    with pytest.raises(CheckpointError) as err:
        read_meta(checkpoint)
    assert str(err.value) == f"checkpoint file '{path}': {problem}; {OTHER}"


def test_a_forged_layout_is_refused_by_a_resume_not_printed(checkpoint, make_trainer, data, capsys):
    path = _forge(checkpoint, layout={"dp_replicate": 1, "dp_shard": -3, "tp": 1, "pp": 1, "world_size": 1})
    capsys.readouterr()
    with pytest.raises(CheckpointError) as err:
        make_trainer(resume="latest", epochs=2).fit(data)
    assert str(err.value).startswith(f"checkpoint file '{path}': field 'layout.dp_shard' is -3, not a number")
    assert "dp_shard=-3" not in "".join(capsys.readouterr())


def test_fields_no_load_uses_and_a_later_layout_key_are_left_alone(checkpoint):
    _forge(checkpoint, precision=["anything"], epoch="x",
           layout={"dp_replicate": 1, "dp_shard": 1, "tp": 1, "pp": 1, "world_size": 1, "ep": "later"})
    assert read_meta(checkpoint)["layout"]["ep"] == "later"


def test_a_deeply_nested_meta_json_is_named_not_state_pt(checkpoint):
    (checkpoint / "meta.json").write_text("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(checkpoint)
    assert str(err.value) == (f"'{checkpoint / 'meta.json'}' nests lists or mappings too deeply to be read: it is not "
                              f"the meta.json of a checkpoint torchrig wrote; {OTHER}")


def test_the_checkpoint_names_its_degrees_as_the_layout_does():
    from torchrig.checkpoint import meta as meta_fields
    from torchrig.parallel.mesh import DEGREES

    assert meta_fields.DEGREES == DEGREES


# ----------------------------------------------------------------------------- DCP's .metadata


def _sharded_checkpoint(folder: Path, model: nn.Module) -> Path:
    """A checkpoint folder with ``sharded/`` written by DCP in this one process, and meta.json's checksums."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import save_file

    (folder / "sharded").mkdir(parents=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one process saving without a process group: intended
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(folder / "sharded"))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "meta.json").write_text(json.dumps({"step": 1}))
    record_checksums(folder)
    return folder


def _move_piece(folder: Path, fqn: str, offsets: tuple, sizes: tuple) -> None:
    """Rewrite the one piece of ``fqn`` in ``.metadata`` (and its storage index) as a forger would, checksums fixed."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    path = folder / "sharded" / ".metadata"
    metadata = pickle.loads(path.read_bytes())
    item = metadata.state_dict_metadata[fqn]
    old = item.chunks[0].offsets
    item.chunks[0] = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
    metadata.storage_data = {(type(k)(k.fqn, torch.Size(offsets), k.index) if k.fqn == fqn and k.offset == old else k): v
                             for k, v in metadata.storage_data.items()}
    path.write_bytes(pickle.dumps(metadata))
    record_checksums(folder)


@pytest.mark.parametrize("offsets, sizes, problem", [
    ((10 ** 12, 0), (16, 8), "a piece at offsets (1000000000000, 0) of sizes (16, 8) lies outside its size (16, 8)"),
    ((0, 0), (8, 8), "part of it is in no piece"),
    ((0, 0), (16, 8, 1), "a piece torch.Size([0, 0]) / torch.Size([16, 8, 1]) is not offsets and sizes of a "
                         "2-dimensional tensor"),
], ids=["far-away", "gap", "wrong-rank"])
def test_a_piece_that_does_not_cover_its_parameter_is_refused(tmp_path, offsets, sizes, problem):
    torch.manual_seed(0)
    ckpt = _sharded_checkpoint(tmp_path / "ckpt", TinyNet())
    _move_piece(ckpt, "model.backbone.0.weight", offsets, sizes)
    torch.manual_seed(1)
    fresh = TinyNet()
    with pytest.raises(CheckpointError) as err:
        sharded.load(fresh, {}, ckpt)
    assert str(err.value) == (f"sharded checkpoint file '{ckpt / 'sharded' / '.metadata'}' does not describe "
                              f"'model.backbone.0.weight' whole: {problem}; use another checkpoint, or its "
                              f"model.safetensors for the weights alone")


def test_pieces_that_tile_a_parameter_exactly_load(tmp_path):
    torch.manual_seed(0)
    saved = TinyNet()
    ckpt = _sharded_checkpoint(tmp_path / "ckpt", saved)
    torch.manual_seed(1)
    fresh = TinyNet()
    sharded.load(fresh, {}, ckpt)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), saved.state_dict().values()))


def test_coverage_is_counted_on_the_grid_of_the_pieces():
    """Several pieces (rows of FSDP × columns of tensor parallelism): tiled, overlapping, with a hole."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorProperties, TensorStorageMetadata

    from torchrig.checkpoint.safe_dcp import _coverage_problem

    def problem(size, pieces):
        chunks = [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in pieces]
        return _coverage_problem(TensorStorageMetadata(TensorProperties(), torch.Size(size), chunks))

    grid = [((r, c), (8, 4)) for r in (0, 8, 16, 24) for c in (0, 4)]
    assert problem((32, 8), grid) == ""
    assert problem((32, 8), grid + [((4, 0), (8, 4))]) == "two pieces overlap (one at offsets (4, 0))"
    assert problem((32, 8), grid[1:]) == "part of it is in no piece"
    assert problem((), [((), ())]) == "" and problem((0, 3), []) == ""  # a scalar; a tensor of no elements
    assert problem((2 ** 40, 2 ** 40), [((0, 0), (1, 1))]) == "part of it is in no piece"  # counted, not allocated


def test_a_deeply_nested_index_is_rebuilt_from_the_checkpoints(checkpoint, run_dir):
    from torchrig.checkpoint import CheckpointManager

    (run_dir / "checkpoints" / "index.json").write_text("[" * 200_000 + "]" * 200_000)
    assert CheckpointManager(run_dir).index == {"checkpoints": [checkpoint.name], "best": []}
