"""Every private PyTorch name torchrig relies on, checked against what torchrig assumes of it.

torchrig uses a few names PyTorch does not document as public (docs/architecture.md, "Private PyTorch
names", says where and why). Each test below states the behaviour torchrig's code depends on, so an
upgrade of PyTorch that changes one fails here, by name, before it changes a training run.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn


def _params(fused: bool = True):
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(5))
    p.grad = torch.randn(5)
    return p, torch.optim.Adam([p], lr=0.1, fused=fused)


def test_fused_optimizers_read_found_inf_and_grad_scale_from_the_optimizer():
    """optim/nonfinite.py sets ``opt.found_inf`` / ``opt.grad_scale`` (as GradScaler does) so the fused kernel
    skips a non-finite window itself, with no host read: flag 1 leaves the weights and the step count
    unchanged, flag 0 updates them."""
    for flag, changes in ((1.0, False), (0.0, True)):
        p, opt = _params()
        before = p.detach().clone()
        opt.grad_scale, opt.found_inf = None, torch.tensor(flag)
        opt.step()
        del opt.grad_scale, opt.found_inf
        assert (not torch.equal(p, before)) == changes, flag
    p, opt = _params()
    opt.grad_scale, opt.found_inf = torch.tensor(2.0), torch.tensor(0.0)  # grad_scale: the kernel unscales
    ref_p, ref = _params()
    ref_p.grad /= 2
    opt.step()
    ref.step()
    assert torch.allclose(p, ref_p)


def test_amp_non_finite_check_sets_the_flag_and_keeps_finite_gradients():
    """optim/nonfinite.py: ``_amp_foreach_non_finite_check_and_unscale_`` with a scale of 1 is the fused
    finite check: it sets the flag on any NaN / inf and multiplies by 1 (finite gradients stay bitwise)."""
    grads = [torch.randn(4), torch.randn(3, 2)]
    kept = [g.clone() for g in grads]
    found, one = torch.zeros(1), torch.ones(1)
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    assert found.item() == 0 and all(torch.equal(a, b) for a, b in zip(grads, kept))
    grads[1][0, 1] = float("inf")
    torch._amp_foreach_non_finite_check_and_unscale_(grads, found, one)
    assert found.item() == 1


def test_grad_scaler_keeps_found_inf_per_device_per_optimizer():
    """optim/nonfinite.py and trainer/microbatch.py read (and after an out-of-memory error, drop)
    ``GradScaler._per_optimizer_states[id(opt)]["found_inf_per_device"]`` to learn whether the scaler skipped
    an update without waiting for the GPU; ``update`` clears the record."""
    p, opt = _params(fused=False)
    scaler = torch.amp.GradScaler("cpu", init_scale=1.0)
    scaler.scale(p.sum())  # the scaler's scale exists from its first scale() on
    p.grad = torch.tensor([float("inf"), 0, 0, 0, 0])
    scaler.step(opt)
    record = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
    assert [float(v) for v in record.values()] == [1.0]
    scaler.update()
    assert id(opt) not in scaler._per_optimizer_states or not scaler._per_optimizer_states[id(opt)].get(
        "found_inf_per_device")


def test_schedulers_warn_unless_opt_called_is_set():
    """trainer/saving.py sets ``opt._opt_called`` on a resumed optimizer: it has stepped before the checkpoint,
    so the scheduler's first ``step()`` must not warn about an optimizer that never stepped."""
    def first_step_warns(mark: bool) -> bool:
        p = nn.Parameter(torch.zeros(1))
        opt = torch.optim.SGD([p], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, 1)
        if mark:
            opt._opt_called = True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        return any("optimizer.step()" in str(w.message) for w in caught)

    assert first_step_warns(False) and not first_step_warns(True)


def test_ddp_require_forward_param_sync_is_set_by_a_forward(tmp_path):
    """trainer/microbatch.py clears DDP's ``require_forward_param_sync`` (set by a forward with gradients
    on) so that a forward that raised on one rank leaves no rank with a different next forward."""
    if dist.is_initialized():
        pytest.skip("a process group exists already")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(nn.Linear(2, 2))
        ddp.require_forward_param_sync = False
        ddp(torch.randn(3, 2)).sum().backward()
        assert ddp.require_forward_param_sync is True
    finally:
        dist.destroy_process_group()


def test_version_counter_and_views_tell_a_fresh_output():
    """trainer/step.py keeps a prediction for the metrics without a copy only when it is a fresh autograd
    output: ``grad_fn`` set, ``not _is_view()`` and ``_version == 0``; an in-place write bumps ``_version``
    and a slice is a view."""
    out = nn.Linear(3, 2)(torch.randn(4, 3))
    assert out.grad_fn is not None and not out._is_view() and out._version == 0
    assert out[:2]._is_view()
    with torch.no_grad():
        out.add_(1)
    assert out._version == 1


