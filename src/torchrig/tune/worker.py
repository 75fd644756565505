"""A ``--parallel`` worker of ``torchrig tune``: ``python -m torchrig.tune.worker STUDY_DIR K RUNNING``."""

from __future__ import annotations

import sys


def main(argv: list[str]) -> int:
    import json

    from ..errors import TorchrigError
    from .run import worker_main

    try:
        return worker_main(argv, json.loads(sys.stdin.buffer.read()))
    except TorchrigError as exc:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"torchrig tune: worker error: {text}", file=sys.stderr, flush=True)
        return 1
    except SystemExit as exc:  # a stop signal (RunStopped): its line, its exit code
        if str(exc) and not str(exc).isdigit():
            print(str(exc), file=sys.stderr, flush=True)
        raise


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
