"""Worker processes for the distributed tests (run by torchrig launch or started in pairs by pytest).

    python tests/helpers/dist_worker.py equiv  OUT     # file:// pair: DDP, DDP+accumulation, FSDP fits; evaluate; predict
    python tests/helpers/dist_worker.py resume OUT     # file:// pair: DDP fit, rank 1 SIGKILLs itself at KILL_AT_STEP
    python tests/helpers/dist_worker.py features OUT   # file:// pair: DDP options, gradient syncs, metrics, SyncBatchNorm on CPU
    python tests/helpers/dist_worker.py trackers OUT   # file:// pair: a CSV tracker, FLOP counting, the profiler
    python tests/helpers/dist_worker.py ema    OUT     # file:// pair: DDP and FSDP2 fits with an EMA of the weights, resumed
    python tests/helpers/dist_worker.py worlds OUT     # file:// pair: logged train values; resumes across world sizes
    python tests/helpers/dist_worker.py float8 OUT     # file:// pair: FSDP2 float8 fits (float8 all-gather), cut and resumed
    python tests/helpers/dist_worker.py syncbn_gpu OUT # file:// pair on one GPU (gloo): SyncBatchNorm's global statistics
    python tests/helpers/dist_worker.py fit    OUT     # under torchrig launch: the DDP run of equiv, from torchrun's env
    python tests/helpers/dist_worker.py cli    ARGS…   # under torchrig launch: torchrig's own command line in this process

Pairs started by pytest get ``TEST_INIT`` (a ``file://`` URL), ``TEST_RANK`` and ``TEST_WORLD``; under
torchrig launch the torchrun environment is used. Hooks for faults, read from the environment:
``KILL_AT_STEP`` (rank 1 SIGKILLs itself before that optimizer step, only in the first attempt of an
elastic run) and ``HANG_AT_STEP`` (rank 1 stops taking part: it sleeps for ``HANG_SECONDS``).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

SEED = 0
N_TRAIN, N_EVAL, FEATURES, CLASSES = 93, 37, 16, 4  # 93: the last global batch of 8 is short (5 = 3 + 2)
QUIET = {"log.progress": "none", "log.tensorboard": False, "log.plot": False}


def make_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, CLASSES))


def make_data(n: int, seed: int):
    w = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))  # one labelling rule
    x = torch.randn(n, FEATURES, generator=torch.Generator().manual_seed(seed))
    return x, (x @ w).argmax(dim=1)


def train_data():
    return make_data(N_TRAIN, 1)


def eval_data():
    return make_data(N_EVAL, 2)


def settings(run_dir: Path, **extra) -> dict:
    """Trainer keywords shared by the distributed runs and the single-process references."""
    kw = dict(optimizer="sgd", lr=0.05, momentum=0.9, epochs=2, batch_size=4, seed=SEED, run_dir=str(run_dir),
              metrics=["accuracy"], threads=1, **QUIET)
    kw.update({"checkpoint.every_epochs": 0, "checkpoint.save_final": True, "log.every_steps": 5})
    kw.update(extra)
    return kw


def params(model: nn.Module) -> dict:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return {k: v.detach().cpu().clone() for k, v in out.items()}


def fault_step(step, batch):
    """default_step with the test's faults: SIGKILL or a hang on rank 1 before optimizer step N."""
    import torch.distributed as dist

    from torchrig.trainer.step import default_step

    rank = dist.get_rank() if dist.is_initialized() else 0
    upcoming = step.global_step + 1
    kill = int(os.environ.get("KILL_AT_STEP", "0"))
    if kill and rank == 1 and upcoming == kill and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0:
        Path(os.environ["FAULT_MARK"]).write_text(f"killed before step {upcoming}\n") if "FAULT_MARK" in os.environ else None
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0 and upcoming == 2 and "LISTEN_REPORT" in os.environ:
        report_listeners()
    hang = int(os.environ.get("HANG_AT_STEP", "0"))
    if hang and rank == 1 and upcoming == hang:
        if "FAULT_MARK" in os.environ:
            Path(os.environ["FAULT_MARK"]).write_text(f"{time.time()}\n")
        time.sleep(float(os.environ.get("HANG_SECONDS", "300")))
    return default_step(step, batch)


def listening_sockets(pids: list[int]) -> list[str]:
    """``address:port`` of every TCP socket in LISTEN state owned by ``pids`` (from /proc)."""
    inodes = set()
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
        except OSError:
            continue
    out = []
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hexaddr, hexport = f[1].split(":")
            raw = bytes.fromhex(hexaddr)
            if width == 8:
                addr = ".".join(str(b) for b in raw[::-1])
            else:
                words = [raw[i:i + 4][::-1] for i in range(0, 16, 4)]
                addr = ":".join(b.hex() for b in words)
            out.append(f"{addr}:{int(hexport, 16)}")
    return out


