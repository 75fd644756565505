"""The distributed set-up's pure parts, without processes: environment detection (torchrun, Slurm,
explicit init method), error messages, strategies and the launcher's translation to torchrun."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from torch import nn

from torchrig import config as C
from torchrig.cli import build_parser
from torchrig.cli import launch as L
from torchrig.parallel import resolve_strategy, wrap_model
from torchrig.runtime import RuntimeSetupError, dist as D

DIST_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_TASKS_PER_NODE",
             "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST",
             "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_STEPID",
             "TORCHELASTIC_RESTART_COUNT")


@pytest.fixture
def clean_env(monkeypatch):
    for var in DIST_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


# ----------------------------------------------------------------------------- detection

@pytest.mark.parametrize("nodelist, first", [
    ("node[03-05,07],gpu1", "node03"), ("gpu-a[1-2]", "gpu-a1"), ("tux[1-3]-ib,x9", "tux1-ib"),
    ("n1,n2", "n1"), ("single", "single"), ("c[009]", "c009"),
])
def test_first_slurm_host(nodelist, first):
    assert D.first_slurm_host(nodelist) == first


def test_single_process_by_default(clean_env):
    info = D.detect()
    assert (info.rank, info.world_size, info.source, info.is_distributed) == (0, 1, "single", False)


def test_torchrun_environment(clean_env):
    for k, v in dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4").items():
        clean_env.setenv(k, v)
    info = D.detect()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.source) == (3, 8, 1, 4, "torchrun")


def test_slurm_step_environment(clean_env):
    for k, v in dict(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_STEP_NUM_TASKS="8", SLURM_LOCALID="1",
                     SLURM_STEP_TASKS_PER_NODE="4(x2)", SLURM_JOB_NODELIST="gpu[07-08]",
                     SLURM_JOB_ID="123456").items():
        clean_env.setenv(k, v)
    info = D.detect()
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size, info.source) == (5, 8, 1, 4, "slurm")
    assert D.slurm_master() == ("gpu07", 20000 + 123456 % 10000)


def test_slurm_batch_script_outside_srun_is_single_process(clean_env):
    # an sbatch script with --ntasks=8 running plain `python train.py`: no srun step, one process
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="8", SLURM_LOCALID="0").items():
        clean_env.setenv(k, v)
    assert D.detect().world_size == 1
    clean_env.setenv("SLURM_STEP_ID", str(0xFFFFFFFE))  # the batch step
    assert D.detect().world_size == 1
    clean_env.setenv("SLURM_STEP_ID", "0")  # an srun step without SLURM_STEP_NUM_TASKS (old Slurm)
    assert D.detect().world_size == 8
    clean_env.setenv("SLURM_STEP_NUM_TASKS", "1")  # srun -n 1
    assert D.detect().world_size == 1


def test_torchrun_wins_over_slurm_and_explicit_wins_over_both(clean_env):
    for k, v in dict(SLURM_PROCID="1", SLURM_NTASKS="2", RANK="0", WORLD_SIZE="4").items():
        clean_env.setenv(k, v)
    assert D.detect().source == "torchrun"
    info = D.detect("tcp://10.0.0.1:23456", rank=2, world_size=3)
    assert (info.rank, info.world_size, info.source) == (2, 3, "init_method")


def test_explicit_init_method_needs_rank_and_world_size(clean_env):
    with pytest.raises(RuntimeSetupError, match="needs dist.rank and dist.world_size"):
        D.detect("file:///tmp/x")


def test_restart_count(clean_env):
    assert D.restart_count() == 0
    clean_env.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert D.restart_count() == 2


def test_main_process_before_the_process_group_exists(clean_env, capsys):
    from torchrig.recipes.common import say

    assert D.is_main_process()
    clean_env.setenv("RANK", "1")
    clean_env.setenv("WORLD_SIZE", "2")
    assert not D.is_main_process()
    say("reading the data")  # recipes print from rank 0 only, also before the Trainer exists
    assert capsys.readouterr().err == ""
    clean_env.setenv("RANK", "0")
    assert D.is_main_process()
    say("reading the data")
    assert capsys.readouterr().err == "reading the data\n"
    for k in ("RANK", "WORLD_SIZE"):
        clean_env.delenv(k)
    for k, v in dict(SLURM_PROCID="3", SLURM_STEP_NUM_TASKS="4", SLURM_LOCALID="3").items():
        clean_env.setenv(k, v)
    assert not D.is_main_process()


def test_helpers_are_no_ops_in_one_process():
    t = torch.tensor([1.0, 2.0])
    assert D.get_rank() == 0 and D.get_world_size() == 1 and D.is_main_process()
    assert torch.equal(D.all_reduce_sum(t), t) and torch.equal(D.all_reduce_max(t), t)
    assert torch.equal(D.all_reduce_mean(t), t)
    assert D.broadcast({"a": 1}) == {"a": 1} and D.gather(5) == [5]
    D.barrier()


# ----------------------------------------------------------------------------- error messages

def test_timeout_message_names_the_setting():
    exc = RuntimeError("[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms "
                       "for recv operation to complete")
    err = D.explain_collective_failure(exc, 5, rank=1)
    assert isinstance(err, RuntimeSetupError)
    text = str(err)
    assert text.startswith("rank 1: a collective operation")
    assert "dist.timeout=5s" in text and "raise dist.timeout" in text and "other ranks' logs" in text


def test_lost_peer_message_suggests_restarts():
    exc = RuntimeError("[gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:1234: Connection reset by peer")
    text = str(D.explain_collective_failure(exc, 1800, rank=0))
    assert "lost the connection to another rank" in text and "--max-restarts" in text


def test_unrelated_errors_are_left_alone():
    assert D.explain_collective_failure(RuntimeError("DataLoader worker timed out"), 5, 0) is None
    assert D.explain_collective_failure(ValueError("shape mismatch"), 5, 0) is None
    assert D.collective_error(RuntimeError("gloo timed out"), 5) is None  # no process group: nothing to explain


# ----------------------------------------------------------------------------- strategies

def test_resolve_strategy():
    cpu = torch.device("cpu")
    assert resolve_strategy("auto", 1, cpu) == "none"
    assert resolve_strategy("auto", 2, cpu) == "ddp"
    assert resolve_strategy("fsdp", 2, cpu) == "fsdp"
    with pytest.raises(RuntimeSetupError) as err:
        resolve_strategy("dp", 2, cpu)
    assert str(err.value) == "strategy 'dp' (nn.DataParallel) runs in one process; use strategy=ddp under torchrun"
    with pytest.raises(RuntimeSetupError) as err:
        resolve_strategy("horovod", 2, cpu)
    assert str(err.value) == "strategy 'horovod' is not one of auto, none, ddp, dp, fsdp"


DP_ADVICE = ("strategy=ddp under torchrig launch (one process per GPU) is the recommended path: nn.DataParallel "
             "runs in one process, copies the model to every GPU at each step and is slower than "
             "DistributedDataParallel even on one machine")


def _dp_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "strategy 'dp'" in str(w.message)]


def test_dp_without_two_gpus_trains_unwrapped_and_says_why(make_trainer, data):
    device = "cuda" if torch.cuda.device_count() == 1 else "cpu"
    found = torch.cuda.device_count() if device == "cuda" else 0
    with pytest.warns(UserWarning) as record:
        trainer = make_trainer(strategy="dp", device=device)
    where = "cuda:0" if device == "cuda" else "cpu"
    assert _dp_warnings(record) == [f"strategy 'dp' needs two or more visible GPUs, found {found}; running on "
                                    f"{where} without wrapping. {DP_ADVICE}"]
    assert trainer.strategy == "dp" and trainer.wrapped is trainer.model  # the model itself, not a wrapper
    trainer.fit(data)
    assert trainer.global_step == 5


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel needs two or more GPUs")
def test_dp_wraps_in_data_parallel_on_several_gpus(make_trainer, data):
    with pytest.warns(UserWarning) as record:
        trainer = make_trainer(strategy="dp", device="cuda")
    assert _dp_warnings(record) == [f"strategy 'dp': {DP_ADVICE}"]
    assert isinstance(trainer.wrapped, nn.DataParallel) and trainer.wrapped.module is trainer.model
    assert trainer.wrapped.device_ids == list(range(torch.cuda.device_count()))
    trainer.fit(data)
    assert trainer.global_step == 5


def test_sync_batchnorm_on_cpu_warns_instead_of_failing_later():
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    cfg = C.DistConfig(sync_batchnorm=True)
    with pytest.warns(UserWarning, match="sync_batchnorm=true is ignored on CPU"):
        with pytest.raises(RuntimeSetupError, match="needs a process group"):
            wrap_model(model, "ddp", torch.device("cpu"), cfg)
    assert isinstance(model[1], nn.BatchNorm1d)


@pytest.mark.gpu  # torch's SyncBatchNorm runs on GPUs only: no CPU stand-in (it refuses CPU input)
@pytest.mark.slow
def test_sync_batchnorm_on_two_ranks_of_one_gpu_equals_one_process_with_the_global_batch(tmp_path):
    """Two ranks share the one GPU over gloo (NCCL refuses two ranks on one device; torch's SyncBatchNorm
    all-gathers its statistics through gloo too). In a one-rank group SyncBatchNorm falls back to plain
    batch_norm, so two ranks are the least that tests it. 93 samples, batch 4 per rank: each rank normalises
    with the statistics of the global batch of 8 (3 + 2 in the short last one), so weights and running
    statistics equal one process's plain BatchNorm at batch 8 (rank-local statistics over 4 samples would be
    far off), and the checkpoint loads into the model with plain BatchNorm."""
    from helpers import dist_procs
    from helpers import dist_worker as W
    from torchrig import Trainer
    from torchrig.checkpoint import load_weights

    results = dist_procs.pair("syncbn_gpu", tmp_path, tmp_path / "init-store", timeout=300)
    for rank, r in enumerate(results):
        assert r.returncode == 0, f"rank {rank} failed:\n{r.output[-4000:]}"
    import json

    for rank in (0, 1):
        report = json.loads((tmp_path / f"syncbn-{rank}.json").read_text())
        assert report == {"layers": ["Linear", "SyncBatchNorm", "ReLU", "Linear"], "steps": 24, "backend": "gloo"}
    matmul, threads = torch.backends.cuda.matmul, torch.get_num_threads()
    before = (matmul.fp32_precision, torch.get_float32_matmul_precision())
    try:
        matmul.fp32_precision = "ieee"  # as in the workers: no TF32
        one = Trainer(W.batchnorm_model(), **W.settings(tmp_path / "one", strategy="none", batch_size=8,
                                                        device="cuda:0", metrics=[], threads=None))
        one.fit(W.train_data())
    finally:
        torch.set_float32_matmul_precision(before[1])
        matmul.fp32_precision = before[0]
        torch.set_num_threads(threads)
    want, got = W.params(one.model), torch.load(tmp_path / "syncbn.pt")
    assert want.keys() == got.keys() and "1.running_var" in got
    assert int(got["1.num_batches_tracked"]) == 24
    for k in want:
        torch.testing.assert_close(got[k].double(), want[k].double(), rtol=0, atol=1e-4, msg=k)
    plain = W.batchnorm_model()
    load_weights(plain, tmp_path / "syncbn" / "checkpoints" / "latest")  # plain BatchNorm1d takes it as it is
    assert torch.equal(plain[1].running_mean, got["1.running_mean"])


def test_ddp_and_fsdp_need_a_process_group():
    for strategy in ("ddp", "fsdp"):
        with pytest.raises(RuntimeSetupError) as err:
            wrap_model(nn.Linear(2, 2), strategy, torch.device("cpu"), C.DistConfig())
        assert str(err.value) == f"strategy '{strategy}' needs a process group; start with torchrig launch or torchrun"


# ----------------------------------------------------------------------------- torchrig launch -> torchrun

def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["launch", *argv])


def test_worker_command_forms(tmp_path, monkeypatch):
    script = tmp_path / "train_me.py"
    script.write_text("print('hi')\n")
    assert L.worker_command(["--", "train", "--set", "epochs=2"]) == ["-m", "torchrig", "train", "--set", "epochs=2"]
    assert L.worker_command(["torchrig", "evaluate", "--checkpoint", "x"])[:3] == ["-m", "torchrig", "evaluate"]
    assert L.worker_command([str(script), "--lr", "0.1"]) == [str(script), "--lr", "0.1"]
    assert L.worker_command(["python", str(script)]) == [str(script)]
    assert L.worker_command(["python3", "-m", "my.module", "x"]) == ["-m", "my.module", "x"]
    assert L.worker_command(["/bin/true"]) == ["--no-python", "/bin/true"]
    for argv, message in [
        (["--"], "nothing to launch: put the command after --, e.g. torchrig launch --nproc-per-node 2 -- train "
                 "--set epochs=3"),
        (["nope.py"], f"script 'nope.py' does not exist (the path is relative to {os.getcwd()})"),
        (["trian"], "'trian' is not a torchrig command (train, evaluate, predict, plot, doctor), a .py script or an "
                    "executable on PATH; did you mean 'train'?"),
    ]:
        with pytest.raises(L.LaunchError) as err:
            L.worker_command(argv)
        assert str(err.value) == message


@pytest.mark.parametrize("interfaces,loopback", [(["lo", "eth0"], "lo"), (["en0", "lo0"], "lo0"), (["eth0"], None)])
def test_single_machine_launch_listens_on_loopback(clean_env, interfaces, loopback):
    clean_env.delenv("GLOO_SOCKET_IFNAME", raising=False)
    clean_env.delenv("NCCL_SOCKET_IFNAME", raising=False)
    clean_env.setattr(L, "_interfaces", lambda: interfaces)
    argv, env = L.build(_args("--nproc-per-node", "2", "--max-restarts", "3", "--", "train"))
    assert argv[:4] == ["--nproc-per-node", "2", "--max-restarts", "3"]
    i = argv.index("--rdzv-backend")
    assert argv[i:i + 4] == ["--rdzv-backend", L.LOOPBACK_BACKEND, "--rdzv-endpoint", "127.0.0.1:0"]
    assert argv[-3:] == ["-m", "torchrig", "train"]
    # gloo / nccl on the loopback interface when the machine names one (Linux lo, macOS lo0)
    assert env == ({"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": loopback} if loopback else {})
    clean_env.setenv("GLOO_SOCKET_IFNAME", "eth0")  # the user's own setting is kept
    assert "GLOO_SOCKET_IFNAME" not in L.build(_args("--nproc-per-node", "2", "--", "train"))[1]
    argv, _ = L.build(_args("--master-port", "29999", "--", "train"))
    assert "127.0.0.1:29999" in argv


def test_two_machine_launch_is_torchruns_static_rendezvous(monkeypatch):
    monkeypatch.setattr(L, "_interfaces", lambda: ["lo", "ens5"])
    argv, env = L.build(_args("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--nproc-per-node",
                              "8", "--ifname", "ens5", "--", "train", "cfg.yaml"))
    joined = " ".join(argv)
    assert "--nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500" in joined
    assert "--rdzv-backend" not in argv  # torchrun's default: static
    assert env == {"GLOO_SOCKET_IFNAME": "ens5", "NCCL_SOCKET_IFNAME": "ens5"}


def test_elastic_rendezvous_passes_through():
    argv, _ = L.build(_args("--nnodes", "1:4", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                            "--rdzv-id", "job7", "--", "train"))
    joined = " ".join(argv)
    assert "--nnodes 1:4 --rdzv-backend c10d --rdzv-endpoint head:29400" in joined and "--rdzv-id job7" in joined
    assert "--rdzv-conf join_timeout=900 " in joined
    argv, _ = L.build(_args("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400",
                            "--rdzv-conf", "last_call_timeout=5,keep_alive_interval=2", "--", "train"))
    assert "--rdzv-conf join_timeout=900,last_call_timeout=5,keep_alive_interval=2 " in " ".join(argv)
    assert L.torchrun_args(argv).rdzv_conf == "join_timeout=900,last_call_timeout=5,keep_alive_interval=2"


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--", "train"],
     "--nnodes 2 needs --master-addr: the address of machine 0 (the one started with --node-rank 0), reachable "
     "from every machine"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "--", "train"],
     "--node-rank 2 is outside 0 … 1 for --nnodes 2"),
    (["--nnodes", "1:3", "--", "train"], "--nnodes 1:3 (elastic MIN:MAX) needs --rdzv-backend c10d and --rdzv-endpoint"),
    (["--nnodes", "x", "--", "train"], "--nnodes 'x' is not a number or MIN:MAX"),
    (["--rdzv-backend", "c10d", "--", "train"], "--rdzv-backend c10d needs --rdzv-endpoint HOST:PORT (on machine 0)"),
    (["--nproc-per-node", "0", "--", "train"], "--nproc-per-node '0': give a number >= 1, or gpu / cpu / auto"),
    (["--rdzv-conf", "last_call_timeout=5", "--", "train"],
     "--rdzv-conf 'last_call_timeout=5' is for an elastic rendezvous: add --rdzv-backend c10d and --rdzv-endpoint "
     "HOST:PORT"),
    (["--ifname", "definitely-not-an-if", "--", "train"],
     "--ifname 'definitely-not-an-if': no such network interface on this machine; it has lo, eth0 (see `ip -brief "
     "address`)"),
    (["--max-restarts", "-1", "--", "train"], "--max-restarts must be 0 or more"),
])
def test_launch_errors(argv, message, monkeypatch):
    monkeypatch.setattr(L, "_interfaces", lambda: ["lo", "eth0"])
    with pytest.raises(L.LaunchError) as err:
        L.build(_args(*argv))
    assert str(err.value) == message


def test_dry_run_prints_the_torchrun_command(capsys):
    assert L.cmd_launch(_args("--dry-run", "--nproc-per-node", "2", "--", "train")) == 0
    out = capsys.readouterr().out
    assert "-m torch.distributed.run --nproc-per-node 2" in out and out.rstrip().endswith("-m torchrig train")


def test_launch_help_lists_examples(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["launch", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "--max-restarts" in out and "--ifname" in out


@pytest.mark.parametrize("separator", [["--"], []])
def test_the_commands_arguments_reach_it_as_written(separator, tmp_path):
    """Options of the launched command that begin a torchrun / launch option (``--start`` of ``--start-method``,
    ``--max`` of ``--max-restarts``, ``--rdzv``, ``--nnodes`` itself) are the command's, with or without ``--``."""
    script = tmp_path / "job.py"
    script.write_text("")
    mine = ["--start", "3", "--max", "1", "--rdzv", "x", "--nnodes", "7", "--", "--log", "y"]
    for command in (["train", *mine], [str(script), *mine]):
        args = _args("--nproc-per-node", "2", "--max-restarts", "1", *separator, *command)
        assert args.command_args[len(separator):] == command and args.nnodes == "1" and args.start_method is None
        targs = L.torchrun_args(L.build(args)[0])
        assert (targs.nproc_per_node, targs.max_restarts, targs.nnodes, targs.start_method) == ("2", 1, "1", "spawn")
        assert [targs.training_script, *targs.training_script_args] == (
            ["torchrig", *command] if command[0] == "train" else command)


