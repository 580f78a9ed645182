"""The ``memckpt`` command: a thin layer over the library.

Each sub-command lives in its own module and is imported only when used, so
``memckpt --help`` is fast. Exit codes: 0 success, 1 the job or check failed,
2 bad usage (argparse) or a configuration error.
"""

from __future__ import annotations

import argparse
import importlib
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
    try:
        return handler(args)
    except ConfigError as e:
        print(f"memckpt {args.command}: {e}", file=sys.stderr)
        return 2
    except MemckptError as e:
        print(f"memckpt {args.command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
