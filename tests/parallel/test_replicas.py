"""dist.fault_tolerance=torchft: replica groups that train on when one is lost (parallel/replicas.py, torchrig launch
--replica-groups). The end-to-end test starts real processes (torchft's lighthouse, two torchrun jobs on gloo)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import dist_procs

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "helpers"))
import replica_worker as R  # noqa: E402

WORKER = Path(R.__file__)
KILL_AT, STEPS = 5, 16


def _replay(records: list) -> dict:
    """The documented semantics in one process: step s trains on the batches of the groups that took part in it
    (each group's share of the global batch, as the sampler gives it), the mean over their samples; a step not
    applied changes nothing."""
    from torchrig.data import prepare_train

    model = R.model()
    opt = torch.optim.SGD(model.parameters(), lr=R.LR, momentum=R.MOMENTUM)
    shares = []
    for epoch in range(R.EPOCHS):
        per_group = []
        for g in (0, 1):
            b = prepare_train(R.data(), batch_size=R.BATCH, seed=0, rank=g, world_size=2, shuffle=False,
                              device=torch.device("cpu"), num_workers=0)
            b.set_epoch(epoch)
            per_group.append(list(b))
        shares += list(zip(*per_group))
    for (step, groups, applied), share in zip(records, shares):
        if not applied:
            continue
        x = torch.cat([share[g][0] for g in groups])
        y = torch.cat([share[g][1] for g in groups])
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model.state_dict()


@pytest.mark.slow
def test_a_lost_replica_group_restarts_alone_and_rejoins_with_the_documented_weights(tmp_path):
    """Group 1 SIGKILLed after step 5: group 0 trains on alone (steps 6 … J, each said in one line with the batch
    skipped), torchrun restarts group 1, which copies group 0's model, momentum, counters and data position at step J
    and trains the rest with it; both end with the weights of a one-process replay of those participants (1e-6)."""
    pytest.importorskip("torchft")
    r = dist_procs.torchrig(["launch", "--replica-groups", "2", "--max-restarts", "1", "--", str(WORKER),
                             str(tmp_path), str(KILL_AT)], timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    joined = int((tmp_path / "joined").read_text())
    assert KILL_AT + 2 <= joined < STEPS, joined
    records = json.loads((tmp_path / "records-0.json").read_text())
    expected = [[s, [0, 1] if s <= KILL_AT or s > joined else [0], True] for s in range(1, STEPS + 1)]
    assert records == expected
    assert json.loads((tmp_path / "records-1.json").read_text()) == expected[joined:]  # the replacement's steps
    per_epoch = R.N // (2 * R.BATCH)  # each step trains a batch of each group
    for s in range(KILL_AT + 1, joined + 1):
        where = f"epoch {(s - 1) // per_epoch + 1}, batch {(s - 1) % per_epoch + 1}"
        assert (f"torchrig: optimizer step {s} ({where}): replica group(s) 1 of 2 did not take part "
                f"(lost, or not yet back): their share of this batch is skipped; the step trains on the 4 items of "
                f"group(s) 0") in r.stdout
    assert (f"torchrig: replica group 1 joined the live replica group(s) at step {joined} (epoch "
            f"{joined // per_epoch + 1}, batch {joined % per_epoch})") in r.stdout
    want = _replay(records)
    for g in (0, 1):
        got = torch.load(tmp_path / f"final-{g}.pt")
        for k, v in want.items():
            torch.testing.assert_close(got[k], v, atol=1e-6, rtol=0)


def test_torchft_without_the_launcher_is_one_line(tmp_path, monkeypatch):
    from torchrig import Trainer
    from torchrig.parallel import ReplicaGroupError

    for var in ("TORCHFT_LIGHTHOUSE", "REPLICA_GROUP_ID", "TORCHRIG_REPLICA_GROUPS"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ReplicaGroupError, match="start the run with torchrig launch --replica-groups N"):
        Trainer(R.model(), **R.settings(tmp_path / "run"))
    monkeypatch.setenv("TORCHRIG_REPLICA_GROUPS", "2")
    with pytest.raises(ReplicaGroupError, match="set dist.fault_tolerance=torchft"):
        Trainer(R.model(), **dict(R.settings(tmp_path / "run"), **{"dist.fault_tolerance": "none"}))


def test_what_replica_groups_do_not_compose_with_is_refused_in_one_line():
    from types import SimpleNamespace

    from torchrig.parallel import ReplicaGroupError, replicas

    layout = SimpleNamespace(tp=1, pp=1)
    cfg = SimpleNamespace(on_nonfinite="error", on_spike="none", precision="fp32", run_dir="r")
    with pytest.raises(ReplicaGroupError, match="2 processes in one replica group; each group is one process"):
        replicas.check_composition(2, "ddp", layout, cfg)
    with pytest.raises(ReplicaGroupError, match="set parallel.tp=1"):
        replicas.check_composition(1, "none", SimpleNamespace(tp=2, pp=1), cfg)
    with pytest.raises(ReplicaGroupError, match="config key 'on_nonfinite': 'skip'"):
        replicas.check_composition(1, "none", layout, SimpleNamespace(**dict(vars(cfg), on_nonfinite="skip")))
    with pytest.raises(ReplicaGroupError, match="config key 'run_dir'"):
        replicas.check_composition(1, "none", layout, SimpleNamespace(**dict(vars(cfg), run_dir=None)))


@pytest.mark.parametrize("args, message", [
    (["--replica-groups", "0"], "--replica-groups 0: give a number >= 1"),
    (["--replica-groups", "2", "--master-port", "29500"], "each group's rendezvous picks a free loopback port"),
])
def test_replica_group_launch_errors(args, message):
    r = dist_procs.torchrig(["launch", *args, "--", "train"], timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


class _Payload:
    ran: list = []

    def __reduce__(self):
        return (_Payload.ran.append, ("unpickled",))


def test_a_replacement_copies_tensors_and_unpickles_nothing_else(tmp_path):
    """The state a live group serves is read back with weights_only=True: a crafted one runs no code in the
    replacement (torchft's own reader would unpickle it), and the plain state torchrig serves still comes back."""
    import http.server
    import threading
    from datetime import timedelta
    from io import BytesIO

    pytest.importorskip("torchft")
    from torch.distributed._serialization import _streaming_save

    from torchrig.parallel.replicas import _tensors_only_transport

    def served(obj) -> bytes:
        buf = BytesIO()
        _streaming_save(obj, buf)
        return buf.getvalue()

    bodies = {"/crafted": served({"model": _Payload()}),
              "/plain": served({"model": {"w": torch.arange(3.0)}, "state": {"step": 7, "lr": [0.1], "ok": True}})}

    class Serve(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.end_headers()
            self.wfile.write(bodies[self.path])

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Serve)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base, transport = f"http://127.0.0.1:{server.server_address[1]}", _tensors_only_transport(timedelta(seconds=30))
    try:
        with pytest.raises(Exception, match="Unsupported global"):
            transport._load_from_address(f"{base}/crafted", timedelta(seconds=30))
        assert _Payload.ran == []
        plain = transport._load_from_address(f"{base}/plain", timedelta(seconds=30))
        assert torch.equal(plain["model"]["w"], torch.arange(3.0)) and plain["state"] == {"step": 7, "lr": [0.1],
                                                                                         "ok": True}
    finally:
        server.shutdown()
        transport.shutdown(wait=False)
