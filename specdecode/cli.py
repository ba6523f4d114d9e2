"""`specdecode` command line: one subcommand per module.

Each command module defines ``add_arguments(parser)`` and ``main(args) -> int`` and keeps heavy
imports (torch, transformers) inside ``main`` so that ``specdecode --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from specdecode.extras import MissingExtra, missing_extra

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("specdecode.commands.generate", "generate text with or without a draft model"),
    "models": ("specdecode.models.cli", "fetch and convert models (e.g. `models fetch qwen2.5-coder`)"),
    "bench": ("specdecode.bench.cli", "benchmark speculation on Spec-Bench / HumanEval prompts"),
    "check": ("specdecode.check.cli", "prove a draft/target pair is lossless on this machine"),
    "serve": ("specdecode.server.cli", "OpenAI-compatible server with continuous batching"),
    "load": ("specdecode.load.cli", "load generator against any OpenAI-compatible endpoint"),
    "heads": ("specdecode.heads.cli", "extract target features and train drafter heads (Medusa)"),
    "profile": ("specdecode.profile.cli", "this machine's cost profile: v(n), draft cost, break-even, ceiling"),
}

# the extra a command's module needs beyond the core (it includes what its parts need: bench's structured workloads)
COMMAND_EXTRAS = {"bench": "bench", "check": "bench", "load": "bench", "serve": "serve"}


class Parser(argparse.ArgumentParser):
    """Bad flags are one line and exit 2, like every other bad input (not a usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (`{self.prog} --help` lists the flags)\n")


def _command_extra(command: str, missing: MissingExtra | None) -> MissingExtra | None:
    """A missing module, said as the extra ``command`` needs (one install gives all it needs)."""
    if missing is None or command not in COMMAND_EXTRAS:
        return missing
    return MissingExtra(missing.name or "", COMMAND_EXTRAS[command], missing.what or f"specdecode {command}")


class _Unavailable:
    """A command whose module needs an extra that is not installed: running it raises the one-line error."""

    def __init__(self, missing: MissingExtra) -> None:
        self.missing = missing

    def main(self, args: argparse.Namespace) -> int:
        raise self.missing


def build_parser() -> argparse.ArgumentParser:
    from specdecode import __version__

    parser = Parser(prog="specdecode", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"specdecode {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # command not built yet
            missing = _command_extra(name, missing_extra(exc))
            if missing is None:
                raise
            # the command needs an extra that is not installed: listed, and running it says which extra
            p = sub.add_parser(name, help=f"{help_text} (needs the {missing.extra} extra)", description=help_text)
            p.set_defaults(_module=_Unavailable(missing))
            continue
        p = sub.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if isinstance(getattr(args, "_module", None), _Unavailable):
        unknown = []  # a command whose extra is missing takes any flags: it only says what to install
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if hasattr(args, "device") and hasattr(args, "dtype"):  # the model commands: decide auto once, for reports
        from specdecode.models.device import dtype_name, resolve_device

        try:
            device = resolve_device(args.device)
        except ValueError as exc:
            print(f"specdecode: {exc}", file=sys.stderr)
            return 2
        args.dtype_given = args.dtype != "auto"  # an explicit --dtype means the torch backend (--backend auto)
        args.device, args.dtype = str(device), dtype_name(args.dtype, device)
    if hasattr(args, "backend"):  # the model commands' --threads (build.py): torch's and llama.cpp's
        if args.threads is not None and args.threads < 1:
            print(f"specdecode {args.command}: --threads must be >= 1, got {args.threads}", file=sys.stderr)
            return 2
        from specdecode.machine import default_threads, say_later, take_note

        take_note()  # a line an earlier command in this process kept but never said
        if args.threads is None:  # the idle cores now (specdecode.machine), said when the models load
            args.threads, why = default_threads()
            if why:
                say_later(f"threads: {args.threads} ({why}; --threads N to choose)")
        import torch

        torch.set_num_threads(args.threads)
    from specdecode.errors import UserError

    try:
        return int(args._module.main(args) or 0)
    except MissingExtra as exc:  # an optional dependency: one line naming the extra that installs it
        print(f"specdecode {args.command}: {_command_extra(args.command, exc)}", file=sys.stderr)
        return 2
    except UserError as exc:  # bad input: one line, exit 2 (see specdecode.errors)
        print(f"specdecode {args.command}: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        missing = _command_extra(args.command, missing_extra(exc))
        if missing is None:
            raise
        print(f"specdecode {args.command}: {missing}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