def report_listeners() -> None:
    """Rank 0 writes the listening sockets of the launcher and all its workers to LISTEN_REPORT."""
    parent = os.getppid()
    pids = [parent]
    for task in Path(f"/proc/{parent}/task").iterdir():
        try:
            pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    Path(os.environ["LISTEN_REPORT"]).write_text("\n".join(listening_sockets(pids)) + "\n")


def _pair_kwargs() -> dict:
    return {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
            "world_size": int(os.environ["TEST_WORLD"]), "dist_timeout": float(os.environ.get("TEST_TIMEOUT", 60))}


def equiv(out: Path) -> None:
    from torchrig import Trainer

    x, y = train_data()
    first = None
    results: dict = {}
    runs = {"ddp": dict(strategy="ddp"), "ddp_acc": dict(strategy="ddp", batch_size=2, accumulate=2),
            "fsdp": dict(strategy="fsdp", **{"dist.fsdp_min_params": 500, "checkpoint.every_epochs": 1}),
            "fsdp_clip": dict(strategy="fsdp", clip_grad_norm=0.5, **{"dist.fsdp_wrap": ["Linear"]}),
            "fsdp_bf16": dict(strategy="fsdp", precision="bf16", epochs=1, **{"dist.fsdp_cpu_offload": True})}
    for name, extra in runs.items():
        t = Trainer(make_model(), **settings(out / name, **extra), **_pair_kwargs())
        first = first or t
        t.fit((x, y))
        p = params(t.model)
        if name in ("ddp", "fsdp"):  # distributed evaluation and prediction of an odd-size set
            ex, ey = eval_data()
            ev = t.evaluate((ex, ey))
            t.cfg.data.eval_batch_size = 3  # 19 and 18 samples: 7 and 6 batches on ranks 0 and 1
            results[name] = {"eval": ev, "eval3": t.evaluate((ex, ey))}
            pred = t.predict(ex)
            if t.rank == 0:
                torch.save(pred, out / f"pred_{name}.pt")
        if t.rank == 0:
            torch.save(p, out / f"{name}.pt")
            print(f"{name}: {t.strategy}, world {t.world_size}, global step {t.global_step}", flush=True)
    if first.rank == 0:
        (out / "eval.json").write_text(json.dumps(results))
    first.close()


