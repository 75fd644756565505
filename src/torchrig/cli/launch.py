"""``torchrig launch``: a thin front for ``torch.distributed.run`` (torchrun).

Every flag means what it means to torchrun; torchrig adds only what the common multi-machine pitfalls call for:

- ``--ifname IFACE`` sets ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (the interface the ranks
  talk over — the usual reason a two-machine job hangs at start-up is that it picked the wrong one);
- a single-machine launch (``--nnodes 1``) listens on loopback only: its rendezvous store is bound to
  127.0.0.1 on a free port and the workers' gloo / nccl sockets use the loopback interface;
- the command after ``--`` may be a torchrig sub-command (``train …`` runs ``python -m torchrig train
  …`` in every worker), a Python script, ``python -m module …`` or any executable.

torchrun does the rest: it starts ``--nproc-per-node`` workers with ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, watches them, and with ``--max-restarts K``
restarts the whole group after a failure (``TORCHELASTIC_RESTART_COUNT`` then tells the trainer to
resume from the latest checkpoint).
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Optional

from ..errors import TorchrigError, suggest
from . import register_command

LOOPBACK_BACKEND = "torchrig-loopback"
TORCHRIG_COMMANDS = ("train", "evaluate", "predict", "plot", "doctor", "data", "bench", "tune", "lr-find", "summary")
EXIT_USAGE = 2
EXIT_HANG = 75  # runtime.hang.EXIT_HANG: the workers stopped on a hang (imported lazily there, with torch)


class LaunchError(TorchrigError, ValueError):
    """A launch request that cannot work as given; the message says what to change."""


# ----------------------------------------------------------------------------- argument parsing

def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("processes (as torchrun)")
    g.add_argument("--nproc-per-node", "--nproc_per_node", default="1", metavar="N",
                   help="workers on this machine: a number, or gpu / cpu / auto (default 1); one per GPU is usual")
    g.add_argument("--nnodes", default="1", metavar="M",
                   help="machines taking part, or MIN:MAX for an elastic job with --rdzv-backend c10d (default 1)")
    g.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="R",
                   help="this machine's index, 0 … M-1; 0 is the one at --master-addr (default 0)")
    g.add_argument("--master-addr", "--master_addr", metavar="A",
                   help="address of machine 0, reachable from every machine (needed with --nnodes > 1); "
                        "a single-machine launch uses 127.0.0.1")
    g.add_argument("--master-port", "--master_port", type=int, metavar="P",
                   help="TCP port of the rendezvous store on machine 0 (default 29500 with several machines, "
                        "a free loopback port on one)")
    g.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="K",
                   help="restart the worker group up to K times after a failure; the restarted run resumes "
                        "from the latest checkpoint (default 0)")
    g.add_argument("--rdzv-timeout", "--rdzv_timeout", type=float, default=900.0, metavar="SECONDS",
                   help="how long to wait for every machine to join (default 900)")
    g.add_argument("--rdzv-backend", "--rdzv_backend", metavar="NAME",
                   help="torchrun rendezvous backend for elastic multi-machine jobs (c10d, etcd); default: static "
                        "with --master-addr / --master-port / --node-rank")
    g.add_argument("--rdzv-endpoint", "--rdzv_endpoint", metavar="HOST:PORT",
                   help="rendezvous endpoint for --rdzv-backend")
    g.add_argument("--rdzv-id", "--rdzv_id", metavar="ID", help="job id shared by all machines (with --rdzv-backend)")
    g.add_argument("--rdzv-conf", "--rdzv_conf", metavar="KEY=VALUE,…",
                   help="torchrun's rendezvous settings with --rdzv-backend, e.g. last_call_timeout=5 (how long a "
                        "group that has MIN machines waits for more) or keep_alive_interval=2 (how soon a lost "
                        "machine is noticed); join_timeout is --rdzv-timeout")
    g.add_argument("--monitor-interval", "--monitor_interval", type=float, metavar="SECONDS",
                   help="how often torchrun checks its workers (torchrun's default)")
    g.add_argument("--log-dir", "--log_dir", metavar="DIR", help="torchrun's per-worker log directory")
    g.add_argument("--start-method", "--start_method", choices=("spawn", "fork", "forkserver"),
                   help="how torchrun starts workers (torchrun's default)")
    n = p.add_argument_group("network (torchrig)")
    n.add_argument("--ifname", metavar="IFACE",
                   help="network interface the ranks talk over, e.g. eth0 or ib0: sets GLOO_SOCKET_IFNAME and "
                        "NCCL_SOCKET_IFNAME (default: loopback on one machine, the system's choice on several)")
    f = p.add_argument_group("fault tolerance (torchft, with dist.fault_tolerance=torchft)")
    f.add_argument("--replica-groups", "--replica_groups", type=int, metavar="N",
                   help="start torchft's lighthouse (on 127.0.0.1; or use the one at $TORCHFT_LIGHTHOUSE) and N "
                        "replica groups on this machine, each its own torchrun job of --nproc-per-node processes with "
                        "its own --max-restarts: a lost group is restarted alone and copies a live group's state")
    r = p.add_argument_group("Ray (instead of torchrun)")
    r.add_argument("--ray", metavar="ADDRESS", help="run on Ray Train workers: the cluster's address, auto (this "
                                                    "machine's cluster, a KubeRay head) or ray://HEAD:10001")
    r.add_argument("--workers", type=int, default=None, metavar="N", help="Ray workers (processes), with --ray")
    r.add_argument("--ray-gpu", action="store_true", help="one GPU per Ray worker (NCCL); CPU workers use gloo")
    p.add_argument("--dry-run", action="store_true", help="print the torchrun arguments and environment, run nothing")
    p.add_argument("command_args", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="what every worker runs: a torchrig sub-command (train, evaluate, …), a script.py with "
                        "its arguments, python -m MODULE …, or an executable")


EPILOG = """examples:
  torchrig launch --nproc-per-node 4 -- train config.yaml --set epochs=20
  torchrig launch --nproc-per-node 2 -- my_script.py --lr 0.1
  # two machines, 8 GPUs each; run on both, with --node-rank 0 on 10.0.0.1 and 1 on the other:
  torchrig launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
      --nproc-per-node 8 --ifname eth0 -- train config.yaml
  # elastic: restart after a failure, resuming from the latest checkpoint
  torchrig launch --nproc-per-node 8 --max-restarts 3 -- train config.yaml
  # two replica groups that train on when one is lost (torchft); each restarted up to 3 times
  torchrig launch --replica-groups 2 --max-restarts 3 -- train config.yaml --set dist.fault_tolerance=torchft
  # on a Ray cluster (ray start, KubeRay): 4 Ray Train workers
  torchrig launch --ray auto --workers 4 -- train config.yaml
