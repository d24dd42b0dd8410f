"""``python -m jmp_rewrite {demo,explain} ...``: see ``python -m jmp_rewrite --help``."""

from jmp_rewrite._src.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