# ----------------------------------------------------------------------------- data from another rank

DECLARE = r"""
import sys, torch, torch.distributed as dist
rank, store, length = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
from torchrig import runtime
if rank == 1:  # another program's rank: it declares a length and sends nothing
    dist.send(torch.tensor([length], dtype=torch.int64), 0)
else:
    try:
        runtime.gather_to_first({"w": torch.ones(2)}, dist.group.WORLD)
    except Exception as exc:
        print(f"{type(exc).__name__}: {exc}")
dist.barrier()
dist.destroy_process_group()
"""


def test_a_length_no_rank_could_send_is_refused_before_it_is_allocated(tmp_path, length=1 << 40):
    """``gather_to_first`` allocates what another rank declares it sends: a length beyond this machine's memory
    (or negative) is no object of that rank's, only a buffer that would exhaust the memory. One line, at once."""
    from helpers import forkserver, subprocess_env

    procs = [forkserver.popen(["-c", DECLARE, str(rank), str(tmp_path / "store"), str(length)], env=subprocess_env(),
                              rlimits={"RLIMIT_DATA": (3 << 30, 3 << 30)}) for rank in (0, 1)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    memory = f"{D.device_memory(torch.device('cpu')) / (1 << 30):.3g} GiB"
    assert outs[0][0].strip() == (f"DistributedError: rank 0: rank 1 declared {length} bytes of data to send, more "
                                  f"than the {memory} of memory of this machine; ranks exchange only plain data of "
                                  f"their own that fits. Check that every rank runs your own program")


def test_what_a_rank_may_declare():
    cpu = torch.device("cpu")
    assert D.receivable(0, 1, cpu) == 0 and D.receivable(1 << 20, 1, cpu) == 1 << 20
    with pytest.raises(D.DistributedError, match=r"^rank 0: rank 3 declared -5 bytes of data to send, a negative "):
        D.receivable(-5, 3, cpu)
    half = D.device_memory(cpu) // 2 + 1  # fits once, not once per rank of an all-gather of two
    assert D.receivable(half, 1, cpu) == half
    with pytest.raises(D.DistributedError, match="more than the"):
        D.receivable(half, 1, cpu, copies=2)


def test_one_launcher_watch_per_process_however_many_fits(monkeypatch):
    """Under torchrun every fit starts the watch on its launcher; a second fit in the process (lr-find then fit, a
    notebook) starts no second thread, and outside torchrun none is started."""
    import threading

    def watching():
        return [t for t in threading.enumerate() if t.name == D.LAUNCHER_WATCH]

    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    D.end_with_launcher()
    assert watching() == []
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    D.end_with_launcher()
    D.end_with_launcher()
    assert len(watching()) == 1 and watching()[0].daemon
