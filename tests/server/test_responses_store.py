"""The Responses store (``store.py``, ``sqlite_store.py``): one interface, in
memory or in SQLite under ``state_dir``; the same bound for both, kept across
restarts, concurrent writes, a ``kill -9`` mid-write, and the refusals of a
folder that cannot hold it at start."""

from __future__ import annotations

import json
import logging
import signal
import sqlite3
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import openai
import pytest
from starlette.routing import Route

from mlx_pinned.server import cli
from mlx_pinned.server.config import ServerConfig, SettingError
from mlx_pinned.server.events import FinalEvent, TokenEvent
from mlx_pinned.server.http.responses_api import sqlite_store
from mlx_pinned.server.http.responses_api.route import ResponsesEndpoint
from mlx_pinned.server.http.responses_api.sqlite_store import FILE_NAME, SQLiteStore
from mlx_pinned.server.http.responses_api.store import (
    MemoryStore,
    ResponseStore,
    open_store,
)

from .conftest import MODEL, replace_generation
from .kit import Serve, Served, running

MakeStore = Callable[[int, int], ResponseStore]


@pytest.fixture(params=["memory", "sqlite"])
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> MakeStore:
    """A store of either backing, for the bound's tests."""
    if request.param == "memory":
        return MemoryStore
    return lambda count, size: SQLiteStore.open(tmp_path, count, size)


def turn(name: str, *, images: int = 0, pad: int = 0) -> tuple[Any, ...]:
    """A stored turn's four parts: its response, input items, conversation
    and image URLs."""
    messages = ({"role": "user", "content": f"say {name}"},)
    urls = tuple(f"data:image/png;base64,{name}{index}" for index in range(images))
    return {"id": name, "pad": "x" * pad}, [{"id": f"msg_{name}"}], messages, urls


async def kept(store: ResponseStore, names: str) -> str:
    """Which of the one-letter ``names`` the store has, in order."""
    return "".join([name for name in names if await store.get(name) is not None])


class TestTheBound:
    @pytest.mark.anyio
    async def test_both_backings_evict_the_oldest_by_count(
        self, make_store: MakeStore
    ) -> None:
        store = make_store(2, 10_000)
        for name in "abc":
            assert await store.put(*turn(name))
        assert await kept(store, "abc") == "bc"
        assert len(store) == 2
        await store.aclose()

    @pytest.mark.anyio
    async def test_both_backings_evict_the_oldest_by_bytes(
        self, make_store: MakeStore
    ) -> None:
        store = make_store(100, 250)
        for name in "abc":
            assert await store.put(*turn(name, pad=40))
        assert store.bytes <= 250
        assert await kept(store, "abc") == "bc"
        assert not await store.put(*turn("d", pad=300)), "larger than the bound"
        assert await kept(store, "bcd") == "bc"
        await store.aclose()

    @pytest.mark.anyio
    async def test_a_response_stored_again_is_the_newest(
        self, make_store: MakeStore
    ) -> None:
        store = make_store(2, 10_000)
        for name in "aba":
            assert await store.put(*turn(name))
        assert await store.put(*turn("c"))
        assert await kept(store, "abc") == "ac"
        assert await store.delete("a")
        assert not await store.delete("a")
        assert await kept(store, "abc") == "c"
        assert store.bytes == (await store.get("c")).size  # type: ignore[union-attr]
        await store.aclose()

    @pytest.mark.anyio
    async def test_none_is_kept_under_a_count_of_zero(
        self, make_store: MakeStore
    ) -> None:
        store = make_store(0, 10_000)
        assert not await store.put(*turn("a"))
        assert await store.get("a") is None
        await store.aclose()


