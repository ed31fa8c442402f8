"""One data-parallel replica (serving/http/router.py starts it): `jdet serve` with the router's
settings, given as JSON, on its own loopback port.

usage: python -m serving.http.replica JSON
"""

from __future__ import annotations

import json
import sys

from serving.http.launch import serve


def main(argv: list[str]) -> None:
    if len(argv) != 1:
        sys.exit(
            "usage: python -m serving.http.replica JSON (started by jdet serve --data-parallel)"
        )
    kw = json.loads(argv[0])
    serve(kw.pop("model", None), **kw)


if __name__ == "__main__":
    main(sys.argv[1:])
