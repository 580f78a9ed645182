"""The ``memckpt`` command: a thin layer over the library.

Each sub-command lives in its own module and is imported only when used, so
``memckpt --help`` is fast. Exit codes: 0 success, 1 the job or check failed,
2 bad usage (argparse) or a configuration error. Every failure is one line on
stderr; an unexpected exception too (MEMCKPT_TRACEBACK=1 shows where it came from).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import Callable, Optional

from memckpt.errors import ConfigError, MemckptError

# name -> (module, one-line help[, add_arguments name, main name])
COMMANDS: dict[str, tuple[str, ...]] = {
    "run": ("memckpt.cli.run", "run a training function on Ray with in-memory replicas"),
    "status": ("memckpt.cli.status", "show a running job: placement, committed step, workers"),
    "kill": ("memckpt.cli.kill", "recovery drill: kill a worker or a node of a running job"),
    "ls": ("memckpt.cli.checkpoints", "list persisted checkpoints under a directory or s3:// URI",
           "add_ls_arguments", "ls_main"),
    "export": ("memckpt.cli.checkpoints", "export a checkpoint's weights for plain PyTorch",
               "add_export_arguments", "export_main"),
    "demo": ("memckpt.cli.demo", "run the demo job: train, inject a fault, recover"),
    "bench": ("memckpt.cli.bench", "measure memckpt against torch.save and friends"),
    "report": ("memckpt.cli.report", "draw a run's timeline: loss, failures, rollbacks, stalls"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memckpt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text, *fns) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        add, run = fns or ("add_arguments", "main")
        getattr(mod, add)(p)
        p.set_defaults(_main=getattr(mod, run))
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    handler: Callable[[argparse.Namespace], int] = args._main
    name = " ".join(w for w in (args.command, getattr(args, "benchmark", None)) if w)
    try:
        return handler(args)
    except ConfigError as e:
        print(f"memckpt {name}: {e}", file=sys.stderr)
        return 2
    except MemckptError as e:
        print(f"memckpt {name}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001 (one line, not a traceback from deep inside)
        if os.environ.get("MEMCKPT_TRACEBACK"):
            raise
        print(f"memckpt {name}: failed: {type(e).__name__}: {e} (set "
              "MEMCKPT_TRACEBACK=1 to see where)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