class TestSQLite:
    @pytest.mark.anyio
    async def test_a_restart_keeps_every_response_and_their_order(
        self, tmp_path: Path
    ) -> None:
        first = SQLiteStore.open(tmp_path, 3, 10_000)
        for name in "abc":
            assert await first.put(*turn(name, images=2))
        before = [await first.get(name) for name in "abc"]
        await first.aclose()
        again = SQLiteStore.open(tmp_path, 3, 10_000)
        assert [await again.get(name) for name in "abc"] == before
        assert again.image_count("b") == 2
        assert again.bytes == first.bytes
        assert await again.put(*turn("d"))  # the oldest, from before, goes
        assert await kept(again, "abcd") == "bcd"
        await again.aclose()

    @pytest.mark.anyio
    async def test_a_smaller_bound_at_start_drops_the_oldest_for_good(
        self, tmp_path: Path
    ) -> None:
        store = SQLiteStore.open(tmp_path, 10, 10_000)
        for name in "abcde":
            assert await store.put(*turn(name, pad=50))
        size = (await store.get("e")).size  # type: ignore[union-attr]
        await store.aclose()
        store = SQLiteStore.open(tmp_path, 4, 3 * size)
        assert await kept(store, "abcde") == "cde"
        await store.aclose()
        store = SQLiteStore.open(tmp_path, 10, 10_000)
        assert await kept(store, "abcde") == "cde"
        await store.aclose()

    @pytest.mark.anyio
    async def test_concurrent_writes_reads_and_deletes(self, tmp_path: Path) -> None:
        store = SQLiteStore.open(tmp_path, 25, 1_000_000)
        names = [f"r{index:02}" for index in range(40)]
        written: list[str] = []  # in the order the one writer wrote them

        async def write(name: str) -> None:
            assert await store.put(*turn(name, images=1))
            written.append(name)
            await store.get(name)  # a read between the writes

        async with anyio.create_task_group() as tasks:
            for name in names:
                tasks.start_soon(write, name)
        assert sorted(written) == names
        assert [n for n in written if await store.get(n) is not None] == written[-25:]
        deleted: dict[str, bool] = {}

        async def delete(name: str) -> None:
            deleted[name] = await store.delete(name)

        doomed = written[10:20]  # five evicted, five kept
        async with anyio.create_task_group() as tasks:
            for name in doomed:
                tasks.start_soon(delete, name)
        assert deleted == {name: name in written[-25:] for name in doomed}
        left = [name for name in written[-25:] if name not in doomed]
        await store.aclose()
        again = SQLiteStore.open(tmp_path, 25, 1_000_000)
        assert list(again._ledger.entries) == left
        await again.aclose()
        with sqlite3.connect(tmp_path / FILE_NAME) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            (total,) = db.execute("SELECT sum(size) FROM responses").fetchone()
        db.close()
        assert total == again.bytes

    @pytest.mark.anyio
    async def test_a_full_disk_keeps_what_was_stored_and_refuses_the_rest(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        store = SQLiteStore.open(tmp_path, 100, 10**9)
        assert await store.put(*turn("a"))
        connection = store._connection
        assert connection is not None
        (pages,) = connection.execute("PRAGMA page_count").fetchone()
        connection.execute(f"PRAGMA max_page_count = {pages}")  # the disk is full
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            assert not await store.put(*turn("b", pad=100_000))
        assert "response b not stored" in caplog.text
        assert await kept(store, "ab") == "a"
        assert len(store) == 1
        await store.aclose()

    @pytest.mark.slow
    def test_a_kill_mid_write_loses_no_acknowledged_response(
        self, tmp_path: Path
    ) -> None:
        # Writes as fast as it can and prints each id once its put returned.
        script = textwrap.dedent(
            f"""
            import anyio, sys
            from pathlib import Path
            from mlx_pinned.server.http.responses_api.sqlite_store import SQLiteStore

            async def main():
                store = SQLiteStore.open(Path({str(tmp_path)!r}), 100_000, 10**9)
                index = 0
                while True:
                    response = {{"id": f"r{{index}}", "pad": "x" * 20_000}}
                    assert await store.put(response, [], (), ())
                    print(response["id"], flush=True)
                    index += 1

            anyio.run(main)
            """
        )
        writer = subprocess.Popen(
            [sys.executable, "-c", script], stdout=subprocess.PIPE, text=True
        )
        assert writer.stdout is not None
        acknowledged = [writer.stdout.readline().strip() for _ in range(200)]
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        acknowledged += writer.stdout.read().split()
        writer.stdout.close()

        async def check() -> None:
            store = SQLiteStore.open(tmp_path, 100_000, 10**9)  # quick_check ok
            for name in acknowledged:
                stored = await store.get(name)
                assert stored is not None, name
                assert stored.response == {"id": name, "pad": "x" * 20_000}
            # At most the one write under way when it was killed, beyond.
            assert len(acknowledged) <= len(store) <= len(acknowledged) + 1
            await store.aclose()

        anyio.run(check)


class TestRefusedAtStart:
    @staticmethod
    def refusal(folder: Path) -> str:
        with pytest.raises(SettingError) as info:
            open_store(ServerConfig(model="m", state_dir=str(folder)))
        assert info.value.setting == "state_dir"
        message = str(info.value)
        assert message.startswith(f"state_dir {str(folder)!r}: ")
        assert "\n" not in message
        return message

    def test_a_corrupt_database(self, tmp_path: Path) -> None:
        (tmp_path / FILE_NAME).write_bytes(b"not a database " * 400)
        assert "cannot be read (file is not a database): move it away" in (
            self.refusal(tmp_path)
        )

    def test_a_truncated_database(self, tmp_path: Path) -> None:
        store = SQLiteStore.open(tmp_path, 100, 10**9)
        for index in range(20):
            store._write(*turn(f"r{index}", pad=5000))
        store._close()
        whole = (tmp_path / FILE_NAME).read_bytes()
        (tmp_path / FILE_NAME).write_bytes(whole[: len(whole) // 2])
        assert "move it away" in self.refusal(tmp_path)

    def test_a_folder_that_is_a_file(self, tmp_path: Path) -> None:
        (tmp_path / "state").write_text("")
        assert "cannot write there (File exists)" in self.refusal(tmp_path / "state")

    def test_a_folder_under_a_file(self, tmp_path: Path) -> None:
        (tmp_path / "file").write_text("")
        message = self.refusal(tmp_path / "file" / "state")
        assert "cannot write there (Not a directory)" in message

    def test_another_programs_database(self, tmp_path: Path) -> None:
        with sqlite3.connect(tmp_path / FILE_NAME) as db:
            db.execute("CREATE TABLE notes (text TEXT)")
        db.close()
        assert "is not a Responses store" in self.refusal(tmp_path)

    def test_another_format(self, tmp_path: Path) -> None:
        SQLiteStore.open(tmp_path, 1, 1000)._close()
        with sqlite3.connect(tmp_path / FILE_NAME) as db:
            db.execute("PRAGMA user_version = 99")
        db.close()
        assert "is of format 99, this server reads 1" in self.refusal(tmp_path)

    def test_a_folder_in_use_by_another_server(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setattr(sqlite_store, "BUSY_SECONDS", 0.05)
        held = SQLiteStore.open(tmp_path, 1, 1000)
        try:
            assert "in use by another process" in self.refusal(tmp_path)
        finally:
            held._close()
        SQLiteStore.open(tmp_path, 1, 1000)._close()  # free again once closed

    def test_an_empty_path_is_refused_as_the_config_is_made(self) -> None:
        with pytest.raises(SettingError, match="state_dir must be a folder's path"):
            ServerConfig(model="m", state_dir=" ")

    def test_the_command_line_refuses_with_one_line(
        self, tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / FILE_NAME).write_bytes(b"garbage " * 600)
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", str(tiny_model_path), "--state-dir", str(tmp_path)])
        assert info.value.code == 2
        assert capsys.readouterr().err.splitlines()[-1:] == [
            f"mlx-pinned: error: --state-dir {str(tmp_path)!r}: {FILE_NAME} cannot "
            "be read (file is not a database): move it away to start empty"
        ]

    def test_a_config_file_refuses_in_its_own_words(
        self, tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
    ) -> None:
        (tmp_path / "file").write_text("")
        state = tmp_path / "file" / "state"
        config = tmp_path / "server.toml"
        config.write_text(
            f'state_dir = "{state}"\n[[models]]\npath = "{tiny_model_path}"\n'
        )
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "--config", str(config)])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert err.splitlines()[-1:] == [
            f"mlx-pinned: error: --config {config}: state_dir {str(state)!r} "
            f"cannot be made: {str(tmp_path / 'file')!r} is a file, not a folder"
        ]


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_conversation_continues_across_a_restart(
    serve: Serve, tmp_path: Path
) -> None:
    """``previous_response_id`` through the openai SDK, in a new app on the
    same ``state_dir``: the same turn as a server that never stopped."""
    settings: dict[str, Any] = {"default_max_tokens": 8}
    ask = {"model": MODEL, "temperature": 0, "max_output_tokens": 6}

    async def chain(*, restart: bool, **own: Any) -> tuple[Any, Any]:
        async with serve(**settings, **own) as served:
            sdk = served.sdk()
            first = await sdk.responses.create(input="Say hello.", **ask)
            if not restart:
                second = await sdk.responses.create(
                    previous_response_id=first.id, input="Again.", **ask
                )
                return first, second
        async with serve(**settings, **own) as served:
            sdk = served.sdk()
            second = await sdk.responses.create(
                previous_response_id=first.id, input="Again.", **ask
            )
            assert (await sdk.responses.retrieve(first.id)).id == first.id
            items = await sdk.responses.input_items.list(first.id)
            assert [item.type for item in items.data] == ["message"]
        async with serve(**settings, **own) as served:
            sdk = served.sdk()
            await sdk.responses.delete(second.id)
        async with serve(**settings, **own) as served:
            sdk = served.sdk()
            with pytest.raises(openai.NotFoundError):
                await sdk.responses.retrieve(second.id)
            assert (await sdk.responses.retrieve(first.id)).id == first.id
        return first, second

    _, alone = await chain(restart=False)
    _, restarted = await chain(restart=True, state_dir=str(tmp_path))
    assert restarted.usage.input_tokens == alone.usage.input_tokens
    assert restarted.output_text == alone.output_text


@pytest.mark.slow
def test_the_server_keeps_its_responses_through_a_kill(tmp_path: Path) -> None:
    """``serve --state-dir``, killed with SIGKILL after a stored answer, and
    started again: the answer is there and its conversation continues."""
    command = [sys.executable, "-m", "mlx_pinned.server", "serve", "--demo"]
    command += ["--port", "0", "--state-dir", str(tmp_path / "state")]
    with running(command, tmp_path / "one.log") as server, server.client() as sdk:
        first = sdk.responses.create(
            model=cli.DEMO_MODEL_NAME, input="Hi.", max_output_tokens=4
        )
        server.process.send_signal(signal.SIGKILL)
        server.process.wait()
    with running(command, tmp_path / "two.log") as server, server.client() as sdk:
        assert sdk.responses.retrieve(first.id).output_text == first.output_text
        second = sdk.responses.create(
            model=cli.DEMO_MODEL_NAME,
            previous_response_id=first.id,
            input="More.",
            max_output_tokens=4,
        )
        assert second.usage.input_tokens > first.usage.input_tokens


def store_of(served: Served) -> ResponseStore:
    """The app's Responses store."""
    (endpoint,) = [
        route.endpoint
        for route in served.app.routes
        if isinstance(route, Route) and route.path == "/v1/responses"
    ]
    assert isinstance(endpoint, ResponsesEndpoint)
    return endpoint.store


def no_room(store: ResponseStore) -> None:
    """The store's database may not grow by a page: its disk is full."""
    assert isinstance(store, SQLiteStore)
    connection = store._connection
    assert connection is not None
    (pages,) = connection.execute("PRAGMA page_count").fetchone()
    connection.execute(f"PRAGMA max_page_count = {pages}")


def two_tokens(loaded: Any, params: Any, images: Any) -> Iterator[Any]:
    """The engine's generation, without the model: a long prompt costs
    nothing."""
    yield TokenEvent("o", None)
    yield TokenEvent("k", None)
    yield FinalEvent("", "stop", 3, 2)


@pytest.mark.anyio
async def test_a_response_a_full_disk_cannot_keep_says_store_false(
    serve: Serve,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Answered, whole or streamed, with ``"store": false`` (the store said
    no), not acknowledged as stored; once the disk has room, stored again."""
    replace_generation(monkeypatch, two_tokens)
    # Larger than the free room of the database's pages: it needs new ones.
    body = {"model": MODEL, "input": "x" * 20_000}
    async with serve(state_dir=str(tmp_path)) as served:
        no_room(store_of(served))
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            whole = await served.client.post("/v1/responses", json=body)
            streamed = await served.client.post(
                "/v1/responses", json={**body, "stream": True}
            )
        missing = await served.client.get(f"/v1/responses/{whole.json()['id']}")
        connection = store_of(served)._connection  # type: ignore[attr-defined]
        connection.execute("PRAGMA max_page_count = 1073741823")  # room again
        again = await served.client.post("/v1/responses", json=body)
        found = await served.client.get(f"/v1/responses/{again.json()['id']}")
    assert whole.status_code == 200
    assert whole.json()["store"] is False
    last = json.loads(streamed.text.strip().split("\n")[-1].removeprefix("data: "))
    assert last["type"] == "response.completed"
    assert last["response"]["store"] is False
    assert caplog.text.count("not stored") == 2
    assert missing.status_code == 404
    assert again.json()["store"] is True
    assert found.json() == again.json()


@pytest.mark.anyio
async def test_a_response_past_the_stores_bound_says_store_false(
    serve: Serve, monkeypatch: pytest.MonkeyPatch
) -> None:
    replace_generation(monkeypatch, two_tokens)
    body = {"model": MODEL, "input": "x" * 8_000}
    async with serve(responses_store_bytes=6_000) as served:
        answer = await served.client.post("/v1/responses", json=body)
        kept = await served.client.post("/v1/responses", json={**body, "input": "hi"})
    assert answer.json()["store"] is False
    assert kept.json()["store"] is True


@pytest.mark.anyio
async def test_a_damaged_stored_response_says_so_and_harms_no_other(
    serve: Serve, tmp_path: Path
) -> None:
    """A stored response whose JSON cannot be read (the file damaged while
    the server was stopped): a 500 that names it and is not retried, on
    ``GET``, ``input_items`` and ``previous_response_id``; the other
    responses are served, new ones stored, and it can be deleted."""
    ask = {"model": MODEL, "max_output_tokens": 2}
    async with serve(state_dir=str(tmp_path)) as served:
        sdk = served.sdk()
        damaged = await sdk.responses.create(input="one", **ask)
        whole = await sdk.responses.create(input="two", **ask)
    with sqlite3.connect(tmp_path / FILE_NAME) as db:
        db.execute(
            "UPDATE responses SET response = '{\"id\": ' WHERE id = ?", (damaged.id,)
        )
    db.close()
    async with serve(state_dir=str(tmp_path)) as served:
        url = f"/v1/responses/{damaged.id}"
        answers = {
            "response_id": await served.client.get(url),
            "items": await served.client.get(f"{url}/input_items"),
            "previous_response_id": await served.client.post(
                "/v1/responses",
                json={**ask, "input": "three", "previous_response_id": damaged.id},
            ),
        }
        other = await served.client.get(f"/v1/responses/{whole.id}")
        new = await served.sdk().responses.create(input="four", **ask)
        new_found = await served.client.get(f"/v1/responses/{new.id}")
        deleted = await served.client.delete(url)
        gone = await served.client.get(url)
    for place, answer in answers.items():
        assert answer.status_code == 500, (place, answer.text)
        assert answer.headers["x-should-retry"] == "false"
        error = answer.json()["error"]
        assert error["code"] == "stored_response_damaged"
        assert error["param"] == ("response_id" if place == "items" else place)
        assert damaged.id in error["message"]
        assert "damaged" in error["message"]
    assert other.status_code == 200
    assert other.json()["output"][0]["content"][0]["text"] == whole.output_text
    assert new_found.status_code == 200
    assert deleted.status_code == 200
    assert gone.status_code == 404
