"""The files of mlx_pinned one chat request with an image runs code in.

A fresh process serves the tiny vision model in process (Starlette's
``TestClient``: the app's lifespan, its MLX thread, its worker threads all
start here), sends one streamed chat request with a 64x64 image to warm
every path, then a second one, and prints the files under ``mlx_pinned/``
that any thread called a function in during the second (a profile hook on
every thread, set before any starts). docs/server.md gives the count and
the hops; ``tests/server/test_layout.py`` holds it to a bound.

::

    python benchmarks/request_files.py [--json]
"""

from __future__ import annotations

import argparse
import base64
import json
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import mlx_pinned

ROOT = Path(mlx_pinned.__file__).parent


def touched_files() -> list[str]:
    """The files of ``mlx_pinned/`` the second request ran code in."""
    touched: set[str] = set()
    root = str(ROOT)

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_filename.startswith(root):
            touched.add(frame.f_code.co_filename)

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        return _serve_twice(touched)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


def _serve_twice(touched: set[str]) -> list[str]:
    from starlette.testclient import TestClient

    from mlx_pinned.server import create_app
    from mlx_pinned.testing import make_test_image, tiny_vlm_path

    image = base64.b64encode(make_test_image(64, 64, seed=0)).decode()
    body = {
        "model": "tiny",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe this image."},
                    {
                        "type": "image_url",
                        "image_url": {"url": f"data:image/jpeg;base64,{image}"},
                    },
                ],
            }
        ],
        "max_tokens": 4,
        "stream": True,
    }
    app = create_app(tiny_vlm_path(), served_model_name="tiny")
    with TestClient(app) as client:
        seen: list[str] = []
        for _ in range(2):
            touched.clear()
            with client.stream("POST", "/v1/chat/completions", json=body) as answer:
                assert answer.status_code == 200, answer.read()
                text = "".join(answer.iter_text())
            assert text.rstrip().endswith("data: [DONE]"), text
            seen = sorted(str(Path(f).relative_to(ROOT.parent)) for f in touched)
    return seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print a JSON list")
    args = parser.parse_args()
    files = touched_files()
    if args.json:
        print(json.dumps(files))
        return
    print("\n".join(files))
    print(f"{len(files)} files")


if __name__ == "__main__":
    main()
