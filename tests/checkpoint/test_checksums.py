"""Checksums: every checkpoint file's sha256 is recorded in meta.json as it is written, and a file whose
bytes no longer match is refused as corrupt, by name, whichever way it is read.

A real plain checkpoint (``torchrig train``, one process) and a real sharded one (``dist.strategy=fsdp``
in a one-rank gloo group, saved in the background) are built once; each case copies one and flips one
bit of one file.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import pytest
from helpers import drop_checksums, forkserver, subprocess_env

from torchrig.checkpoint import CheckpointError, CorruptCheckpointError, load_weights_file, read_checkpoint
from torchrig.cli import main

STEP = "step-00000002"
QUICK = ["epochs=1", "max_steps=2", "log.plot=false", "log.tensorboard=false", "log.progress=none"]
BUILD_SHARDED = r"""
import sys, tempfile
import torch.distributed as dist
from torchrig.cli import main
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
sys.exit(main(sys.argv[1:]))
"""


def _sets(*pairs: str) -> list[str]:
    return [arg for pair in pairs for arg in ("--set", pair)]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("checksums")
    assert main(["train", *_sets(*QUICK, f"run_dir={root / 'plain'}")]) == 0
    forkserver.run(["-c", BUILD_SHARDED, "train", *_sets(*QUICK, f"run_dir={root / 'sharded'}", "dist.strategy=fsdp")],
                   env=subprocess_env(), check=True, timeout=300)  # forked: its own process group, no interpreter start
    return root


@pytest.fixture
def run_copy(built, tmp_path):
    def copy(kind: str) -> Path:
        return Path(shutil.copytree(built / kind, tmp_path / "run", symlinks=True))
    return copy


def _corrupt(path: Path) -> str:
    return (f"checkpoint file '{path}' is corrupt: its bytes do not match the sha256 checksum recorded in meta.json "
            f"when it was saved; use another checkpoint (RUN_DIR/checkpoints/), or retrain")


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset // 8] ^= 1 << (offset % 8)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("kind", ["plain", "sharded"])
def test_every_file_has_the_checksum_of_its_bytes(built, kind):
    """Recorded at save (for the sharded run: in the background, DCP's files included), and right."""
    ckpt = built / kind / "checkpoints" / STEP
    sums = json.loads((ckpt / "meta.json").read_text())["checksums"]
    on_disk = {f.relative_to(ckpt).as_posix(): "sha256:" + hashlib.sha256(f.read_bytes()).hexdigest()
               for f in ckpt.rglob("*") if f.is_file() and f.name != "meta.json"}
    assert sums == on_disk
    expected = {"model.safetensors", "state.pt", "config.yaml"}
    if kind == "sharded":
        expected |= {"sharded/.metadata", "sharded/__0_0.distcp"}
    assert expected <= set(sums)


# Bit offsets in each file, drawn once with a fixed seed (a file's size is known only once it is built, so
# a fraction of it is drawn): the safetensors header and tensors, the zip's records and directory of state.pt.
FRACTIONS = [random.Random(21).random() for _ in range(20)]


@pytest.mark.parametrize("fraction", FRACTIONS, ids=[f"{f:.3f}" for f in FRACTIONS])
@pytest.mark.parametrize("name", ["model.safetensors", "state.pt"])
def test_every_single_bit_flip_is_refused(run_copy, name, fraction):
    ckpt = run_copy("plain") / "checkpoints" / STEP
    path = ckpt / name
    _flip(path, int(fraction * path.stat().st_size * 8))
    with pytest.raises(CorruptCheckpointError) as err:
        if name == "model.safetensors":
            load_weights_file(ckpt)  # what evaluate, predict, load_weights and resume_weights_only read
        else:
            read_checkpoint(ckpt)  # what a resume reads
    assert str(err.value) == _corrupt(path)


@pytest.mark.parametrize("name", ["config.yaml", "sharded/.metadata", "sharded/__0_0.distcp"])
def test_a_flipped_bit_in_the_other_files_is_refused_on_resume(run_copy, capsys, name):
    run = run_copy("sharded")
    path = run / "checkpoints" / STEP / name
    _flip(path, path.stat().st_size * 8 // 2)
    capsys.readouterr()
    assert main(["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", "resume=latest")]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"torchrig: error: {_corrupt(path)}"


def test_evaluate_refuses_a_flipped_bit_in_one_line(run_copy, capsys):
    ckpt = run_copy("plain") / "checkpoints" / STEP
    _flip(ckpt / "model.safetensors", 8 * 1000)
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(ckpt)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"torchrig: error: {_corrupt(ckpt / 'model.safetensors')}"]


def _unrecorded(ckpt: Path, why: str) -> str:
    return (f"checkpoint '{ckpt}' {why}; use another checkpoint (RUN_DIR/checkpoints/), or load it unchecked with "
            f"--set checkpoint.verify=false")


NO_RECORD = "records no checksums in its meta.json, so its files cannot be checked against the checksums recorded " \
            "when they were saved"


def test_a_checkpoint_without_its_checksums_is_refused_unless_verify_is_off(run_copy, capsys):
    """Saved before checksums were recorded, or its record stripped: loading it would check nothing, silently.
    Refused in one line; checkpoint.verify=false loads it, said on every load."""
    run = run_copy("plain")
    ckpt = run / "checkpoints" / STEP
    drop_checksums(ckpt)
    capsys.readouterr()
    assert main(["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", "resume=latest")]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"torchrig: error: {_unrecorded(ckpt, NO_RECORD)}"]
    with pytest.raises(CheckpointError, match="records no checksums in its meta.json"):
        load_weights_file(ckpt)
    state, meta, config = read_checkpoint(ckpt, verify=False)
    assert "checksums" not in meta and state["counters"]["global_step"] == 2
    import torch
    from safetensors.torch import load_file

    weights, saved = load_weights_file(ckpt, verify=False), load_file(ckpt / "model.safetensors")
    assert len(weights) > 0 and weights.keys() == saved.keys()  # unchecked, but the weights its file holds
    assert all(torch.equal(weights[k], saved[k]) for k in saved)
    assert main(["train", *_sets(*QUICK, "max_steps=3", f"run_dir={run}", "resume=latest",
                                 "checkpoint.verify=false")]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "checkpoint.verify" in line]
    assert said == [f"torchrig: checkpoint.verify=false: '{ckpt}' is loaded without checking its files against the "
                    f"checksums in its meta.json"]
    assert "checksums" in json.loads((run / "checkpoints" / "step-00000003" / "meta.json").read_text())


