"""A short training run whose progress goes to a terminal (a tmux pane) or a pipe, as it would for a user.

    python tests/helpers/terminal_child.py RUN_DIR DONE_FILE

Two epochs of a tiny classifier with validation, a log row every optimizer step, then the end-of-run
summary; writes DONE_FILE when ``fit`` has returned, so the parent knows the pane holds everything.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for the helpers package

from helpers import TinyNet, make_classification  # noqa: E402

import torchrig  # noqa: E402


def main(run_dir: str, done: str) -> None:
    x, y = make_classification(n=48)
    data = TensorDataset(x, y)
    torch.manual_seed(0)
    trainer = torchrig.Trainer(TinyNet(), run_dir=run_dir, batch_size=8, epochs=2, lr=0.05, optimizer="sgd",
                               num_workers=0, log_every=1, metrics=["accuracy", "top3"], plot=False,
                               tensorboard=False, progress="auto")
    trainer.fit(data, val_data=data)
    Path(done).write_text("done\n")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