"""


def _strict(parser: argparse.ArgumentParser) -> None:
    """Make an unknown option before the command an error of ``launch`` (with a suggestion)."""
    known = [s for a in parser._actions for s in a.option_strings]
    original = parser.parse_known_args

    def parse_known_args(args=None, namespace=None):
        ns, extras = original(args, namespace)
        if extras:
            bad = extras[0].split("=")[0]
            procs = "proc" in bad or bad in ("-n", "--np", "--gpus")
            hint = suggest(bad, ["--nproc-per-node"], cutoff=0.0) if procs else suggest(bad, known)
            hint = hint or "; see torchrig launch --help"
            parser.error(f"unknown option {bad}{hint} (options for the launched command go after --)")
        return ns, extras

    parser.parse_known_args = parse_known_args  # type: ignore[method-assign]


@register_command
def _register(sub) -> None:
    p = sub.add_parser("launch", help="start a multi-process / multi-machine run (a front for torchrun)",
                       description="Start N worker processes on this machine (and M machines), each running the "
                                   "command after --, with the torchrun environment set. The same command runs "
                                   "unchanged on one process.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)  # `launch … train --start 3`: --start is train's, not --start-method
    add_arguments(p)
    p.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    p.set_defaults(handler=cmd_launch)
    _strict(p)


# ----------------------------------------------------------------------------- building torchrun's argv

def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _loopback_name() -> Optional[str]:
    names = _interfaces()
    return next((n for n in ("lo", "lo0") if n in names), None)


def _is_loopback(addr: Optional[str]) -> bool:
    return addr is None or addr in ("localhost", "::1") or addr.startswith("127.")


def worker_command(command: list[str]) -> list[str]:
    """torchrun's ``training_script [args]`` part (with ``-m`` / ``--no-python`` where needed)."""
    cmd = list(command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise LaunchError("nothing to launch: put the command after --, e.g. "
                          "torchrig launch --nproc-per-node 2 -- train --set epochs=3")
    if cmd[0] == "torchrig" or Path(cmd[0]).name == "torchrig":
        cmd = cmd[1:] or ["train"]
    first = cmd[0]
    if first in TORCHRIG_COMMANDS:
        return ["-m", "torchrig", *cmd]
    if Path(first).name.startswith("python") and not first.endswith(".py"):
        rest = cmd[1:]
        if rest[:1] == ["-m"] and len(rest) > 1:
            return ["-m", *rest[1:]]
        if rest and rest[0].endswith(".py"):
            return _script(rest)
        raise LaunchError(f"'{' '.join(cmd[:3])}': give python a script.py or -m MODULE")
    if first.endswith(".py"):
        return _script(cmd)
    if first.startswith("-"):
        raise LaunchError(f"unknown launch option {first!r} after the command separator; launch options go before --, "
                          f"the command after it")
    if os.path.sep in first or Path(first).exists():
        if not Path(first).exists():
            raise LaunchError(f"'{first}' does not exist")
        return ["--no-python", *cmd]
    import shutil

    if shutil.which(first) is None:
        raise LaunchError(f"'{first}' is not a torchrig command ({', '.join(TORCHRIG_COMMANDS[:5])}), a .py script "
                          f"or an executable on PATH{suggest(first, TORCHRIG_COMMANDS)}")
    return ["--no-python", *cmd]


def _script(cmd: list[str]) -> list[str]:
    if not Path(cmd[0]).is_file():
        raise LaunchError(f"script '{cmd[0]}' does not exist (the path is relative to {os.getcwd()})")
    return cmd


def _nnodes(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition(":")
        a, b = int(lo), int(hi or lo)
    except ValueError:
        raise LaunchError(f"--nnodes {text!r} is not a number or MIN:MAX") from None
    if a < 1 or b < a:
        raise LaunchError(f"--nnodes {text!r}: need 1 <= MIN <= MAX")
    return a, b


def _elastic(args: argparse.Namespace, timeout: str) -> list[str]:
    """torchrun's flags of an elastic rendezvous, as given (join_timeout is --rdzv-timeout)."""
    if not args.rdzv_endpoint:
        raise LaunchError(f"--rdzv-backend {args.rdzv_backend} needs --rdzv-endpoint HOST:PORT (on machine 0)")
    conf = ",".join([f"join_timeout={timeout}", *([args.rdzv_conf] if args.rdzv_conf else [])])
    return (["--nnodes", str(args.nnodes), "--rdzv-backend", args.rdzv_backend, "--rdzv-endpoint", args.rdzv_endpoint,
             "--rdzv-conf", conf] + (["--rdzv-id", args.rdzv_id] if args.rdzv_id else []))


def build(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """torchrun's argv and the environment variables the launch sets; raises LaunchError on bad input."""
    cmd = worker_command(args.command_args)
    nproc = str(args.nproc_per_node)
    if not (nproc.isdigit() and int(nproc) >= 1) and nproc not in ("auto", "gpu", "cpu", "xpu"):
        raise LaunchError(f"--nproc-per-node {nproc!r}: give a number >= 1, or gpu / cpu / auto")
    lo, hi = _nnodes(str(args.nnodes))
    env: dict[str, str] = {}
    if args.ifname:
        names = _interfaces()
        if names and args.ifname not in names:
            raise LaunchError(f"--ifname {args.ifname!r}: no such network interface on this machine; "
                              f"it has {', '.join(names)} (see `ip -brief address`)")
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = args.ifname
    if args.max_restarts < 0:
        raise LaunchError("--max-restarts must be 0 or more")
    if args.rdzv_timeout <= 0:
        raise LaunchError("--rdzv-timeout must be positive (seconds)")
    if args.master_port is not None and not 0 <= args.master_port <= 65535:
        raise LaunchError(f"--master-port {args.master_port} is not a TCP port (0-65535)")
    elastic = bool(args.rdzv_backend) and args.rdzv_backend != "static"
    if args.rdzv_conf and not elastic:
        raise LaunchError(f"--rdzv-conf {args.rdzv_conf!r} is for an elastic rendezvous: add --rdzv-backend c10d "
                          f"and --rdzv-endpoint HOST:PORT")
    argv = ["--nproc-per-node", nproc, "--max-restarts", str(args.max_restarts)]
    timeout = str(int(args.rdzv_timeout))
    if elastic:
        argv += _elastic(args, timeout)
    elif hi == 1 and _is_loopback(args.master_addr):
        # One machine: a store bound to 127.0.0.1 only, and gloo / nccl on the loopback interface.
        port = args.master_port if args.master_port is not None else 0
        argv += ["--nnodes", "1", "--rdzv-backend", LOOPBACK_BACKEND, "--rdzv-endpoint", f"127.0.0.1:{port}",
                 "--rdzv-conf", f"timeout={timeout}"]
        lo_name = _loopback_name()
        if lo_name and not args.ifname:
            for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if var not in os.environ:
                    env[var] = lo_name
    else:  # several machines, static rendezvous (torchrun's default)
        if lo != hi:
            raise LaunchError(f"--nnodes {args.nnodes} (elastic MIN:MAX) needs --rdzv-backend c10d and --rdzv-endpoint")
        if not args.master_addr:
            raise LaunchError(f"--nnodes {hi} needs --master-addr: the address of machine 0 (the one started with "
                              f"--node-rank 0), reachable from every machine")
        if not 0 <= args.node_rank < hi:
            raise LaunchError(f"--node-rank {args.node_rank} is outside 0 … {hi - 1} for --nnodes {hi}")
        argv += ["--nnodes", str(hi), "--node-rank", str(args.node_rank), "--master-addr", args.master_addr,
                 "--master-port", str(args.master_port if args.master_port is not None else 29500),
                 "--rdzv-conf", f"timeout={timeout}"]
    if args.monitor_interval is not None:
        argv += ["--monitor-interval", str(args.monitor_interval)]
    if args.log_dir:
        argv += ["--log-dir", args.log_dir]
    if args.start_method:
        argv += ["--start-method", args.start_method]
    return argv + cmd, env


# ----------------------------------------------------------------------------- the loopback rendezvous

def _register_loopback_backend() -> None:
    """A static rendezvous whose TCP store listens on 127.0.0.1 only (torchrun's own binds every interface)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry as registry
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    if getattr(_register_loopback_backend, "done", False):
        return

    class LoopbackRendezvous(StaticTCPRendezvous):
        def get_backend(self) -> str:
            return LOOPBACK_BACKEND

        def next_rendezvous(self):
            # A fresh store for every round: after a restart the workers must not read the keys (peer
            # addresses) that the previous round's workers left behind.
            import torch.distributed as dist

            port = self.requested_port if not self._store else 0
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
            except OSError as exc:
                sock.close()
                raise LaunchError(f"cannot listen on 127.0.0.1:{port} ({exc.strerror}); another job uses that "
                                  f"port: pick another --master-port or leave it out") from None
            sock.listen(1024)
            self.master_port = sock.getsockname()[1]
            self._store = dist.TCPStore("127.0.0.1", self.master_port, self.world_size, True, self.timeout,
                                        master_listen_fd=sock.detach())
            return super().next_rendezvous()

    def create(params):
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        _, port = parse_rendezvous_endpoint(params.endpoint, 0)
        timeout = int(params.config.get("timeout", 900))
        handler = LoopbackRendezvous("127.0.0.1", port, 0, params.max_nodes, params.run_id, timeout)
        handler.requested_port = port
        return handler

    registry.register(LOOPBACK_BACKEND, create)
    _register_loopback_backend.done = True  # type: ignore[attr-defined]


# ----------------------------------------------------------------------------- running

def _describe_failures(exc) -> str:
    lines = []
    for rank, f in sorted(getattr(exc, "failures", {}).items()):
        how = f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exited with code {f.exitcode}"
        lines.append(f"  rank {rank} (local rank {f.local_rank}, pid {f.pid}) {how}")
    return "\n".join(lines)


STOP_CODES = {143: "SIGTERM", 130: "SIGINT", 138: "SIGUSR1"}  # 128 + signal: torchrig's clean stops


def _clean_stop(exc) -> Optional[int]:
    """The exit code of the workers that stopped cleanly on a signal, when that is what ended the run: every
    failed worker stopped so, or was ended by torchrun's own SIGTERM to the ranks left after one exits."""
    codes = [f.exitcode for f in getattr(exc, "failures", {}).values()]
    stops = [code for code in codes if code in STOP_CODES]
    if stops and all(code in STOP_CODES or code == -15 for code in codes):
        return stops[0]
    return None


def torchrun_args(argv: list[str], parse_args=None) -> argparse.Namespace:
    """torchrun's namespace for ``build``'s argv, whose command's arguments reach the workers as written.

    torchrun's own parser reads abbreviations everywhere, so a command option that begins one of its options
    (``--start``, ``--max``, ``--rdzv``) would be refused or taken as torchrun's; only the options ``build``
    wrote (each with its value) and the script are parsed here, and the rest is handed over untouched."""
    if parse_args is None:
        from torch.distributed.run import parse_args
    i = 0
    while i < len(argv) and argv[i].startswith("-"):
        i += 1 if argv[i] in ("-m", "--no-python") else 2
    targs = parse_args(argv[:i + 1])
    targs.training_script_args = list(argv[i + 1:])
    return targs


def _quiet_torchrun(targs: argparse.Namespace) -> None:
    """What torchrun would print that torchrig says itself: its OMP_NUM_THREADS banner (torchrun sets 1 thread per
    worker when several share a machine and the variable is unset; set here, as it would, without the banner) and
    its log lines of a failed worker and of the SIGTERM it sends the others (the launcher's error lists every
    rank and how it ended)."""
    import logging

    nproc = str(getattr(targs, "nproc_per_node", "1"))
    if "OMP_NUM_THREADS" not in os.environ and nproc.isdigit() and int(nproc) > 1:
        os.environ["OMP_NUM_THREADS"] = "1"

    class _NoFailureLine(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            text = record.getMessage()
            return "failed (exitcode" not in text and "closing signal" not in text

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_NoFailureLine())


def launch(argv: list[str], env: dict[str, str]) -> int:
    """Run torchrun in this process (so the loopback rendezvous is available); returns an exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    _register_loopback_backend()
    os.environ.update(env)
    targs = torchrun_args(argv, parse_args)
    _quiet_torchrun(targs)
    try:
        run(targs)
    except ChildFailedError as exc:
        code = _clean_stop(exc)
        if code is not None:  # a SIGTERM / Ctrl-C / SIGUSR1 to a worker: rank 0's stop line is above
            again = "--set resume=latest" if targs.module and targs.training_script == "torchrig" else \
                "resume='latest'"
            print(f"torchrig launch: the run stopped cleanly on {STOP_CODES[code]} (exit {code}); rank 0's line "
                  f"above says where; to continue, run the same command with {again}", file=sys.stderr)
            return code
        restarts = f" after {targs.max_restarts} restart(s)" if targs.max_restarts else ""
        if any(f.exitcode == EXIT_HANG for f in exc.failures.values()):
            print(f"torchrig launch: the run stopped on a hang{restarts} (exit {EXIT_HANG}, dist.hang_timeout): rank 0's "
                  f"line above names the ranks and where each was; their stacks are in RUN_DIR/hang (torchrig doctor "
                  f"--hang RUN_DIR); the checkpoints written are kept:\n{_describe_failures(exc)}", file=sys.stderr)
            return EXIT_HANG
        print(f"torchrig launch: error: the run failed{restarts}; the first error is in the failed worker's output "
              f"above:\n{_describe_failures(exc)}", file=sys.stderr)
        codes = [f.exitcode for f in exc.failures.values() if f.exitcode > 0]
        return codes[0] if codes else 1
    return 0


def _cmd_ray(args: argparse.Namespace) -> int:
    from .ray import RayLaunchError, run_on_ray

    if args.workers is None:
        print("torchrig launch: error: --ray needs --workers N (the number of Ray workers)", file=sys.stderr)
        return EXIT_USAGE
    try:
        return run_on_ray(args.command_args, args.workers, args.ray, use_gpu=args.ray_gpu)
    except RayLaunchError as exc:
        print(f"torchrig launch: error: {exc}", file=sys.stderr)
        return 1


def cmd_launch(args: argparse.Namespace) -> int:
    if args.ray is not None:
        return _cmd_ray(args)
    if args.replica_groups is not None:
        return _cmd_replicas(args)
    if args.workers is not None:
        print("torchrig launch: error: --workers goes with --ray; torchrun's processes are --nproc-per-node",
              file=sys.stderr)
        return EXIT_USAGE
    try:
        argv, env = build(args)
    except LaunchError as exc:
        print(f"torchrig launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if args.dry_run:
        shown = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        print(f"{shown + ' ' if shown else ''}{shlex.quote(sys.executable)} -m torch.distributed.run "
              + " ".join(shlex.quote(a) for a in argv))
        return 0
    try:
        return launch(argv, env)
    except LaunchError as exc:
        print(f"torchrig launch: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if getattr(args, "debug", False):
            raise
        from torch.distributed import DistError
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.rendezvous import RendezvousError

        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if isinstance(exc, SignalException):  # torchrun stopped its workers and passes the signal on
            print(f"torchrig launch: stopped by {exc.sigval.name}; the workers were terminated", file=sys.stderr)
            return 128 + int(exc.sigval)
        if isinstance(exc, (DistError, RendezvousError, TimeoutError, ConnectionError)):
            print(f"torchrig launch: error: the machines did not come together ({type(exc).__name__}: {first}). "
                  f"Check that every machine runs the same command with its own --node-rank, that --master-addr is "
                  f"machine 0's address and port {args.master_port or 29500} is open between them, that --ifname "
                  f"names the interface carrying that address, and --rdzv-timeout ({args.rdzv_timeout:g}s)",
                  file=sys.stderr)
            return 1
        print(f"torchrig launch: error: {type(exc).__name__}: {first} (run with --debug for the traceback)",
              file=sys.stderr)
        return 1


# ----------------------------------------------------------------------------- replica groups (torchft)

ENV_GROUPS_MARK = "TORCHRIG_REPLICA_GROUPS"  # set for the workers of --replica-groups: they need the torchft key


def _replica_args(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """Each replica group's torchrun argv and environment (the same for every group), checked."""
    if args.replica_groups < 1:
        raise LaunchError(f"--replica-groups {args.replica_groups}: give a number >= 1")
    if str(args.nnodes) != "1" or args.rdzv_backend:
        raise LaunchError("--replica-groups starts every group on this machine: leave out --nnodes and "
                          "--rdzv-backend (each group is one torchrun job of its own)")
    if args.master_port is not None:
        raise LaunchError("--master-port with --replica-groups: each group's rendezvous picks a free loopback port; "
                          "leave it out")
    return build(args)


def _start_lighthouse(groups: int) -> tuple[object, str]:
    """torchft's lighthouse on 127.0.0.1, or none when $TORCHFT_LIGHTHOUSE names one already: (server, address).
    A quorum needs one live group; it waits for a group that still heartbeats (5 s) before going on without it."""
    given = os.environ.get("TORCHFT_LIGHTHOUSE")
    if given:
        return None, given
    try:
        from torchft._torchft import LighthouseServer
    except ImportError:
        raise LaunchError('--replica-groups needs torchft: pip install "torchrig[ft]"') from None
    server = LighthouseServer(bind="127.0.0.1:0", min_replicas=1, join_timeout_ms=60_000)
    port = server.address().rsplit(":", 1)[-1]
    return server, f"http://127.0.0.1:{port}"


def _run_groups(argv: list[str], env: dict[str, str], groups: int, lighthouse: str) -> list[int]:
    """One ``launch`` per replica group, each in a process of its own; their exit codes, in group order."""
    import json
    import subprocess

    code = "import json, sys; from torchrig.cli.launch import launch; sys.exit(launch(json.loads(sys.argv[1]), {}))"
    procs = []
    for g in range(groups):
        group_env = dict(os.environ, **env, REPLICA_GROUP_ID=str(g), NUM_REPLICA_GROUPS=str(groups),
                         TORCHFT_LIGHTHOUSE=lighthouse, **{ENV_GROUPS_MARK: str(groups)})
        procs.append(subprocess.Popen([sys.executable, "-c", code, json.dumps(argv)], env=group_env))
    try:
        return [p.wait() for p in procs]
    finally:
        for p in procs:  # a signal to the launcher: the groups end with it
            if p.poll() is None:
                p.terminate()
        for p in procs:
            p.wait()


def _cmd_replicas(args: argparse.Namespace) -> int:
    """``--replica-groups N``: the lighthouse, then N torchrun jobs; the launch fails if any group failed for good."""
    try:
        argv, env = _replica_args(args)
        if args.dry_run:
            print(f"torchft lighthouse on 127.0.0.1; {args.replica_groups} replica group(s), each: "
                  f"{shlex.quote(sys.executable)} -m torch.distributed.run " + " ".join(shlex.quote(a) for a in argv))
            return 0
        server, address = _start_lighthouse(args.replica_groups)
    except LaunchError as exc:
        print(f"torchrig launch: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        codes = _run_groups(argv, env, args.replica_groups, address)
    except KeyboardInterrupt:
        return 130
    finally:
        if server is not None:
            server.shutdown()
    failed = [(g, c) for g, c in enumerate(codes) if c != 0]
    if failed:
        print("torchrig launch: error: " + "; ".join(f"replica group {g} ended with exit code {c}" for g, c in failed)
              + " (its output is above)", file=sys.stderr)
        return failed[0][1]
    return 0