def resume(out: Path) -> None:
    import torch.distributed as dist

    from torchrig import Trainer

    x, y = train_data()
    extra = {"checkpoint.every_steps": 5}
    if os.environ.get("RESUME"):
        extra["resume"] = "latest"
    run = out / "run"
    if os.environ.get("RANK1_RUN_DIR") and int(os.environ["TEST_RANK"]) == 1:
        run = Path(os.environ["RANK1_RUN_DIR"])  # as if rank 1 were on a machine without the shared run_dir
    t = Trainer(make_model(), step_fn=fault_step, **settings(run, strategy="ddp", **extra), **_pair_kwargs())
    try:
        t.fit((x, y))
    except Exception as exc:
        print(f"rank {t.rank}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        t.close()
        print(f"group initialized after close: {dist.is_initialized()}", file=sys.stderr, flush=True)
        sys.exit(3)
    if t.rank == 0:
        torch.save(params(t.model), out / "resumed.pt")
        print(f"resumed from {getattr(t, 'resumed_from', None)} at step {t.global_step}", flush=True)
    t.close()


class UnusedBranch(nn.Module):
    """A model with a parameter no forward uses: DDP needs find_unused_parameters=True for it."""

    def __init__(self):
        super().__init__()
        self.body = make_model()
        self.unused = nn.Linear(FEATURES, CLASSES)

    def forward(self, x):
        return self.body(x)


def _ddp_options(out: Path) -> dict:
    """What the dist.* keys set on the DistributedDataParallel objects, and that the run trains with them."""
    from torchrig import Trainer

    x, y = train_data()
    t = Trainer(UnusedBranch(), **settings(out / "unused", strategy="ddp", max_steps=3, find_unused_parameters=True,
                                           bucket_cap_mb=1, **{"dist.gradient_as_bucket_view": False}),
                **_pair_kwargs())
    ddp = t.wrapped
    found = {"find_unused_parameters": ddp.find_unused_parameters, "static_graph": ddp.static_graph,
             "bucket_bytes_cap": ddp.bucket_bytes_cap, "gradient_as_bucket_view": ddp.gradient_as_bucket_view}
    t.fit((x, y))  # without find_unused_parameters the second step fails in DDP's reducer
    found["unused_steps"] = t.global_step
    t = Trainer(make_model(), **settings(out / "static", strategy="ddp", max_steps=3, static_graph=True),
                **_pair_kwargs())
    t.fit((x, y))
    found.update(static_graph_set=t.wrapped.static_graph, static_steps=t.global_step,
                 defaults_view=t.wrapped.gradient_as_bucket_view, defaults_unused=t.wrapped.find_unused_parameters)
    return found


def _two_networks_step(step, batch):
    """A custom step through two networks, each wrapped in its own DDP (as a GAN's are)."""
    x, y = batch
    with step.autocast():
        loss = nn.functional.cross_entropy(step.models["b"](step.models["a"](x)), y)
    step.backward(loss)
    step.optimizer_step("a")
    step.optimizer_step("b")
    return {"loss": loss.detach()}


def _gradient_syncs(out: Path) -> dict:
    """(bucket, micro-batch) of every gradient all-reduce, counted by a DDP communication hook, with
    accumulate=3 over 7 micro-batches per rank: windows of 3, 3 and 1."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from torchrig import Trainer

    x, y = train_data()
    x, y = x[:28], y[:28]  # 14 samples per rank, batch 2: 7 micro-batches
    runs = {"one": (make_model(), {}),
            "two": (nn.ModuleDict({"a": nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh()), "b": nn.Linear(32, CLASSES)}),
                    {"step_fn": _two_networks_step, "optimizer": {"a": "sgd", "b": "sgd"}})}
    seen: dict = {}
    for name, (model, extra) in runs.items():
        t = Trainer(model, **settings(out / f"sync-{name}", strategy="ddp", batch_size=2, accumulate=3, epochs=1,
                                      **extra), **_pair_kwargs())
        wrappers = t.models if t.models else {"model": t.wrapped}
        for key, ddp in wrappers.items():
            calls = seen.setdefault(f"{name}/{key}", [])

            def hook(state, bucket, calls=calls, t=t):
                calls.append([bucket.index(), t.step.batch_index])
                return default_hooks.allreduce_hook(None, bucket)

            ddp.register_comm_hook(None, hook)
        t.fit((x, y))
        seen[f"{name}/steps"] = t.global_step
    return seen


def _metrics_over_ranks(out: Path) -> dict:
    """Evaluation metrics of an odd-size set split 19 / 18 between the ranks (rank 0 also saves the outputs
    of one plain forward over all of it, for the test to recompute every metric)."""
    from torchrig import Trainer

    ex, ey = eval_data()
    rule = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(99))  # make_data's labelling
    model = nn.Linear(FEATURES, CLASSES)
    with torch.no_grad():  # the rule plus noise: mostly right, with errors in every class
        model.weight.copy_(rule.T + 1.2 * torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(5)))
        model.bias.zero_()
    names = ["accuracy", "top2", "precision", "recall", "f1", "precision_weighted", "recall_weighted", "f1_weighted"]
    t = Trainer(model, **settings(out / "metrics", strategy="ddp", metrics=names, eval_batch_size=5), **_pair_kwargs())
    results = t.evaluate((ex, ey))
    if t.rank == 0:
        with torch.no_grad():
            torch.save({"logits": model(ex), "target": ey}, out / "metrics-outputs.pt")
    return results


def _sync_batchnorm_on_cpu(out: Path) -> dict:
    import warnings

    from torchrig import Trainer

    x, y = train_data()
    model = nn.Sequential(nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, CLASSES))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = Trainer(model, **settings(out / "syncbn", strategy="ddp", max_steps=2, sync_batchnorm=True), **_pair_kwargs())
    t.fit((x, y))  # torch's SyncBatchNorm would raise on the first CPU forward
    return {"warnings": [str(w.message) for w in caught if "sync_batchnorm" in str(w.message)],
            "norm": type(t.wrapped.module[1]).__name__, "steps": t.global_step}


def features(out: Path) -> None:
    import torch.distributed as dist

    from torchrig import runtime

    report = {"ddp_options": _ddp_options(out), "gradient_syncs": _gradient_syncs(out),
              "metrics": _metrics_over_ranks(out), "sync_batchnorm": _sync_batchnorm_on_cpu(out)}
    (out / f"features-{dist.get_rank()}.json").write_text(json.dumps(report))
    runtime.destroy_process_group()  # torchrig's: collects DDP wrappers in cycles, gives gloo's threads a moment


def dropout_model() -> nn.Module:
    """make_model with a dropout: what a resume restores includes every rank's random streams."""
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 32), nn.Tanh(), nn.Dropout(0.3), nn.Linear(32, CLASSES))


