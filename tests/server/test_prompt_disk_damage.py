"""Damaged files in the caches' disk tier (``engine/prompt_disk.py``,
``engine/disk_format.py``): whatever a file holds (random bytes, a length
past its end, a cut, a valid file under another entry's name), the start-up
scan and each load skip it with one warning line and no traceback, remove
it, and serve nothing but what was written under that key. Through the app,
every answer of a server on a damaged tier is a fresh server's.

``HYPOTHESIS_PROFILE=nightly`` tries many more damages and seeds.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import random
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_vlm.models.cache import RotatingKVCache

from mlx_pinned.server.engine.checkpoints import State, check, take, tree_arrays
from mlx_pinned.server.engine.prompt_disk import DiskTier
from mlx_pinned.testing import image_data_uri

from .conftest import MODEL
from .kit import TOL, WAIT, Serve, Served, logprobs

FINGERPRINT = "f" * 32
KEYS = {
    "a": np.arange(1, 7, dtype=np.int64),
    "b": np.arange(40, 44, dtype=np.int64),
    "s": np.arange(70, 79, dtype=np.int64),  # an entry that keeps a state
}
WINDOW = 4  # the state's layer: a sliding window of 4 tokens
DIGESTS = {"a": b"\x01" * 16, "b": b"\x02" * 16}
ROWS = 4
_LENGTH = struct.Struct("<Q")


def _kv(tokens: int, seed: int) -> list[Any]:
    mx.random.seed(seed)
    out = [
        (mx.random.normal((1, 2, tokens, 8)), mx.random.normal((1, 2, tokens, 8)))
        for _ in range(2)
    ]
    mx.eval(out)
    return out


def _stateful(seed: int) -> tuple[list[Any], dict[int, list[Any]]]:
    """An entry of a KV layer and a sliding-window layer, with states at its
    middle and end: its KV and its marks."""
    mx.random.seed(seed)
    tokens = len(KEYS["s"])
    kv = [(mx.random.normal((1, 2, tokens, 8)), mx.random.normal((1, 2, tokens, 8)))]
    marks: dict[int, list[Any]] = {}
    window = RotatingKVCache(WINDOW)
    for at in (5, tokens):
        step = at - window.offset
        window.update_and_fetch(
            mx.random.normal((1, 2, step, 8)), mx.random.normal((1, 2, step, 8))
        )
        taken = take([window], None)
        assert taken is not None
        marks[at] = [None, taken[1][0]]
    mx.eval(kv, [flat_state(marks)])
    return [*kv, None], marks


def flat_state(marks: dict[int, list[Any]]) -> list[Any]:
    return [
        a
        for at in sorted(marks)
        for s in marks[at]
        if s
        for a in tree_arrays(s.payload)
    ]


def check_window(index: int, state: State, position: int) -> None:
    """The model's check of a state, for a model of a KV layer and a window."""
    if index != 1:
        raise ValueError("not a state's layer")
    check(RotatingKVCache(WINDOW), state, position)


def _image(seed: int) -> Any:
    mx.random.seed(seed)
    features = mx.random.normal((ROWS, 8))
    deep = [mx.random.normal((ROWS, 8))]
    mx.eval(features, deep)
    return features, deep


@functools.cache
def originals() -> tuple[dict[str, bytes], dict[str, Any]]:
    """The bytes of three valid ``.kv`` files (one with states) and two valid
    ``.img`` files by name, and what each holds."""
    held: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as folder:
        tier = DiskTier(Path(folder), 10**7, FINGERPRINT)
        for seed, which in enumerate(DIGESTS):
            kv = _kv(len(KEYS[which]), seed)
            tier.save(KEYS[which], kv)
            tier.save_image(DIGESTS[which], image := _image(seed))
            held[f"kv-{which}"], held[f"img-{which}"] = kv, image
        kv, marks = _stateful(7)
        tier.save(KEYS["s"], kv, marks)
        held["kv-s"] = [*flat(kv[:1]), *flat_state(marks)]
        tier.close()
        files = {path.name: path.read_bytes() for path in Path(folder).iterdir()}
    return files, held


def name_of(entry: str) -> str:
    kind, which = entry.split("-")
    if kind == "img":
        return DIGESTS[which].hex() + ".img"
    digest = hashlib.blake2b(KEYS[which].tobytes(), digest_size=16)
    return digest.hexdigest() + ".kv"