def test_foreach_ops_match_their_loops():
    """optim/ema.py (``_foreach_lerp_``, ``_foreach_copy_``), optim/normalize.py (``_foreach_mul_``),
    optim/nonfinite.py (``_foreach_norm``) and trainer/microbatch.py (``_foreach_copy_``): one kernel per
    list, bitwise the per-tensor op."""
    torch.manual_seed(0)
    a, b = [torch.randn(5), torch.randn(2, 3)], [torch.randn(5), torch.randn(2, 3)]
    x = [t.clone() for t in a]
    torch._foreach_lerp_(x, b, 0.25)
    assert all(torch.equal(u, t.lerp(v, 0.25)) for u, t, v in zip(x, a, b))
    x = [t.clone() for t in a]
    torch._foreach_lerp_(x, b, [0.1, 0.9])
    assert all(torch.equal(u, t.lerp(v, w)) for u, t, v, w in zip(x, a, b, (0.1, 0.9)))
    x = [t.clone() for t in a]
    torch._foreach_mul_(x, torch.tensor(3.0))
    assert all(torch.equal(u, t * 3) for u, t in zip(x, a))
    torch._foreach_copy_(x, b)
    assert all(torch.equal(u, v) for u, v in zip(x, b))
    assert all(torch.equal(n, torch.linalg.vector_norm(t, 2)) for n, t in zip(torch._foreach_norm(a, 2), a))


def test_compiled_module_keeps_the_original_as_orig_mod():
    """runtime/modules.py and parallel/wrap.py look through ``torch.compile``'s wrapper by ``_orig_mod``."""
    m = nn.Linear(2, 2)
    compiled = torch.compile(m)
    assert compiled._orig_mod is m and isinstance(compiled, nn.Module)


def test_memory_snapshot_functions_exist():
    """observe/profiling.py records CUDA memory with ``torch.cuda.memory._record_memory_history`` and
    writes ``_dump_snapshot`` (the functions PyTorch's memory-visualisation guide uses)."""
    from torch.cuda import memory

    assert callable(memory._record_memory_history) and callable(memory._dump_snapshot)


def test_pytree_maps_and_flattens_batches():
    """observe/throughput.py moves a batch's tensors to the meta device with ``torch.utils._pytree``."""
    from torch.utils._pytree import tree_leaves, tree_map

    batch = {"x": torch.ones(2), "y": (torch.zeros(1), 3)}
    assert [t.shape for t in tree_leaves(batch) if isinstance(t, torch.Tensor)] == [(2,), (1,)]
    moved = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, batch)
    assert moved["x"].is_meta and moved["y"][1] == 3


def test_one_cycle_keeps_its_plan_in_total_steps_and_schedule_phases():
    """trainer/saving.py re-plans a resumed OneCycleLR by loading the ``total_steps`` and ``_schedule_phases`` of its
    state_dict from one built for the new length: the learning rate is then a closed form of the step, that
    schedule's at every step from there on."""
    def one_cycle(total):
        opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        return opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=total)

    _, planned = one_cycle(8)
    opt, short = one_cycle(3)
    ref_opt, ref = one_cycle(8)
    for _ in range(3):
        opt.step(), short.step(), ref_opt.step(), ref.step()
    state = short.state_dict()
    assert {"total_steps", "_schedule_phases", "last_epoch"} <= set(state)
    state.update({k: planned.state_dict()[k] for k in ("total_steps", "_schedule_phases")})
    short.load_state_dict(state)
    for _ in range(5):
        opt.step(), short.step(), ref_opt.step(), ref.step()
        assert short.get_last_lr() == ref.get_last_lr()


def test_the_default_store_clones_into_a_client_of_its_own_that_sees_the_same_keys(tmp_path):
    """runtime/hang.py: ``distributed_c10d._get_default_store().clone()`` is the hang watch's own client of the
    group's store (a thread of its own never waits behind the main thread's calls); ``check`` does not block."""
    import torch.distributed.distributed_c10d as c10d

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        store = c10d._get_default_store()
        mine = store.clone()
        mine.set("torchrig/hang/ask", "1")
        assert store.get("torchrig/hang/ask") == b"1" and not mine.check(["torchrig/hang/none"])
        assert mine.add("torchrig/hang/answered/1", 0) == 0
    finally:
        dist.destroy_process_group()


def test_the_nccl_flight_recorder_dump_is_json_bytes():
    """runtime/hang.py: ``_dump_nccl_trace_json(includeCollectives=, onlyActive=)`` is the Flight Recorder's JSON
    (called only on NCCL, where it returns bytes of a JSON object with ``entries``)."""
    fn = torch._C._distributed_c10d._dump_nccl_trace_json
    assert "includeCollectives" in (fn.__doc__ or "") and "onlyActive" in (fn.__doc__ or "")


def test_the_fake_process_group_runs_a_mesh_and_collectives_in_one_process():
    """cli/plan.py: ``FakeStore`` and the backend "fake" make this process one rank of a large world whose
    collectives return at once (a device mesh of 1,024 ranks is built in seconds)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=5, world_size=1024)
    try:
        mesh = init_device_mesh("cpu", (4, 32, 8), mesh_dim_names=("pp", "dp", "tp"))
        assert mesh["tp"].size() == 8 and dist.get_rank() == 5
        t = torch.ones(2)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