def recording_step(rows: list):
    """default_step that appends ``[epoch, optimizer step, first features of the batch's samples]`` per micro-batch
    (feature 0 of train_data() tells the samples apart), fillers (weight 0) left out."""
    from torchrig.trainer.step import default_step

    def step_fn(step, batch):
        if step.weight:
            rows.append([step.epoch, step.global_step + 1, batch[0][:, 0].tolist()])
        return default_step(step, batch)

    return step_fn


def worlds(out: Path) -> None:
    """(1) a DDP fit logging every 4 steps, so rank 0's metrics.jsonl holds train/loss and train/accuracy to
    compare with one process; (2) a DDP fit stopped by max_steps in epoch 2, whose checkpoint the test resumes in
    one process; (3) the test's one-process checkpoint (``ONE_RUN``, stopped in epoch 2) resumed on two ranks,
    recording the samples each rank trains on from there."""
    import torch.distributed as dist

    from torchrig import Trainer, runtime

    x, y = train_data()
    logged = Trainer(make_model(), **settings(out / "logged", strategy="ddp", **{"log.every_steps": 4}),
                     **_pair_kwargs())
    logged.fit((x, y))
    cut = Trainer(dropout_model(), **settings(out / "cut", strategy="ddp", max_steps=14), **_pair_kwargs())
    cut.fit((x, y))
    rows: list = []
    on = Trainer(dropout_model(), step_fn=recording_step(rows),
                 **settings(Path(os.environ["ONE_RUN"]), strategy="ddp", resume="latest"), **_pair_kwargs())
    on.fit((x, y))
    rank = dist.get_rank()
    (out / f"worlds-{rank}.json").write_text(json.dumps({"rows": rows, "step": on.global_step}))
    if rank == 0:
        torch.save(params(on.model), out / "worlds-resumed.pt")
    runtime.destroy_process_group()


def batchnorm_model() -> nn.Module:
    torch.manual_seed(1234)
    return nn.Sequential(nn.Linear(FEATURES, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, CLASSES))


def syncbn_gpu(out: Path) -> None:
    """Both ranks on cuda:0 over gloo (NCCL refuses two ranks on one GPU; torch's SyncBatchNorm all-gathers its
    statistics through gloo as well): a DDP fit with dist.sync_batchnorm=true; rank 0 saves the weights and
    BatchNorm buffers, each rank what its model's layers became. fp32 matmuls in IEEE fp32 (no TF32), so the
    comparison with one process is one of float rounding only."""
    import torch.distributed as dist

    from torchrig import Trainer, runtime

    torch.backends.cuda.matmul.fp32_precision = "ieee"  # chosen here: torchrig leaves it as it is
    t = Trainer(batchnorm_model(), **settings(out / "syncbn", strategy="ddp", device="cuda:0", sync_batchnorm=True,
                                              metrics=[], **{"dist.backend": "gloo"}), **_pair_kwargs())
    layers = [type(m).__name__ for m in t.wrapped.module]
    t.fit(train_data())
    rank = dist.get_rank()
    (out / f"syncbn-{rank}.json").write_text(json.dumps({"layers": layers, "steps": t.global_step,
                                                         "backend": str(dist.get_backend())}))
    if rank == 0:
        torch.save(params(t.wrapped.module), out / "syncbn.pt")
    runtime.destroy_process_group()


def ema(out: Path) -> None:
    """DDP and FSDP2 fits keeping an EMA; evaluation with and without it; the EMA a resume restores."""
    import torch.distributed as dist

    from torchrig import Trainer, runtime

    x, y = train_data()
    ex, ey = eval_data()
    report: dict = {}
    for name, extra in {"ddp": dict(strategy="ddp"),
                        "fsdp": dict(strategy="fsdp", **{"dist.fsdp_min_params": 500})}.items():
        kw = settings(out / name, ema_decay=0.9, ema_warmup=True, **{"checkpoint.every_epochs": 1}, **extra)
        t = Trainer(make_model(), **kw, **_pair_kwargs())
        t.fit((x, y))
        found = {"ema": t.evaluate((ex, ey)), "raw": t.evaluate((ex, ey), ema=False), "updates": t.ema.num_updates}
        weights = {k: v.detach().cpu().clone() for k, v in t.ema.weights().items()}
        again = Trainer(make_model(), **dict(kw, resume="latest"), **_pair_kwargs())
        again.fit((x, y))  # restores the last checkpoint; the run is already finished, nothing is trained
        restored = {k: v.detach().cpu().clone() for k, v in again.ema.weights().items()}
        found["restored_equal"] = all(torch.equal(weights[k], restored[k]) for k in weights)
        found["restored_updates"] = again.ema.num_updates
        if dist.get_rank() == 0:
            torch.save(weights, out / f"ema-{name}.pt")
        report[name] = found
        again.close()
    (out / f"ema-{dist.get_rank()}.json").write_text(json.dumps(report))
    runtime.destroy_process_group()  # torchrig's: collects DDP wrappers in cycles, gives gloo's threads a moment


