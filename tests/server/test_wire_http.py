"""The server under a real uvicorn, for what only a socket shows: a client
that sends its whole body before it reads still gets its 413; CORS."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned.server import ServerConfig, create_app
from mlx_pinned.server.cli_options import OPTIONS

from .conftest import MODEL
from .kit import Serve

pytestmark = pytest.mark.timeout(60)

LIMIT = 4 * 1024 * 1024


@pytest.fixture(scope="module")
def url(tiny_model_path: Path, uvicorn_thread: Any) -> Iterator[str]:
    app = create_app(
        tiny_model_path,
        served_model_name=MODEL,
        max_body_bytes=LIMIT,
        max_num_seqs=1,
    )
    with uvicorn_thread(app) as running:
        yield running


def post(url: str, data: bytes) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=data,
        headers={"content-type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=20) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class TestBodyLimit:
    @pytest.mark.parametrize("factor", [2, 3.5])
    def test_urllib_reads_the_413_of_a_body_over_the_limit(
        self, url: str, factor: float
    ) -> None:
        # urllib writes the whole body before it reads: a server that
        # answers and closes halfway resets the connection under it.
        body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
        data = json.dumps(body).encode()
        data = data[:-1] + b', "user": "' + b"a" * int(LIMIT * factor) + b'"}'
        status, answer = post(url, data)
        assert status == 413
        assert answer["error"]["code"] == "request_too_large"

    def test_the_server_still_answers_after(self, url: str) -> None:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 2,
        }
        status, answer = post(url, json.dumps(body).encode())
        assert status == 200
        assert answer["usage"]["completion_tokens"] == 2


class TestCORS:
    pytestmark = pytest.mark.anyio

    ORIGIN = "https://app.example"

    async def test_a_preflight_is_answered_without_the_api_key(
        self, serve: Serve
    ) -> None:
        async with serve(allowed_origins=(self.ORIGIN,), api_key="k") as served:
            response = await served.client.options(
                "/v1/chat/completions",
                headers={
                    "origin": self.ORIGIN,
                    "access-control-request-method": "POST",
                    "access-control-request-headers": "authorization,content-type",
                },
            )
            assert response.status_code == 200
            headers = response.headers
            assert headers["access-control-allow-origin"] == self.ORIGIN
            assert "POST" in headers["access-control-allow-methods"]
            assert "authorization" in headers["access-control-allow-headers"]

    async def test_a_request_from_an_allowed_origin_may_read_its_answer(
        self, serve: Serve
    ) -> None:
        async with serve(allowed_origins=(self.ORIGIN,)) as served:
            response = await served.client.get(
                "/v1/models", headers={"origin": self.ORIGIN}
            )
            assert response.status_code == 200
            assert response.headers["access-control-allow-origin"] == self.ORIGIN
            other = await served.client.get(
                "/v1/models", headers={"origin": "https://evil.example"}
            )
            assert "access-control-allow-origin" not in other.headers

    async def test_cors_is_off_by_default(self, serve: Serve) -> None:
        async with serve() as served:
            response = await served.client.options(
                "/v1/chat/completions",
                headers={
                    "origin": self.ORIGIN,
                    "access-control-request-method": "POST",
                },
            )
            assert "access-control-allow-origin" not in response.headers

    def test_the_flag_takes_comma_separated_origins(self) -> None:
        from mlx_pinned.server.cli_options import origins

        assert origins(" https://a.example/, http://b:3000 ") == (
            "https://a.example",
            "http://b:3000",
        )
        assert origins("*") == ("*",)
        for bad in ("", ","):
            with pytest.raises(ValueError, match="origin"):
                origins(bad)
        with pytest.raises(ValueError, match="origin is scheme://host"):
            ServerConfig(allowed_origins=("a.example",))
        with pytest.raises(ValueError, match="one string"):
            ServerConfig(allowed_origins="https://a.example")  # type: ignore[arg-type]
        options = {option.flag: option for option in OPTIONS}
        assert options["--allowed-origins"].command_line_default() == ()

    def test_the_command_line_value_reaches_the_config(self) -> None:
        from mlx_pinned.server import cli

        args = cli.build_parser().parse_args(
            ["serve", "m", "--allowed-origins", "https://a.example,http://b:3000"]
        )
        config = cli._config(args)
        assert config.allowed_origins == ("https://a.example", "http://b:3000")