def flat(tree: Any) -> list[Any]:
    if isinstance(tree, (list, tuple)):
        return [leaf for item in tree for leaf in flat(item)]
    return [tree]


def same(ours: Any, theirs: Any) -> bool:
    mine, yours = flat(ours), flat(theirs)
    return len(mine) == len(yours) and all(
        a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()
        for a, b in zip(mine, yours, strict=True)
    )


class Warnings(logging.Handler):
    """The server's WARNING records, kept (a handler of our own: hypothesis
    runs many examples in one test, and pytest's ``caplog`` is per test)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def about(self, name: str) -> list[logging.LogRecord]:
        return [r for r in self.records if name in r.getMessage()]


@contextmanager
def warnings() -> Iterator[Warnings]:
    handler = Warnings()
    logger = logging.getLogger("mlx_pinned.server")
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)


def one_line_each(handler: Warnings, names: list[str]) -> None:
    """Each of ``names`` was warned about once, in one line, and nothing
    else was warned about."""
    for name in names:
        (record,) = handler.about(name)
        assert record.levelno == logging.WARNING
        assert record.exc_info is None
        assert "\n" not in record.getMessage()
    assert len(handler.records) == len(names)


def served(tier: DiskTier, entry: str) -> Any:
    """What ``tier`` serves for ``entry``'s key (None: nothing)."""
    kind, which = entry.split("-")
    if kind == "img":
        return tier.load_image(DIGESTS[which], ROWS)
    key = KEYS[which]
    name, length = tier.best(key, len(key))
    if name is None:
        return None
    loaded = tier.load(name, check_window)
    if loaded is None:
        return None
    assert length == len(key)
    assert list(loaded[0]) == list(key), "served under another entry's key"
    if which == "s":
        return [*flat([kv for kv in loaded[1] if kv]), *flat_state(loaded[2])]
    return loaded[1]


