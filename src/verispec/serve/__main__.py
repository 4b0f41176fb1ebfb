"""``python -m verispec.serve [args]``: the same as ``verispec serve [args]``."""
from ..cli.serve import main

if __name__ == "__main__":
    raise SystemExit(main())
