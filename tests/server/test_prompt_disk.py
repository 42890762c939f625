"""The disk tier of the prompt and image caches (``engine/prompt_disk.py``):
entries and images' outputs written atomically, checked when loaded (format,
model, checksum, shape), skipped with a warning when they fail, within one
byte budget, memory only when the disk fails; and through the app, a restart
that answers from disk exactly as a fresh prefill does, without encoding
its image again."""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_pinned.server.engine.disk_format import model_fingerprint
from mlx_pinned.server.engine.prompt_cache import PromptCache
from mlx_pinned.server.engine.prompt_disk import DiskTier
from mlx_pinned.testing import image_data_uri

from .conftest import MODEL
from .kit import TOL, Serve, Served, logprobs, read_only

FINGERPRINT = "f" * 32
DIGEST, OTHER = b"\x01" * 16, b"\x02" * 16


def layers(tokens: int, seed: int, *, quantized: bool = False) -> list[Any]:
    """Two layers of evaluated KV for ``tokens`` tokens, (1, 2, T, 64)."""
    mx.random.seed(seed)
    out = []
    for _ in range(2):
        keys = mx.random.normal((1, 2, tokens, 64)).astype(mx.bfloat16)
        values = mx.random.normal((1, 2, tokens, 64))
        if quantized:
            out.append(
                (tuple(mx.quantize(keys, 64, 8)), tuple(mx.quantize(values, 64, 8)))
            )
        else:
            out.append((keys, values))
    mx.eval(out)
    return out


def key(*ids: int) -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.asarray(ids, dtype=np.int64)


def same(ours: Any, theirs: Any) -> bool:
    """Whether two layers' lists hold the very same arrays, piece by piece."""
    mine, yours = _flat(ours), _flat(theirs)
    if len(mine) != len(yours):
        return False
    pairs = zip(mine, yours, strict=True)
    return all(a.dtype == b.dtype and mx.array_equal(a, b).item() for a, b in pairs)


def nbytes(tree: Any) -> int:
    """Bytes of the arrays in layers' lists."""
    return sum(int(piece.nbytes) for piece in _flat(tree))


def _flat(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in _flat(item)]
    return [tree]


def image_output(rows: int, seed: int, deep: int | None) -> Any:
    """An image's outputs as the tower's are cut: views into larger
    arrays, (rows, 16) features and ``deep`` deepstack ones."""
    mx.random.seed(seed)
    features = mx.random.normal((3 * rows, 16)).astype(mx.bfloat16)[rows : 2 * rows]
    deeps = None
    if deep is not None:
        deeps = [mx.random.normal((2 * rows, 16))[rows:] for _ in range(deep)]
    mx.eval(features, deeps)
    return features, deeps