def rewrite_header(raw: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """``raw`` with its header changed by ``change`` and its checksum made
    right again: a file that only the bounds on its fields can refuse."""
    (length,) = _LENGTH.unpack(raw[:8])
    header = json.loads(raw[8 : 8 + length])
    payload = raw[8 + length :]
    del header["checksum"]
    change(header)
    digest = hashlib.blake2b(json.dumps(header, sort_keys=True).encode())
    digest.update(payload)
    text = json.dumps({**header, "checksum": digest.hexdigest()}).encode()
    return _LENGTH.pack(len(text)) + text + payload


def populate(folder: Path) -> None:
    for name, raw in originals()[0].items():
        (folder / name).write_bytes(raw)


class TestTheScan:
    @pytest.mark.parametrize("length", [2**64 - 1, 2**63 + 5, 2**40, "size"])
    @pytest.mark.parametrize("entry", ["kv-a", "img-a"])
    def test_a_length_past_the_files_end_is_skipped_and_removed(
        self, tmp_path: Path, length: int | str, entry: str
    ) -> None:
        populate(tmp_path)
        path = tmp_path / name_of(entry)
        raw = path.read_bytes()
        size = len(raw) - 7 if length == "size" else length
        assert isinstance(size, int)
        path.write_bytes(_LENGTH.pack(size) + raw[8:])
        with warnings() as handler:
            tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        one_line_each(handler, [path.name])
        assert not path.exists()
        assert served(tier, entry) is None
        other = entry.replace("-a", "-b")
        assert same(served(tier, other), originals()[1][other])

    @pytest.mark.parametrize("kind", ["kv", "img"])
    def test_a_valid_file_under_another_entrys_name_is_skipped_and_removed(
        self, tmp_path: Path, kind: str
    ) -> None:
        populate(tmp_path)
        victim = tmp_path / name_of(f"{kind}-a")
        victim.write_bytes((tmp_path / name_of(f"{kind}-b")).read_bytes())
        with warnings() as handler:
            tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        one_line_each(handler, [victim.name])
        assert not victim.exists()
        assert served(tier, f"{kind}-a") is None
        assert same(served(tier, f"{kind}-b"), originals()[1][f"{kind}-b"])


class TestALoad:
    @pytest.mark.parametrize("kind", ["kv", "img"])
    def test_a_valid_file_swapped_in_while_serving_is_not_served(
        self, tmp_path: Path, kind: str
    ) -> None:
        populate(tmp_path)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        victim = tmp_path / name_of(f"{kind}-a")
        victim.write_bytes((tmp_path / name_of(f"{kind}-b")).read_bytes())
        with warnings() as handler:
            assert served(tier, f"{kind}-a") is None
        one_line_each(handler, [victim.name])
        assert not victim.exists()
        assert same(served(tier, f"{kind}-b"), originals()[1][f"{kind}-b"])

    @pytest.mark.parametrize("entry", ["kv-a", "img-a"])
    def test_a_huge_length_written_while_serving_is_skipped_and_removed(
        self, tmp_path: Path, entry: str
    ) -> None:
        populate(tmp_path)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        path = tmp_path / name_of(entry)
        path.write_bytes(_LENGTH.pack(2**64 - 1) + path.read_bytes()[8:])
        with warnings() as handler:
            assert served(tier, entry) is None
        one_line_each(handler, [path.name])
        assert not path.exists()


def _state_of(header: dict[str, Any], mark: int) -> dict[str, Any]:
    state: dict[str, Any] = header["marks"][mark][1][1]["dict"]
    return state


#: A state entry's header, changed so that only the model's check refuses it.
UNFIT: dict[str, Callable[[dict[str, Any]], None]] = {
    "another window": lambda h: _state_of(h, 0)["meta_state"]["tuple"].__setitem__(
        1, str(WINDOW * 2)
    ),
    "another position": lambda h: h["marks"][0].__setitem__(0, 6),
    "a mark past its end": lambda h: h["marks"][1].__setitem__(0, 99),
    "arrays out of order": lambda h: _state_of(h, 0)["state"]["tuple"].reverse(),
    "a state of a KV layer": lambda h: h["marks"][0][1].reverse(),
    "a state of no layer": lambda h: h["marks"][0][1].append(None),
    "too deep": lambda h: _state_of(h, 0).__setitem__(
        "extra", functools.reduce(lambda x, _: {"list": [x]}, range(20), None)
    ),
    "no marks": lambda h: h.__setitem__("marks", []),
}


class TestAState:
    @pytest.mark.parametrize("unfit", list(UNFIT))
    def test_a_state_the_model_cannot_take_is_skipped_and_removed(
        self, tmp_path: Path, unfit: str
    ) -> None:
        populate(tmp_path)
        path = tmp_path / name_of("kv-s")
        path.write_bytes(rewrite_header(path.read_bytes(), UNFIT[unfit]))
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        with warnings() as handler:
            assert served(tier, "kv-s") is None
        one_line_each(handler, [path.name])
        assert not path.exists()

    def test_a_state_entry_resumes_only_at_its_marks(self, tmp_path: Path) -> None:
        populate(tmp_path)
        tier = DiskTier(tmp_path, 10**7, FINGERPRINT)
        key = KEYS["s"]
        assert tier.best(key[:7], 7)[1] == 5
        assert tier.best(key[:4], 4) == (None, 0)
        assert same(served(tier, "kv-s"), originals()[1]["kv-s"])


# -- the fuzz: any damage to any one file -------------------------------------

ENTRIES = ["kv-a", "kv-b", "kv-s", "img-a", "img-b"]
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
_HUGE = st.integers(min_value=-(2**70), max_value=2**70)


def _set_field(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        header[field] = value

    return change


def _set_shape(index: int, dim: int, value: Any) -> Callable[[dict[str, Any]], None]:
    def change(header: dict[str, Any]) -> None:
        spec = header["arrays"][index % len(header["arrays"])]
        spec[1][dim % len(spec[1])] = value

    return change


@st.composite
def damages(draw: st.DrawFn) -> tuple[str, Callable[[bytes], bytes]]:
    """A name for a damage, and the damage (raw bytes in, raw bytes out)."""
    kind = draw(
        st.sampled_from(
            ["bytes", "length", "cut", "flip", "field", "shape", "swap", "empty"]
        )
    )
    if kind == "bytes":
        junk = draw(st.binary(max_size=4096))
        return kind, lambda raw: junk
    if kind == "length":
        length = draw(st.integers(min_value=0, max_value=2**64 - 1))
        return kind, lambda raw: _LENGTH.pack(length) + raw[8:]
    if kind == "cut":
        share = draw(st.floats(min_value=0, max_value=1, exclude_max=True))
        return kind, lambda raw: raw[: int(len(raw) * share)]
    if kind == "flip":
        spots = draw(st.lists(st.floats(0, 1, exclude_max=True), min_size=1))
        mask = draw(st.integers(1, 255))

        def flip(raw: bytes) -> bytes:
            out = bytearray(raw)
            for spot in spots:
                out[int(len(out) * spot)] ^= mask
            return bytes(out)

        return kind, flip
    if kind == "field":
        field = draw(
            st.sampled_from(
                ["format", "model", "arrays", "key", "layers", "marks", "deep"]
            )
        )
        value = draw(_JSON | _HUGE)
        return f"field {field}", lambda raw: rewrite_header(
            raw, _set_field(field, value)
        )
    if kind == "shape":
        index, dim, value = (
            draw(st.integers(0, 8)),
            draw(st.integers(0, 4)),
            draw(_HUGE),
        )
        return kind, lambda raw: rewrite_header(raw, _set_shape(index, dim, value))
    if kind == "swap":
        other = draw(st.sampled_from(ENTRIES))
        return f"swap {other}", lambda raw: originals()[0][name_of(other)]
    return kind, lambda raw: b""


@settings(max_examples=max(settings().max_examples, 100))
@given(entry=st.sampled_from(ENTRIES), damage=damages(), while_serving=st.booleans())
def test_any_damage_to_a_file_is_skipped_removed_and_never_served(
    entry: str, damage: tuple[str, Callable[[bytes], bytes]], while_serving: bool
) -> None:
    _, hurt = damage
    files, held = originals()
    with tempfile.TemporaryDirectory() as name, warnings() as handler:
        folder = Path(name)
        populate(folder)
        path = folder / name_of(entry)
        damaged = hurt(files[path.name])
        if while_serving:
            tier = DiskTier(folder, 10**7, FINGERPRINT)
            path.write_bytes(damaged)
        else:
            path.write_bytes(damaged)
            tier = DiskTier(folder, 10**7, FINGERPRINT)
        answers = {each: served(tier, each) for each in ENTRIES}
        again = {each: served(tier, each) for each in ENTRIES}  # nothing new
        if damaged == files[path.name]:
            return
        for each in ENTRIES:
            if each != entry:
                assert same(answers[each], held[each]), each
        for answer in (answers[entry], again[entry]):
            assert answer is None or same(answer, held[entry])
        if answers[entry] is None:
            one_line_each(handler, [path.name])
            assert not path.exists()
        else:  # a change that leaves the same entry (a rewritten header)
            assert not handler.records


# -- through the app: a damaged tier never changes an answer --------------------

#: Seeds of the damages per test: a few here, many more under nightly.
SEEDS = range(2 if settings().max_examples <= 100 else 20)
_QUESTIONS = ("What is it?", "What colour is it?", "Where is it?")


def chat(image_seed: int, question: str) -> dict[str, Any]:
    image = {
        "type": "image_url",
        "image_url": {"url": image_data_uri(64, 64, seed=image_seed)},
    }
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": "You are a careful assistant. " * 12},
            {"role": "user", "content": [image, {"type": "text", "text": question}]},
        ],
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": True,
    }


