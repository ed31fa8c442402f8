"""One data-parallel replica (serving/router.py starts it): `jdet serve` with the router's
settings, given as JSON, on its own loopback port.

usage: python -m serving.replica JSON
"""

from __future__ import annotations

import json
import sys

from serving.launch import serve


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit("usage: python -m serving.replica JSON (started by jdet serve --data-parallel)")
    kw = json.loads(argv[0])
    serve(kw.pop("model", None), **kw)


if __name__ == "__main__":
    main(sys.argv[1:])