class TestTheFiles:
    @pytest.mark.parametrize("quantized", [False, True])
    def test_an_entry_comes_back_the_same_after_a_restart(
        self, tmp_path: Path, quantized: bool
    ) -> None:
        kv = layers(5, seed=1, quantized=quantized)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save(key(1, 2, 3, 4, 5), kv)
        tier.close()
        again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        name, length = again.best(key(1, 2, 3, 9), limit=10)
        assert length == 3
        assert name is not None
        loaded = again.load(name)
        assert loaded is not None
        assert list(loaded[0]) == [1, 2, 3, 4, 5]
        assert same(loaded[1], kv)

    def test_a_longer_entry_replaces_its_prefixes(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save(key(1, 2, 3), layers(3, seed=1))
        tier.save(key(1, 2, 3, 4), layers(4, seed=2))
        tier.save(key(7, 8), layers(2, seed=3))
        tier.flush()
        assert len(list(tmp_path.glob("*.kv"))) == 2
        tier.close()

    def test_the_budget_drops_the_least_recently_used(self, tmp_path: Path) -> None:
        one = nbytes(layers(4, seed=1))
        tier = DiskTier(tmp_path, int(one * 2.5), FINGERPRINT)
        for first in (1, 2, 3):
            tier.save(key(first, 0, 0, 0), layers(4, seed=first))
            tier.flush()
        assert tier.best(key(1, 0, 0, 0), 4)[1] == 0, "the oldest went"
        assert tier.best(key(3, 0, 0, 0), 4)[1] == 4
        assert len(list(tmp_path.glob("*.kv"))) == 2
        tier.close()

    def test_the_prefixes_a_new_entry_replaces_make_room_first(
        self, tmp_path: Path
    ) -> None:
        one = nbytes(layers(4, seed=1))
        tier = DiskTier(tmp_path, int(one * 2.5), FINGERPRINT)
        tier.save(key(9, 0, 0, 0), layers(4, seed=1))
        tier.save(key(1, 2, 3), layers(3, seed=2))
        tier.save(key(1, 2, 3, 4), layers(4, seed=3))  # replaces (1, 2, 3)
        tier.flush()
        assert tier.best(key(9, 0, 0, 0), 4)[1] == 4, "the oldest stays"
        assert len(list(tmp_path.glob("*.kv"))) == 2
        tier.close()

    def test_a_restart_keeps_the_order_of_use(self, tmp_path: Path) -> None:
        one = nbytes(layers(4, seed=1))
        tier = DiskTier(tmp_path, int(one * 2.5), FINGERPRINT)
        for first in (1, 2):
            tier.save(key(first, 0, 0, 0), layers(4, seed=first))
            tier.flush()
        name, _ = tier.best(key(1, 0, 0, 0), 4)
        assert name is not None
        assert tier.load(name) is not None  # 1 used last: 2 is the oldest
        tier.close()
        again = DiskTier(tmp_path, int(one * 2.5), FINGERPRINT)
        again.save(key(3, 0, 0, 0), layers(4, seed=3))
        again.flush()
        assert again.best(key(1, 0, 0, 0), 4)[1] == 4
        assert again.best(key(2, 0, 0, 0), 4)[1] == 0
        again.close()

    def test_an_entry_larger_than_the_budget_is_not_written(
        self, tmp_path: Path
    ) -> None:
        tier = DiskTier(tmp_path, 100, FINGERPRINT)
        tier.save(key(1, 2), layers(2, seed=1))
        tier.close()
        assert list(tmp_path.iterdir()) == []
        assert tier.enabled

    def test_a_truncated_file_is_skipped_at_start_with_a_warning(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save(key(1, 2, 3), layers(3, seed=1))
        tier.close()
        (path,) = tmp_path.glob("*.kv")
        path.write_bytes(path.read_bytes()[:-100])
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        assert "its size is not what its header says" in caplog.text
        assert again.best(key(1, 2, 3), 3) == (None, 0)
        assert not path.exists()

    def test_a_changed_file_is_skipped_when_loaded_with_a_warning(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save(key(1, 2, 3), layers(3, seed=1))
        tier.close()
        (path,) = tmp_path.glob("*.kv")
        raw = bytearray(path.read_bytes())
        raw[-100] ^= 0xFF
        path.write_bytes(raw)
        again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        name, _ = again.best(key(1, 2, 3), 3)
        assert name == path.name
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            assert again.load(name) is None
        assert "checksum does not match" in caplog.text
        assert again.best(key(1, 2, 3), 3) == (None, 0)
        assert not path.exists()

    def test_a_file_of_another_model_is_never_served(self, tmp_path: Path) -> None:
        tier = DiskTier(tmp_path, 10**7, "another model")
        tier.save(key(1, 2, 3), layers(3, seed=1))
        tier.close()
        assert DiskTier(tmp_path, 10**7, FINGERPRINT).best(key(1, 2, 3), 3) == (
            None,
            0,
        )

    def test_a_file_that_is_not_one_is_skipped_at_start(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        (tmp_path / "junk.kv").write_bytes(b"\x05" * 3)
        (tmp_path / ".half.123.tmp").write_bytes(b"a write cut short")
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        assert "junk.kv skipped" in caplog.text
        assert tier.best(key(5), 1) == (None, 0)
        assert not (tmp_path / ".half.123.tmp").exists()

    def test_a_failed_write_turns_the_tier_off(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        def broken(*args: Any) -> None:
            raise OSError(errno.EIO, "Input/output error")

        monkeypatch.setattr(os, "replace", broken)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        cache = PromptCache(10**7)
        cache.attach(tier)
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            cache.store(key(1, 2, 3), layers(3, seed=1))
            tier.flush()
        assert "disk tier off, memory only" in caplog.text
        assert not tier.enabled
        assert list(tmp_path.iterdir()) == []
        assert cache.lookup(key(1, 2, 3, 4), 3).length == 3, "memory still serves"
        tier.close()

    def test_a_full_disk_pauses_the_writes_until_it_has_room(
        self,
        tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture,
    ) -> None:
        real_replace, free = os.replace, [0]

        def full_disk(*args: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        def usage(path: Any) -> Any:
            return SimpleNamespace(total=10**9, used=10**9 - free[0], free=free[0])

        monkeypatch.setattr(os, "replace", full_disk)
        monkeypatch.setattr(shutil, "disk_usage", usage)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        cache = PromptCache(10**7)
        cache.attach(tier)
        with caplog.at_level(logging.INFO, "mlx_pinned.server"):
            cache.store(key(1, 2, 3), layers(3, seed=1))
            tier.flush()
            assert "disk tier is full" in caplog.text
            monkeypatch.setattr(os, "replace", real_replace)
            cache.store(key(4, 5, 6), layers(3, seed=2))  # still no room
            tier.flush()
            assert list(tmp_path.iterdir()) == []
            free[0] = 10**8
            cache.store(key(7, 8, 9), layers(3, seed=3))
            tier.flush()
        assert "has room again" in caplog.text
        assert tier.enabled
        assert [path.suffix for path in tmp_path.iterdir()] == [".kv"]
        assert tier.best(key(7, 8, 9), 3)[1] == 3
        tier.close()

    @pytest.mark.slow
    def test_what_was_handed_over_is_written_before_the_process_exits(
        self, tmp_path: Path
    ) -> None:
        script = textwrap.dedent(
            f"""
            import mlx.core as mx, numpy as np
            from pathlib import Path
            from mlx_pinned.server.engine.prompt_disk import DiskTier

            tier = DiskTier(Path({str(tmp_path)!r}), 10**9, {FINGERPRINT!r})
            kv = [(mx.ones((1, 2, 4000, 64)), mx.ones((1, 2, 4000, 64)))] * 4
            mx.eval(kv)
            tier.save(np.arange(4000), kv)
            """
        )
        subprocess.run([sys.executable, "-c", script], check=True, timeout=60)
        tier = DiskTier(tmp_path, 10**9, FINGERPRINT)
        name, length = tier.best(np.arange(4000), 4000)
        assert length == 4000
        assert name is not None
        assert tier.load(name) is not None

    def test_the_fingerprint_tells_models_and_quantization_apart(
        self, tiny_model_path: Path, tmp_path: Path
    ) -> None:
        plain = model_fingerprint(str(tiny_model_path))
        assert model_fingerprint(str(tiny_model_path)) == plain
        assert model_fingerprint(str(tiny_model_path), "8/64") != plain
        assert model_fingerprint(str(tmp_path)) != plain


class TestImageFiles:
    @pytest.mark.parametrize("deep", [None, 2])
    def test_an_images_outputs_come_back_the_same_after_a_restart(
        self, tmp_path: Path, deep: int | None
    ) -> None:
        output = image_output(4, seed=1, deep=deep)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save_image(DIGEST, output)
        tier.close()
        again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        (path,) = tmp_path.iterdir()
        assert again.nbytes == path.stat().st_size
        loaded = again.load_image(DIGEST, rows=4)
        assert loaded is not None
        assert same(loaded[0], output[0])
        assert (loaded[1] is None) == (deep is None)
        assert same(loaded[1] or [], output[1] or [])
        assert again.load_image(OTHER, rows=4) is None
        assert again.best(key(1, 2), 2) == (None, 0), "an image is no prompt"
        assert DiskTier(tmp_path, 10**7, "another model").load_image(DIGEST, 4) is None

    @pytest.mark.parametrize(
        ("damage", "warned"),
        [("change", "checksum does not match"), ("rows", "do not match the image")],
    )
    def test_an_image_file_that_fails_a_check_is_skipped_with_a_warning(
        self,
        tmp_path: Path,
        caplog: pytest.LogCaptureFixture,
        damage: str,
        warned: str,
    ) -> None:
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save_image(DIGEST, image_output(4, seed=1, deep=2))
        tier.close()
        (path,) = tmp_path.iterdir()
        if damage == "change":
            raw = bytearray(path.read_bytes())
            raw[-10] ^= 0xFF
            path.write_bytes(raw)
        again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        rows = 5 if damage == "rows" else 4
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            assert again.load_image(DIGEST, rows) is None
        assert warned in caplog.text
        assert not path.exists()
        assert again.nbytes == 0

    def test_a_changed_header_is_caught_by_the_checksum(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        tier.save_image(DIGEST, image_output(4, seed=1, deep=None))
        tier.close()
        (path,) = tmp_path.iterdir()
        raw = path.read_bytes()
        (length,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8 : 8 + length])
        header["arrays"][0][0] = "float16"  # as many bytes: only the sum knows
        text = json.dumps(header).encode()
        path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + length :])
        again = DiskTier(tmp_path, 10**7, FINGERPRINT)
        with caplog.at_level(logging.WARNING, "mlx_pinned.server"):
            assert again.load_image(DIGEST, 4) is None
        assert "checksum does not match" in caplog.text

    def test_a_file_over_the_budget_with_its_header_is_not_written(
        self, tmp_path: Path
    ) -> None:
        small, large = image_output(2, seed=1, deep=None), image_output(64, 2, None)
        payload = int(large[0].nbytes)
        tier = DiskTier(tmp_path, payload + 16, FINGERPRINT)
        tier.save_image(OTHER, small)
        tier.save_image(DIGEST, large)
        tier.flush()
        assert tier.load_image(DIGEST, 64) is None
        assert tier.load_image(OTHER, 2) is not None, "nothing made room for it"
        assert tier.enabled
        tier.close()

    def test_images_and_prompts_share_the_budget(self, tmp_path: Path) -> None:
        kv = layers(4, seed=1)
        one = nbytes(kv)
        image = image_output(one // 32, seed=2, deep=None)  # as large as kv
        tier = DiskTier(tmp_path, int(one * 2.5), FINGERPRINT)
        tier.save(key(1, 0, 0, 0), kv)
        tier.save_image(DIGEST, image)
        tier.save(key(2, 0, 0, 0), layers(4, seed=2))
        tier.flush()
        assert tier.best(key(1, 0, 0, 0), 4)[1] == 0, "the oldest went"
        assert tier.load_image(DIGEST, one // 32) is not None  # used: newest
        tier.save(key(3, 0, 0, 0), layers(4, seed=3))
        tier.flush()
        assert tier.best(key(2, 0, 0, 0), 4)[1] == 0
        assert tier.load_image(DIGEST, one // 32) is not None
        tier.close()


def chat(image: str, question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 20},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": question},
                ],
            },
        ],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
    }


def flush(served: Served) -> None:
    disk = served.engine.disk
    assert disk is not None
    disk.flush()


def encoded(served: Served) -> tuple[int, int]:
    """Images the vision tower encoded, and those read from disk."""
    cache = served.engine.image_cache
    assert cache is not None
    return cache.held.misses, cache.held.disk_hits


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_restart_answers_from_disk_as_a_fresh_prefill(
    serve: Serve, tmp_path: Path
) -> None:
    image = image_data_uri(64, 64, seed=3)
    first, second = chat(image, "What is it?"), chat(image, "What colour is it?")
    async with serve(prompt_cache_bytes=0) as cold:
        fresh = logprobs(await cold.chat(second))
    disk = {"state_dir": str(tmp_path), "prompt_cache_bytes": 10**8}
    async with serve(**disk) as served:
        assert (await served.chat(first)).status_code == 200
        flush(served)
    assert list((tmp_path / "prompt_cache").glob("*/*.kv"))
    async with serve(**disk) as served:
        answer = await served.chat(second)
        assert encoded(served) == (0, 1), "the image's features, from disk"
    cached = answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 100, "the system prompt and the image, from disk"
    ours = logprobs(answer)
    assert len(ours) == len(fresh)
    assert max(abs(a - b) for a, b in zip(ours, fresh, strict=True)) <= TOL


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_truncated_file_after_a_restart_is_skipped_and_the_answer_exact(
    serve: Serve, tmp_path: Path
) -> None:
    image = image_data_uri(64, 64, seed=4)
    request = chat(image, "What is it?")
    async with serve(prompt_cache_bytes=0) as cold:
        fresh = logprobs(await cold.chat(request))
    disk = {"state_dir": str(tmp_path), "prompt_cache_bytes": 10**8}
    async with serve(**disk) as served:
        assert (await served.chat(request)).status_code == 200
        flush(served)
    files = list((tmp_path / "prompt_cache").glob("*/*"))
    assert {path.suffix for path in files} == {".kv", ".img"}
    for path in files:
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    async with serve(**disk) as served:
        answer = await served.chat(request)
        assert encoded(served) == (1, 0), "encoded again"
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ours = logprobs(answer)
    assert max(abs(a - b) for a, b in zip(ours, fresh, strict=True)) <= TOL


@pytest.mark.anyio
async def test_a_tiny_disk_budget_is_no_error_to_the_client(
    serve: Serve, tmp_path: Path
) -> None:
    image = image_data_uri(32, 32, seed=5)
    settings = {"state_dir": str(tmp_path), "prompt_cache_disk_bytes": 10}
    async with serve(**settings) as served:
        answer = await served.chat(chat(image, "Hi?"))
        assert answer.status_code == 200
        flush(served)
    assert not list((tmp_path / "prompt_cache").glob("*/*"))


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_restart_reads_an_image_from_disk_and_answers_exactly(
    serve: Serve, tmp_path: Path
) -> None:
    """The image tier alone (no prompt cache): after a restart the image is
    not encoded again, and the answer is a fresh one's."""
    request = chat(image_data_uri(64, 64, seed=6), "What is it?")
    async with serve(prompt_cache_bytes=0, image_cache_bytes=0) as cold:
        fresh = logprobs(await cold.chat(request))
    disk = {"state_dir": str(tmp_path), "prompt_cache_bytes": 0}
    async with serve(**disk) as served:
        assert (await served.chat(request)).status_code == 200
        assert encoded(served) == (1, 0)
        flush(served)
        (path,) = (tmp_path / "prompt_cache").glob("*/*")
        assert path.suffix == ".img"
        assert served.engine.counters().disk_cache_bytes == path.stat().st_size
    async with serve(**disk) as served:
        answer = await served.chat(request)
        assert encoded(served) == (0, 1)
    assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    ours = logprobs(answer)
    assert len(ours) == len(fresh)
    assert max(abs(a - b) for a, b in zip(ours, fresh, strict=True)) <= TOL


class TestFoldersItCannotWrite:
    """One warning line that says what to do, no traceback; the caches go
    on in memory."""

    def test_a_read_only_folder_turns_the_tier_off_at_start(
        self, tmp_path: Path
    ) -> None:
        folder = tmp_path / "prompt_cache"
        script = textwrap.dedent(
            """
            import logging, sys
            from pathlib import Path
            from mlx_pinned.server.engine.prompt_disk import DiskTier

            logging.basicConfig(format="%(levelname)s %(message)s")
            tier = DiskTier(Path(sys.argv[1]), 10**7, "f" * 32)
            print("enabled:", tier.enabled)
            """
        )
        command = [*read_only(folder), sys.executable, "-c", script, str(folder)]
        done = subprocess.run(command, capture_output=True, text=True, check=True)
        assert "enabled: False" in done.stdout
        (line,) = done.stderr.splitlines()
        assert line.startswith("WARNING the caches' disk tier off, memory only: ")
        assert f"{folder} is read-only" in line
        assert "make the folder writable and restart, or set " in line
        assert "--prompt-cache-disk-bytes 0" in line

    def test_a_folder_gone_under_it_turns_the_tier_off_once(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        folder = tmp_path / "tier"
        tier = DiskTier(folder, 10**7, FINGERPRINT)
        cache = PromptCache(10**7)
        cache.attach(tier)
        folder.rmdir()
        folder.write_bytes(b"")  # a file now: a write, and its clean-up, fail
        with caplog.at_level(logging.DEBUG, "mlx_pinned.server"):
            cache.store(key(1, 2, 3), layers(3, seed=1))
            tier.flush()
        (record,) = caplog.records
        assert record.levelno == logging.WARNING
        assert record.exc_info is None
        assert f"cannot write in {folder}" in record.getMessage()
        assert not tier.enabled
        assert cache.lookup(key(1, 2, 3, 4), 3).length == 3, "memory still serves"
        tier.close()