#: Two images, one of them asked about twice.
REQUESTS = [chat(11, _QUESTIONS[0]), chat(12, _QUESTIONS[1]), chat(11, _QUESTIONS[2])]


async def answers(served: Served) -> list[tuple[list[str], list[float]]]:
    out = []
    with anyio.fail_after(WAIT):  # a hang fails, however slow the machine
        for body in REQUESTS:
            response = await served.chat(body)
            content = response.json()["choices"][0]["logprobs"]["content"]
            out.append(([entry["token"] for entry in content], logprobs(response)))
    return out


def assert_same(ours: list[Any], fresh: list[Any]) -> None:
    for (tokens, probs), (fresh_tokens, fresh_probs) in zip(ours, fresh, strict=True):
        assert tokens == fresh_tokens
        assert max(abs(a - b) for a, b in zip(probs, fresh_probs, strict=True)) <= TOL


def damage_all(folder: Path, rng: random.Random) -> dict[Path, tuple[str, bytes]]:
    """Damage every file of ``folder`` one way or another; each file's damage
    and the bytes it holds now. The scan finds those of :data:`AT_START`."""
    files = {path: path.read_bytes() for path in folder.iterdir()}
    done = {}
    for path, raw in files.items():
        kind = rng.choice(["bytes", "length", "cut", "swap", "flip", "layers"])
        others = [p for p in files if p != path and p.suffix == path.suffix]
        if kind == "swap" and not others:
            kind = "cut"
        if kind == "layers" and path.suffix != ".kv":
            kind = "flip"
        if kind == "bytes":
            damaged = rng.randbytes(rng.randrange(4096))
        elif kind == "length":
            damaged = _LENGTH.pack(rng.getrandbits(64)) + raw[8:]
        elif kind == "cut":
            damaged = raw[: rng.randrange(len(raw))]
        elif kind == "swap":
            damaged = files[rng.choice(others)]
        elif kind == "flip":  # in the arrays: only a load's checksum sees it
            spot = rng.randrange(len(raw) - 64, len(raw))
            damaged = raw[:spot] + bytes([raw[spot] ^ 0xFF]) + raw[spot + 1 :]
        else:  # a header with a sound checksum: only its fields' bounds refuse it
            damaged = rewrite_header(raw, _set_field("layers", [[2**62, -1]]))
        path.write_bytes(damaged)
        done[path] = kind, damaged
    return done