def float8(out: Path) -> None:
    """FSDP2 fits with float8 Linear layers whose weights are all-gathered in float8: 6 steps unbroken, and 3 steps
    then resumed to 6; rank 0 saves the gathered weights of both."""
    from torchrig import Trainer, runtime

    x, y = train_data()
    found = {}
    for name, steps, resume in (("whole", 6, None), ("cut", 3, None), ("cut", 6, "latest")):
        kw = settings(out / name, strategy="fsdp", max_steps=steps, float8="tensorwise", resume=resume)
        t = Trainer(make_model(), **kw, **{"float8.fsdp_all_gather": True}, **_pair_kwargs())
        t.fit((x, y))
        found[name] = params(t.model)
        found["gathers_float8"] = type(t.model[0].weight.to_local()).__name__
    if t.rank == 0:
        torch.save(found, out / "float8.pt")
    runtime.destroy_process_group()


def fit(out: Path) -> None:
    """The DDP run of ``equiv`` under torchrun's environment (elastic restarts resume by themselves)."""
    from torchrig import Trainer

    x, y = train_data()
    t = Trainer(make_model(), step_fn=fault_step, **settings(out / "run", strategy="ddp", **{"checkpoint.every_steps": 5}))
    with t:
        t.fit((x, y))
        if t.rank == 0:
            torch.save(params(t.model), out / "final.pt")
            print(f"finished at step {t.global_step}; resumed from {getattr(t, 'resumed_from', None)}", flush=True)


def trackers(out: Path) -> None:
    """A DDP fit with a CSV tracker, FLOP counting and the profiler: rank 0 alone writes their files."""
    from torchrig import Trainer

    x, y = train_data()
    t = Trainer(make_model(), **settings(out / "run", strategy="ddp", max_steps=4, trackers=["csv"], flops=True,
                                         profile={"steps": [2, 3]}, **{"log.every_steps": 1}), **_pair_kwargs())
    with t:
        t.fit((x, y))
        t.logger.finish({"test/accuracy": 0.5})
        (out / f"trackers-{t.rank}.json").write_text(json.dumps({"steps": t.global_step, "wrote": t.logger.enabled}))


def cli(args: list[str]) -> int:
    import torch.distributed as dist

    import torchrig.trainer.trainer as trainer_module
    from torchrig.cli import main

    trainer_module.default_step = fault_step  # the faults of the environment, else the default step
    rc = main(args)
    print(f"rank {os.environ.get('RANK')}: exit {rc}; process group still initialized: {dist.is_initialized()}",
          file=sys.stderr, flush=True)
    return rc


if __name__ == "__main__":
    what = sys.argv[1]
    if what == "cli":
        sys.exit(cli(sys.argv[2:]))
    target = Path(sys.argv[2])
    target.mkdir(parents=True, exist_ok=True)
    {"equiv": equiv, "resume": resume, "fit": fit, "features": features, "trackers": trackers, "ema": ema,
     "worlds": worlds, "float8": float8, "syncbn_gpu": syncbn_gpu}[what](target)


def fits_in_one_group(out: Path, specs: list[str], fit) -> None:
    """``fit(out, NAME, CHECKPOINT or None, **kw)`` for each ``NAME[=CHECKPOINT]`` of ``specs``, in one gloo group
    joined from the test's ``TEST_INIT`` / ``TEST_RANK`` / ``TEST_WORLD`` (a file:// store is joined once: the
    Trainers find the group and leave it open), then left through torchrig's own destroy."""
    import torch.distributed as dist

    from torchrig import runtime

    kw = {"init_method": os.environ["TEST_INIT"], "rank": int(os.environ["TEST_RANK"]),
          "world_size": int(os.environ["TEST_WORLD"]), "dist_timeout": 60.0}
    dist.init_process_group("gloo", init_method=kw["init_method"], rank=kw["rank"], world_size=kw["world_size"])
    for spec in specs:
        name, _, checkpoint = spec.partition("=")
        fit(out, name, checkpoint or None, **kw)
    if dist.is_initialized():
        runtime.destroy_process_group()  # torchrig's: gives gloo's threads a moment before the interpreter exits
