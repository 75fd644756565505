"""Capability 12 (and 10's plot): the ``torchrig`` command, in-process through ``torchrig.cli.main``."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess

import numpy as np
import pytest
import yaml
from helpers import drop_checksums, one_line_error, record_checksums, subprocess_env

from torchrig.cli import build_parser, main
from torchrig.cli.doctor import problems, report

QUICK = ["--set", "epochs=1", "--set", "log.plot=false", "--set", "log.tensorboard=false"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One epoch of the default digits job, shared by the evaluate / predict / plot tests."""
    run = tmp_path_factory.mktemp("cli") / "digits"
    assert main(["train", *QUICK, "--set", f"run_dir={run}", "--set", "log.every_steps=10"]) == 0
    return run




# ----------------------------------------------------------------------------- train


def test_train_writes_a_run(trained):
    run = trained
    assert (run / "checkpoints" / "latest" / "model.safetensors").exists()
    assert (run / "metrics.jsonl").exists()
    cfg = yaml.safe_load((run / "checkpoints" / "latest" / "config.yaml").read_text())
    assert cfg["recipe"] == "digits" and cfg["epochs"] == 1 and cfg["run_dir"] == str(run)


def test_train_output(tmp_path, capsys):
    run = tmp_path / "r"
    assert main(["train", *QUICK, "--set", f"run_dir={run}", "--set", "max_steps=3",
                 "--set", "log.progress=lines", "--set", "log.every_steps=1"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("test: loss ") and " accuracy " in out
    assert f"checkpoints: {run / 'checkpoints'} (latest -> step-00000003)" in out
    assert f"logs:        {run / 'metrics.jsonl'}" in out
    assert "epoch 1/1 · step 1 · batch 1/" in err


def test_train_yaml_file_and_overrides(tmp_path, capsys):
    config = tmp_path / "exp.yaml"
    config.write_text(f"run_dir: {tmp_path / 'from_yaml'}\nmax_steps: 2\noptim:\n  name: sgd\n  lr: 0.05\n"
                      "log:\n  plot: false\n  tensorboard: false\n")
    assert main(["train", str(config), "--set", "optim.lr=0.01", "--set", "accumulate=2"]) == 0
    saved = yaml.safe_load((tmp_path / "from_yaml" / "checkpoints" / "latest" / "config.yaml").read_text())
    assert (saved["optim"]["name"], saved["optim"]["lr"], saved["accumulate"], saved["max_steps"]) == \
        ("sgd", 0.01, 2, 2)
    assert saved["epochs"] == 15  # the recipe's default, under the file and the overrides


@pytest.mark.parametrize("argv,fragments", [
    (["train", "--set", "epochs=abc"], ["config key 'epochs': expected an integer >= 1, got 'abc'"]),
    (["train", "--set", "optim.lrr=1"], ["unknown config key 'optim.lrr'; did you mean 'optim.lr'?"]),
    (["train", "--set", "epochs"], ["override 'epochs' is not KEY=VALUE"]),
    (["train", "missing.yaml"], ["config file 'missing.yaml' does not exist"]),
    (["train", "--recipe", "digitz"], ["unknown recipe 'digitz'; did you mean 'digits'? Valid recipes: custom, digits, "]),
    (["train", "--set", "optim.name=adamx", "--set", "epochs=1"],
     ["unknown optimizer 'adamx'; did you mean 'adam'? Valid names: sgd, adam, adamw, adagrad, rmsprop"]),
    (["train", "--set", "precision=fp16", "--set", "device=cpu"],
     ["precision 'fp16' needs a CUDA device (it uses a gradient scaler), but the device is cpu; use precision=bf16 "
      "on CPU or fp32"]),
    (["evaluate", "--checkpoint", "/nonexistent/run"], ["checkpoint '/nonexistent/run' does not exist"]),
    (["plot", "/nonexistent/run"], ["run directory '/nonexistent/run' does not exist"]),
])
def test_errors_are_one_line(argv, fragments, capsys):
    one_line_error(capsys, argv, *fragments)


def test_bad_yaml_and_directory_config(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("epochs: [1\n")
    one_line_error(capsys, ["train", str(bad)], f"config file '{bad}' is not valid YAML at line")
    one_line_error(capsys, ["train", str(tmp_path)], "is a directory; pass a YAML file")


def test_bad_thread_env_on_the_command_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TORCH_THREAD_NUM", "lots")
    one_line_error(capsys, ["train", *QUICK, "--set", f"run_dir={tmp_path}"], "TORCH_THREAD_NUM='lots' is not an integer")


def test_debug_shows_the_traceback(capsys):
    from torchrig.observe.plot import PlotError

    for argv in (["--debug", "plot", "/nonexistent"], ["plot", "/nonexistent", "--debug"]):
        with pytest.raises(PlotError, match="run directory '/nonexistent' does not exist"):
            main(argv)


def test_unexpected_errors_name_their_type(monkeypatch, capsys):
    import torchrig.cli as cli

    def boom(args):
        raise KeyError("oops")

    monkeypatch.setitem(cli.COMMANDS, "doctor", boom)
    line = one_line_error(capsys, ["doctor"], "KeyError: 'oops'", "(run with --debug for the traceback)")
    assert line == "torchrig: error: KeyError: 'oops' (run with --debug for the traceback)"


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["evaluate"])
    assert exit_.value.code == 2
    assert "the following arguments are required: --checkpoint" in capsys.readouterr().err


# ----------------------------------------------------------------------------- help


def _commands() -> list[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return sorted(sub.choices)


def test_every_command_has_help(capsys):
    commands = _commands()
    assert {"train", "evaluate", "predict", "plot", "doctor"} <= set(commands)
    for cmd in commands:
        with pytest.raises(SystemExit) as exit_:
            main([cmd, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: torchrig {cmd}") and "--debug" in out
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert all(cmd in out for cmd in ("train", "evaluate", "predict", "plot", "doctor"))


# ----------------------------------------------------------------------------- evaluate


def test_evaluate_json_prints_exactly_one_object(trained, capsys):
    assert main(["evaluate", "--checkpoint", str(trained), "--json"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip().splitlines()) == 1
    results = json.loads(out)
    assert set(results) == {"loss", "accuracy", "top5", "f1"}
    assert results["accuracy"] > 0.8  # one epoch


def test_evaluate_plain_and_other_forms(trained, capsys):
    latest = trained / "checkpoints" / "latest"
    assert main(["evaluate", "--checkpoint", str(latest), "--split", "val"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["loss", "accuracy", "top5", "f1"]
    one_line_error(capsys, ["evaluate", "--checkpoint", str(trained), "--split", "train2"],
                    "recipe 'digits' has no 'train2' split; choose one of train, val, test")


def test_evaluate_checkpoint_from_another_setup(trained, tmp_path, capsys):
    """A checkpoint written by a DDP run in fp16 on a GPU machine evaluates in one CPU process."""
    ckpt = tmp_path / "copy"
    shutil.copytree(trained / "checkpoints" / "latest", ckpt)
    cfg = yaml.safe_load((ckpt / "config.yaml").read_text())
    cfg["dist"]["strategy"], cfg["device"], cfg["precision"] = "ddp", "cuda", "fp16"
    (ckpt / "config.yaml").write_text(yaml.safe_dump(cfg))
    record_checksums(ckpt)
    assert main(["evaluate", "--checkpoint", str(ckpt), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["accuracy"] > 0.8


def test_evaluate_corrupt_checkpoint(trained, tmp_path, capsys):
    ckpt = tmp_path / "corrupt"
    shutil.copytree(trained / "checkpoints" / "latest", ckpt)
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 10)
    one_line_error(capsys, ["evaluate", "--checkpoint", str(ckpt)], "model.safetensors' is corrupt: its bytes do "
                   "not match the sha256 checksum recorded in meta.json")
    drop_checksums(ckpt)  # as saved before checksums: refused, unless loaded unchecked
    one_line_error(capsys, ["evaluate", "--checkpoint", str(ckpt)], "records no checksums in its meta.json")
    unchecked = ["--set", "checkpoint.verify=false"]  # then safetensors itself finds it out
    assert main(["evaluate", "--checkpoint", str(ckpt), *unchecked]) == 1
    said = capsys.readouterr().err.strip().splitlines()
    assert said[0].startswith("torchrig: checkpoint.verify=false: ") and len(said) == 2, said
    assert said[1].startswith(f"torchrig: error: weights file '{ckpt / 'model.safetensors'}' is corrupt or not a "
                              f"safetensors file"), said
    (ckpt / "config.yaml").unlink()
    assert main(["evaluate", "--checkpoint", str(ckpt), *unchecked]) == 1
    assert capsys.readouterr().err.strip().splitlines()[1:] == [
        f"torchrig: error: checkpoint '{ckpt}' has no config.yaml; it was not written by torchrig train"]


# ----------------------------------------------------------------------------- predict


def _digits(n):
    from sklearn.datasets import load_digits

    d = load_digits()
    return (d.images[:n] / 16).astype(np.float32), d.target[:n]


def test_predict_npy_to_csv(trained, tmp_path, capsys):
    images, labels = _digits(20)
    np.save(tmp_path / "x.npy", images)
    out = tmp_path / "preds" / "out.csv"
    assert main(["predict", "--checkpoint", str(trained), "--input", str(tmp_path / "x.npy"),
                 "--output", str(out), "--topk", "3"]) == 0
    assert f"predictions written to {out}" in capsys.readouterr().out
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == 20 and rows[0]["input"] == "x.npy[0]"
    assert set(rows[0]) == {"input", "prediction", "probability", "top1", "top2", "top3", "top1_probability",
                            "top2_probability", "top3_probability"}
    correct = sum(int(r["prediction"]) == int(y) for r, y in zip(rows, labels))
    assert correct >= 16
    for r in rows:  # the prediction is the top-1 class; the top-k probabilities are sorted and sum to at most 1
        assert (r["prediction"], r["probability"]) == (r["top1"], r["top1_probability"])
        top = [float(r[f"top{k}_probability"]) for k in (1, 2, 3)]
        assert top == sorted(top, reverse=True) and sum(top) <= 1 + 1e-4


def test_predict_csv_rows_to_json(trained, tmp_path, capsys):
    images, _ = _digits(3)
    np.savetxt(tmp_path / "x.csv", images.reshape(3, 64), delimiter=",")
    out = tmp_path / "out.json"
    assert main(["predict", "--checkpoint", str(trained), "--input", str(tmp_path / "x.csv"),
                 "--output", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == 3 and len(rows[0]["top"]) == 5


def test_predict_reads_the_class_folders_of_export_digits(trained, tmp_path, capsys):
    """`torchrig data export-digits DIR` writes DIR/test/<class>/*.png; predict reads such a tree whole."""
    assert main(["data", "export-digits", str(tmp_path / "png")]) == 0
    test = tmp_path / "png" / "test"
    files = sorted(p for p in test.rglob("*.png"))
    out = tmp_path / "out.csv"
    assert main(["predict", "--checkpoint", str(trained), "--input", str(test), "--output", str(out)]) == 0
    rows = list(csv.DictReader(out.open()))
    assert len(rows) == len(files) > 100
    assert sorted(r["input"] for r in rows) == sorted(f.relative_to(test).as_posix() for f in files)
    correct = sum(int(r["prediction"]) == int(r["input"].split("/")[0]) for r in rows)  # the class folder
    assert correct >= 0.9 * len(rows)


@pytest.mark.parametrize("content,fragment", [
    (None, "torchrig: error: input '{path}' does not exist"),
    (np.zeros((3, 5), np.float32), "input '{path}' has shape (3, 5); expected (N, 8, 8) or (N, 64) values in [0, 1]"),
    (b"not an array", "input '{path}' is not a readable .npy array ("),
    (np.full((2, 64), 16.0, np.float32), "input '{path}' holds values in [16, 16]; the digits model takes values in "
                                         "[0, 1]; scikit-learn's load_digits gives 0-16: divide by 16"),
    (np.full((2, 8, 8), -3.0, np.float32), "input '{path}' holds values in [-3, -3]; the digits model takes values "
                                           "in [0, 1]"),
])
def test_predict_bad_input(trained, tmp_path, capsys, content, fragment):
    path = tmp_path / "in.npy"
    if isinstance(content, np.ndarray):
        np.save(path, content)
    elif content is not None:
        path.write_bytes(content)
    one_line_error(capsys, ["predict", "--checkpoint", str(trained), "--input", str(path),
                             "--output", str(tmp_path / "o.csv")], fragment.format(path=path))
    assert not (tmp_path / "o.csv").exists()


# ----------------------------------------------------------------------------- plot and doctor


def test_plot_writes_pngs(trained, tmp_path, capsys):
    out = tmp_path / "plots"
    assert main(["plot", str(trained), "--out", str(out)]) == 0
    assert capsys.readouterr().out.split() == [str(out / "curves.png")]
    assert (out / "curves.png").read_bytes().startswith(b"\x89PNG")
    assert main(["plot", str(trained), str(trained), "--out", str(tmp_path / "both.png")]) == 0  # overlaid
    assert (tmp_path / "both.png").read_bytes().startswith(b"\x89PNG")


def test_plot_bad_run_dirs(tmp_path, capsys):
    one_line_error(capsys, ["plot", str(tmp_path)], f"'{tmp_path / 'metrics.jsonl'}' does not exist; is "
                                                     f"'{tmp_path}' a torchrig run directory?")
    (tmp_path / "metrics.jsonl").write_text("\n")
    one_line_error(capsys, ["plot", str(tmp_path)], "holds no records yet")
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train/loss": 1.0, "lr": 0.1}\n{"step": 2, "train/lo')
    assert main(["plot", str(tmp_path)]) == 0  # a line cut by a killed process is skipped


def test_doctor_report(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for key in ("python", "torch", "cuda", "cudnn", "nccl", "distributed", "devices", "threads", "packages",
                "problems"):
        assert any(line.startswith(key) for line in out.splitlines()), key
    assert "backends built: gloo True" in out and "intra-op" in out and "inter-op" in out
    import torch
    import torch.distributed as dist

    nccl = next(line for line in out.splitlines() if line.startswith("nccl"))
    if not dist.is_nccl_available():  # the report never contradicts itself about NCCL
        assert nccl == "nccl         not built into this torch" and "nccl False" in out
    else:
        usable = "usable" if torch.cuda.is_available() else "not usable here (no CUDA device)"
        assert nccl.startswith("nccl         built") and nccl.endswith(usable) and "nccl True" in out


def test_doctor_explains_known_problems(monkeypatch):
    import torch

    import torchrig.cli.doctor as doctor

    real = doctor._version
    monkeypatch.setattr(doctor, "_version", lambda pkg: "0.11.0" if pkg == "torchvision" else real(pkg))
    monkeypatch.setitem(doctor.TORCHVISION_FOR_TORCH, doctor._minor(torch.__version__), 99)  # whatever torch this is
    monkeypatch.setenv("TORCH_THREAD_NUM", "four")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchif0")
    found = problems()
    text = "\n".join(found)
    assert f"torchvision 0.11.0 does not match torch {torch.__version__} (expects 0.99.x): importing torchvision " \
           f"may fail with 'operator torchvision::nms does not exist'; install the matching pair, e.g. pip install " \
           f"torchvision==0.99.*" in found
    assert "TORCH_THREAD_NUM='four' is not an integer" in text
    assert "GLOO_SOCKET_IFNAME=nosuchif0 names no network interface" in text
    assert f"problems     {len(found)}:" in report()


# ----------------------------------------------------------------------------- the real console script


@pytest.mark.slow
def test_console_script_evaluate_json(trained):
    exe = shutil.which("torchrig")
    if exe is None:
        pytest.skip("the torchrig console script is not installed (pip install -e .)")
    out = subprocess.run([exe, "evaluate", "--checkpoint", str(trained), "--json"], capture_output=True, text=True,
                         env=subprocess_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1
    assert set(json.loads(out.stdout)) == {"loss", "accuracy", "top5", "f1"}


@pytest.mark.parametrize("args", [["doctor"], ["--help"], ["train", "--help"]])
def test_output_into_a_closed_pipe_ends_quietly(args):
    """``torchrig doctor | head -1``: the reader is gone before torchrig writes; no BrokenPipeError."""
    import os
    import subprocess
    import sys

    read_end, write_end = os.pipe()
    os.close(read_end)  # every write to write_end now fails with EPIPE
    try:
        done = subprocess.run([sys.executable, "-m", "torchrig.cli", *args], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, env=subprocess_env(), timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
