"""Thin entry point: ``python cli.py IMAGES... [options]`` (see ``explain.cli``)."""

from explain.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