#: The damages the start-up scan finds (the others, when a load reads them).
AT_START = {"bytes", "length", "cut", "swap"}


def tier_folder(state: Path) -> Path:
    (folder,) = (state / "prompt_cache").iterdir()
    return folder


def flush(served: Served) -> None:
    assert served.engine.disk is not None
    served.engine.disk.flush()


@pytest.mark.anyio
@pytest.mark.parametrize("prompt_cache", [True, False], ids=["kv+img", "img"])
async def test_every_answer_on_a_damaged_tier_is_a_fresh_servers(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture, prompt_cache: bool
) -> None:
    async with serve(prompt_cache_bytes=0, image_cache_bytes=0) as cold:
        fresh = await answers(cold)
    budget = 10**8 if prompt_cache else 0
    warm = tmp_path / "warm"
    async with serve(state_dir=str(warm), prompt_cache_bytes=budget) as served:
        assert_same(await answers(served), fresh)
        flush(served)
    suffixes = {path.suffix for path in tier_folder(warm).iterdir()}
    assert suffixes == ({".kv", ".img"} if prompt_cache else {".img"})
    for seed in SEEDS:
        state = tmp_path / f"seed-{seed}"
        shutil.copytree(warm, state)
        damaged = damage_all(tier_folder(state), random.Random(seed))
        caplog.clear()
        with caplog.at_level(logging.WARNING, "mlx_pinned"):
            async with serve(state_dir=str(state), prompt_cache_bytes=budget) as served:
                for path, (kind, _) in damaged.items():
                    assert path.exists() == (kind not in AT_START), (path, kind)
                assert_same(await answers(served), fresh)
                flush(served)
        check_warnings(caplog, damaged)


@pytest.mark.anyio
async def test_files_damaged_while_serving_never_change_an_answer(
    serve: Serve, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async with serve(prompt_cache_bytes=0, image_cache_bytes=0) as cold:
        fresh = await answers(cold)
    warm = tmp_path / "warm"
    async with serve(state_dir=str(warm)) as served:
        await answers(served)
        flush(served)
    for seed in SEEDS:
        state = tmp_path / f"seed-{seed}"
        shutil.copytree(warm, state)
        caplog.clear()
        with caplog.at_level(logging.WARNING, "mlx_pinned"):
            async with serve(state_dir=str(state)) as served:
                damaged = damage_all(tier_folder(state), random.Random(seed))
                assert_same(await answers(served), fresh)
                # Damaged and served again: nothing is left to read but what
                # this server wrote since.
                assert_same(await answers(served), fresh)
                flush(served)
        check_warnings(caplog, damaged)


def check_warnings(
    caplog: pytest.LogCaptureFixture, damaged: dict[Path, tuple[str, bytes]]
) -> None:
    """One warning line for each damaged file that is gone (removed, perhaps
    written again since), none for one still there (never looked up), and
    nothing else of note."""
    records = [r for r in caplog.records if r.levelno >= logging.WARNING]
    for path, (_, held) in damaged.items():
        about = [r for r in records if path.name in r.getMessage()]
        if path.exists() and path.read_bytes() == held:
            assert not about, path
            continue
        (record,) = about
        assert record.levelno == logging.WARNING
        assert record.exc_info is None
        assert "skipped and removed" in record.getMessage()
    named = [r for r in records if any(p.name in r.getMessage() for p in damaged)]
    assert named == records
