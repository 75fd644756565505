"""examples/quickstart.ipynb executed by nbclient in a real ipykernel: a notebook progress widget, the
curves shown inline, a Trainer fitted twice in one kernel; then a kernel interrupt during fit saves a
checkpoint like Ctrl-C and reaches the notebook as a KeyboardInterrupt, and the run resumes from it."""

from __future__ import annotations

import os
import threading
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

from helpers import REPO  # noqa: E402

LONG_FIT = '''
import torch
from torch import nn
x = torch.randn(4000, 8); y = (x[:, 0] > 0).long()
slow = torchrig.Trainer(nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 2)), epochs=1000, batch_size=8,
                        run_dir="runs/interrupted", plot=False, **{"log.every_steps": 1})
slow.fit((x, y))
'''


def outputs(cell) -> list[dict]:
    return cell.get("outputs", [])


@pytest.mark.slow
def test_quickstart_notebook_runs_in_a_kernel(tmp_path):
    from nbclient.exceptions import CellExecutionError
    from nbclient.util import run_sync

    nb = nbformat.read(REPO / "examples" / "quickstart.ipynb", as_version=4)
    n = len(nb.cells)
    nb.cells.append(nbformat.v4.new_code_cell(LONG_FIT))
    nb.cells.append(nbformat.v4.new_code_cell('resumed = torchrig.Trainer(nn.Sequential(nn.Linear(8, 256), nn.ReLU(), '
                                              'nn.Linear(256, 2)), epochs=1000, batch_size=8, run_dir="runs/interrupted", '
                                              'plot=False, resume="latest", max_steps=slow.global_step + 3)\n'
                                              'resumed.fit((x, y)); print("resumed", slow.global_step, resumed.global_step)'))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    client = nbclient.NotebookClient(nb, timeout=240, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.km = client.create_kernel_manager()
    client.km.cwd = str(tmp_path)
    with client.setup_kernel(env=env, cwd=str(tmp_path)):
        for i in range(n):
            client.execute_cell(nb.cells[i], i)
        jsonl = tmp_path / "runs" / "interrupted" / "metrics.jsonl"

        done = threading.Event()

        def interrupt():  # once the loop has logged a few steps: a real kernel interrupt (SIGINT to the kernel)
            while not done.is_set() and (not jsonl.exists() or jsonl.read_text().count("\n") < 3):
                time.sleep(0.2)
            if not done.is_set():
                run_sync(client.km.interrupt_kernel)()

        thread = threading.Thread(target=interrupt)
        thread.start()
        try:
            with pytest.raises(CellExecutionError) as caught:
                client.execute_cell(nb.cells[n], n)
        finally:
            done.set()
            thread.join()
        client.execute_cell(nb.cells[n + 1], n + 1)

    fit, again = nb.cells[2], nb.cells[4]
    kinds = [o.get("data", {}) for o in outputs(fit) if o["output_type"] == "display_data"]
    assert any("application/vnd.jupyter.widget-view+json" in d for d in kinds), "tqdm's notebook bar"
    assert any("image/png" in d for d in kinds), "plot='inline' shows the curves"
    assert (tmp_path / "runs" / "quickstart" / "plots" / "curves.png").is_file()
    text = "".join(o.get("text", "") for o in outputs(again))
    assert "resumed" in text.lower() or "step" in text, text
    scores = next(o for o in outputs(again) if o["output_type"] == "execute_result")["data"]["text/plain"]
    assert "'accuracy'" in scores
    accuracy = float(scores.split("'accuracy': ")[1].split(",")[0].rstrip("}"))
    assert accuracy > 0.8, scores
    assert not any(o["output_type"] == "error" for c in nb.cells[:n] for o in outputs(c))

    error = next(o for o in outputs(nb.cells[n]) if o["output_type"] == "error")
    assert error["ename"] == "RunInterrupted", error  # a KeyboardInterrupt, not SystemExit
    assert "stopped by SIGINT at step" in error["evalue"] and 'resume="latest"' in error["evalue"]
    step = int(error["evalue"].split("at step ")[1].split(";")[0])
    assert (tmp_path / "runs" / "interrupted" / "checkpoints" / f"step-{step:08d}").is_dir()
    last = "".join(o.get("text", "") for o in outputs(nb.cells[n + 1]))
    assert f"resumed {step} {step + 3}" in last, last
    assert "To exit" not in "".join(o.get("text", "") for o in outputs(nb.cells[n])), caught.value