@pytest.mark.parametrize("damage", ["deleted", "not-a-mapping", "entry-missing", "not-a-checksum"])
def test_a_damaged_record_with_a_flipped_weight_is_refused_by_evaluate(run_copy, capsys, damage):
    """meta.json deleted (or its record damaged) and an exponent bit of a weight flipped: evaluate must refuse,
    not report the damaged model's accuracy with exit code 0."""
    ckpt = run_copy("plain") / "checkpoints" / STEP
    weights = ckpt / "model.safetensors"
    header = 8 + int.from_bytes(weights.read_bytes()[:8], "little")
    _flip(weights, (header + 3) * 8 + 6)  # the first weight's float32 exponent: x 2**(+-64)
    meta = json.loads((ckpt / "meta.json").read_text())
    why = {"deleted": "has no meta.json, so its files cannot be checked against the checksums recorded when they "
                      "were saved",
           "not-a-mapping": "has a damaged checksum record: meta.json's field 'checksums' is 'sha256:0', not a "
                            "mapping of the checkpoint's files to their sha256",
           "entry-missing": "records no checksum for its file 'model.safetensors' in its meta.json, so that file "
                            "cannot be checked",
           "not-a-checksum": "has a damaged checksum record: meta.json's field 'checksums.model.safetensors' is "
                             "'md5:1', not a checksum ('sha256:' and 64 hexadecimal digits)"}[damage]
    if damage == "deleted":
        (ckpt / "meta.json").unlink()
    else:
        sums = meta["checksums"]
        meta["checksums"] = {"not-a-mapping": "sha256:0", "entry-missing": {k: v for k, v in sums.items() if k !=
                                                                            "model.safetensors"},
                             "not-a-checksum": dict(sums, **{"model.safetensors": "md5:1"})}[damage]
        (ckpt / "meta.json").write_text(json.dumps(meta))
    capsys.readouterr()
    assert main(["evaluate", "--checkpoint", str(ckpt)]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [f"torchrig: error: {_unrecorded(ckpt, why)}"]


def test_a_plain_weights_file_outside_a_checkpoint_loads_without_a_record(built, tmp_path):
    """A user's own weights file (not in a checkpoint folder) has no record to check: it loads as it is."""
    mine = tmp_path / "mine" / "weights.safetensors"
    mine.parent.mkdir()
    shutil.copy(built / "plain" / "checkpoints" / STEP / "model.safetensors", mine)
    assert set(load_weights_file(mine)) == set(load_weights_file(built / "plain" / "checkpoints" / STEP))
    (mine.parent / "state.pt").write_bytes(b"")  # beside a checkpoint's file: a checkpoint, and without a record
    with pytest.raises(CheckpointError, match=r"has no meta.json, so its files cannot be checked"):
        load_weights_file(mine)


def test_a_bad_byte_anywhere_fails_no_other_way_first(run_copy):
    """The checksum is checked before the file is parsed: a damaged state.pt is reported as corrupt, never
    as unsafe (which a damaged pickle stream can look like) and never with a parser's raw error."""
    ckpt = run_copy("plain") / "checkpoints" / STEP
    data = bytearray((ckpt / "state.pt").read_bytes())
    data[len(data) // 3: len(data) // 3 + 64] = b"\x80" * 64
    (ckpt / "state.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(ckpt)
    assert type(err.value) is CorruptCheckpointError
