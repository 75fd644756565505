"""What the checkpoint checksums cost: saving and loading a ~100 MB ``model.safetensors`` and a ~100 MB
``state.pt``, with checksums (recorded at save, checked at load) against without.

Each arm runs in a fresh process, alternating. The ``checksums`` arm is torchrig as it is; the ``none``
arm replaces the sha256 of the writer by a no-op (save) and loads files whose ``meta.json`` records no
checksum (a checkpoint saved before checksums existed: nothing is checked). Measured per file, median of
``--repeats`` in each process: ``save_s`` (serialise, write, fsync, rename: ``save_weights`` /
``safe_torch_save``) and ``load_s`` (``load_weights_file`` / ``safe_torch_load``; the file was just
written, so it is read from the page cache: the hash pass is the whole extra cost, and a cold read from
disk would add the same disk time to both arms).

The ratio is checksums / none per file and operation; no target (measured).
Usage: ``python benchmarks/checksums.py [--mb 100] [--runs 3] [--repeats 3] [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common as c  # noqa: E402

NAME = "checksums"


class _NoHash:
    def update(self, data) -> None:
        pass

    def hexdigest(self) -> str:
        return ""


def _arm(p: dict) -> dict:
    c.pin_threads()
    import torch

    sys.path.insert(0, str(c.HERE.parent / "src"))
    from torchrig.checkpoint import io

    if p["arm"] == "none":
        io.hashlib = type("hashlib", (), {"sha256": staticmethod(lambda *a: _NoHash())})
    n = int(float(p["mb"]) * (1 << 20) / 4)
    g = torch.Generator().manual_seed(0)
    weights = {f"layer{i}.weight": torch.randn(n // 8, generator=g) for i in range(8)}
    state = {"optimizers": {"default": {"state": {i: {"momentum_buffer": t} for i, t in enumerate(weights.values())},
                                        "param_groups": [{"lr": 0.1, "params": list(range(8))}]}}}
    out: dict = {}
    with tempfile.TemporaryDirectory(prefix="torchrig-bench-") as folder:
        ckpt = Path(folder)
        for name, save, load in (("model.safetensors", lambda f: io.save_weights(weights, f), io.load_weights_file),
                                 ("state.pt", lambda f: io.safe_torch_save(state, f), io.safe_torch_load)):
            saves, loads = [], []
            for _ in range(int(p["repeats"])):
                t0 = time.perf_counter()
                digest = save(ckpt / name)
                saves.append(time.perf_counter() - t0)
                sums = {name: digest} if p["arm"] == "checksums" else {}
                (ckpt / "meta.json").write_text(json.dumps({"checksums": sums}))
                t0 = time.perf_counter()
                load(ckpt / name)
                loads.append(time.perf_counter() - t0)
            out[name] = {"save_s": statistics.median(saves), "load_s": statistics.median(loads),
                         "bytes": (ckpt / name).stat().st_size}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=100)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="4 MB, one run (a smoke test)")
    args = ap.parse_args()
    if args.quick:
        args.mb, args.runs, args.repeats = 4, 1, 1
    base = {"mb": args.mb, "repeats": args.repeats}
    runs = c.alternate(Path(__file__), {a: dict(base, arm=a) for a in ("checksums", "none")}, args.runs,
                       warmup=not args.quick)
    summary: dict = {}
    rows = []
    for name in ("model.safetensors", "state.pt"):
        summary[name] = {}
        for op in ("save_s", "load_s"):
            with_, without = (c.median([r[name][op] for r in runs[a]]) for a in ("checksums", "none"))
            summary[name][op] = {"checksums": with_, "none": without, "ratio": with_ / without,
                                 "extra_s": with_ - without}
            rows.append([name, op[:-2], f"{runs['checksums'][0][name]['bytes'] / (1 << 20):.0f} MiB", with_, without,
                         f"{with_ / without:.2f}x", with_ - without])
    print(c.table(["file", "operation", "size", "with checksums (s)", "without (s)", "ratio", "extra (s)"], rows))
    path = c.write_result(NAME, {"files": summary, "target": None, "meets_target": True, "settings": base},
                          quick=args.quick)
    print(f"written to {path}")


if __name__ == "__main__":
    if not c.child_main({"checksums": _arm, "none": _arm}):
        main()
