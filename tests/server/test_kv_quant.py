"""The quantized KV cache (``kv_bits``): its settings, its distance from the
float cache, and the batch's exactness under it.

The tiny models' heads have 16 values, fewer than the smallest group
``mx.quantize`` takes (32), so these tests widen them: the same tiny text
and vision models with heads of 64 values (new random attention weights,
the rest as it was). Against the float cache the answers move by what
quantization rounds (a bound per bit width, measured in docs/engine.md);
between two runs under the same bits (batched and alone, rows joining and
leaving, the prompt cache on and off, a prompt in chunks or at once) they
are the same, up to float32 rounding.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned import MLXThread
from mlx_pinned.server import cli, engine
from mlx_pinned.server.config import ServerConfig, SettingError
from mlx_pinned.server.config_file import read_config_file
from mlx_pinned.server.engine import BatchEngine, LoadedModel
from mlx_pinned.server.engine.kv_quant import KVQuant
from mlx_pinned.server.engine.speculation import Speculation
from mlx_pinned.server.engine.state import BatchState
from mlx_pinned.server.events import (
    FinalEvent,
    GenerationParams,
    Grammar,
    SamplingParams,
)
from mlx_pinned.server.http.served_models import BatchGate
from mlx_pinned.testing import tiny_lm_path, tiny_vlm_path

from .kit import (
    TOL,
    Collector,
    Event,
    Request,
    deadline,
    drive_rows,
    max_logprob_difference,
    request,
    tokens,
    widen,
)
from .openapi import CheckedTransport

pytestmark = pytest.mark.anyio

MODEL = "tiny"
HEAD = 64
#: The largest gap of a chosen token's logprob to the float cache's, over
#: the tokens both runs chose alike, per bit width (measured: docs/engine.md).
GAP_BOUND = {8: 0.1, 4: 1.0}
BUDGET = 64 * 1024 * 1024


@pytest.fixture(scope="module")
def wide_paths(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("wide")
    return {
        "text": widen(tiny_lm_path(), root / "text"),
        "vision": widen(tiny_vlm_path(), root / "vision"),
        # Deeper than two layers: mlx-vlm leaves the last one unquantized.
        "deep": widen(tiny_lm_path(), root / "deep", layers=3),
    }


@pytest.fixture(scope="module")
def wide(thread: MLXThread, wide_paths: dict[str, Path]) -> dict[str, LoadedModel]:
    return {
        kind: thread.run_sync(engine.load, path) for kind, path in wide_paths.items()
    }


def text_request(index: int, max_tokens: int, **params: Any) -> Request:
    return request(index, max_tokens, sizes=(None,), **params)


def one(kind: str, index: int, max_tokens: int, **params: Any) -> Request:
    """Request ``index``: a text one, or on the vision model one with its
    own image size (some with none)."""
    make = request if kind == "vision" else text_request
    return make(index, max_tokens, **params)


def engine_of(
    loaded: LoadedModel, thread: MLXThread, quant: KVQuant | None, **options: Any
) -> BatchEngine:
    """An engine whose KV cache is quantized as ``quant`` says (None: not)."""
    state = functools.partial(BatchState, kv_quant=quant)
    return BatchEngine(loaded, thread, make_state=state, **options)


async def run(batch: BatchEngine, req: Request) -> list[Event]:
    async with batch.stream(*req) as stream:
        return [event async for event in stream]


def final(events: list[Event]) -> FinalEvent:
    last = events[-1]
    assert isinstance(last, FinalEvent)
    return last


def gap_while_alike(got: list[Event], expected: list[Event]) -> tuple[float, int]:
    """The largest gap of a token's logprob between the runs (over the top
    tokens both list) at each position while the tokens before it were the
    same, and how many positions that is (the first always is)."""
    worst, alike = 0.0, 0
    for ours, theirs in zip(tokens(got), tokens(expected), strict=True):
        assert ours.logprobs is not None
        assert theirs.logprobs is not None
        mine = {t: lp for t, lp, _ in ours.logprobs.top}
        other = {t: lp for t, lp, _ in theirs.logprobs.top}
        shared = mine.keys() & other.keys()
        assert shared  # the top tokens are much the same
        worst = max(worst, *(abs(mine[t] - other[t]) for t in shared))
        alike += 1
        if ours.logprobs.token != theirs.logprobs.token:
            break
    return worst, alike


class TestSettings:
    @pytest.mark.parametrize(
        ("setting", "value", "message"),
        [
            ("kv_bits", 3, "kv_bits must be 4 or 8"),
            ("kv_bits", 16, "kv_bits must be 4 or 8"),
            ("kv_group_size", 16, "kv_group_size must be 32, 64 or 128"),
            ("kv_group_size", 100, "kv_group_size must be 32, 64 or 128"),
        ],
    )
    def test_out_of_range_is_refused(
        self, setting: str, value: int, message: str
    ) -> None:
        with pytest.raises(SettingError, match=message) as info:
            ServerConfig(model="m", **{setting: value})
        assert info.value.setting == setting

    def test_the_accepted_values(self) -> None:
        for bits in (4, 8):
            for group in (32, 64, 128):
                config = ServerConfig(model="m", kv_bits=bits, kv_group_size=group)
                assert (config.kv_bits, config.kv_group_size) == (bits, group)
        assert ServerConfig(model="m").kv_bits is None

    def test_not_with_tensor_parallelism(self) -> None:
        with pytest.raises(SettingError, match="kv_bits is not offered with"):
            ServerConfig(model="m", kv_bits=8, distributed="tensor")

    def test_a_model_may_set_its_own(self) -> None:
        config = ServerConfig(model=("a", "b"), model_settings=({"kv_bits": 8}, {}))
        assert (config.for_model(0).kv_bits, config.for_model(1).kv_bits) == (8, None)

    def test_a_config_files_model_sets_its_own(self, tmp_path: Path) -> None:
        file = tmp_path / "models.toml"
        file.write_text(
            "kv_group_size = 32\n[[models]]\npath = 'a/b'\nkv_bits = 4\n"
            "[[models]]\npath = 'c/d'\n"
        )
        read = read_config_file(file)
        assert read.settings == {"kv_group_size": 32}
        assert read.model_settings == ({"kv_bits": 4}, {})

    def test_the_command_line_names_the_flag(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        with pytest.raises(SystemExit) as info:
            cli.main(["serve", "some/model", "--kv-bits", "3"])
        assert info.value.code == 2
        assert "--kv-bits must be 4 or 8" in capsys.readouterr().err

    def test_heads_the_group_does_not_divide_are_refused_at_load(
        self, thread: MLXThread, loaded: LoadedModel
    ) -> None:
        with pytest.raises(SettingError, match="--kv-group-size") as info:
            engine_of(loaded, thread, KVQuant(8))
        assert "heads of 16 values" in str(info.value)
        assert "no group size (32, 64 or 128) divides it: serve it without " in str(
            info.value
        )
        assert str(loaded.path) in str(info.value)

    def test_a_sliding_window_model_is_refused_at_load(self, thread: MLXThread) -> None:
        gemma = thread.run_sync(engine.load, tiny_vlm_path("gemma3"))
        with pytest.raises(SettingError, match="--kv-bits") as info:
            engine_of(gemma, thread, KVQuant(8, 32))
        assert "RotatingKVCache" in str(info.value)
        assert "gemma3" in str(info.value)


@pytest.mark.slow
class TestDistanceFromTheFloatCache:
    @pytest.mark.parametrize("kind", ["text", "vision"])
    @pytest.mark.parametrize("bits", [8, 4])
    async def test_logprobs_within_the_bound_of_the_bit_width(
        self, thread: MLXThread, wide: dict[str, LoadedModel], kind: str, bits: int
    ) -> None:
        reqs = [one(kind, i, 12, top_logprobs=5) for i in range(4)]
        plain = BatchEngine(wide[kind], thread)
        quantized = engine_of(wide[kind], thread, KVQuant(bits))
        gaps, compared = [], 0
        for req in reqs:
            got, expected = await run(quantized, req), await run(plain, req)
            gap, alike = gap_while_alike(got, expected)
            gaps.append(gap)
            compared += alike
        assert 0 < max(gaps) <= GAP_BOUND[bits]  # quantized, and close
        print(f"kv_bits {bits}, {kind}: gap {max(gaps):.4f} over {compared} tokens")


@pytest.mark.slow
class TestExactUnderTheSameBits:
    @pytest.mark.parametrize("kind", ["text", "vision", "deep"])
    @pytest.mark.parametrize("bits", [8, 4])
    async def test_batched_with_joins_and_leaves_equals_alone(
        self, thread: MLXThread, wide: dict[str, LoadedModel], kind: str, bits: int
    ) -> None:
        quant = KVQuant(bits)
        # Rows 1 and 2 outlast the turns the loop may run ahead of a busy
        # event loop (READ_AHEAD): still decoding when row 0's end is read.
        lengths = (6, 80, 72, 12, 18)
        reqs = [one(kind, i, n, top_logprobs=2) for i, n in enumerate(lengths)]
        alone = [await run(engine_of(wide[kind], thread, quant), req) for req in reqs]
        batch = engine_of(wide[kind], thread, quant)
        gate = BatchGate(max_num_seqs=5, max_pending=5)
        runs = [Collector(thread, batch, gate, req) for req in reqs]
        async with deadline() as group:
            for each in runs[:3]:  # joining one by one, mid-decode
                group.start_soon(each.run)
                await each.two_tokens.wait()
            await runs[0].done.wait()  # 0 left; 3 and 4 join after it
            assert not runs[1].done.is_set()
            group.start_soon(runs[3].run)
            group.start_soon(runs[4].run)
        worst = max(
            max_logprob_difference(each.events, expected)
            for each, expected in zip(runs, alone, strict=True)
        )
        assert worst <= TOL
        assert batch.statistics().peak_active >= 3

    @pytest.mark.parametrize("kind", ["vision", "deep"])
    @pytest.mark.parametrize("bits", [8, 4])
    async def test_prompt_cache_on_equals_off(
        self, thread: MLXThread, wide: dict[str, LoadedModel], kind: str, bits: int
    ) -> None:
        quant = KVQuant(bits)
        on = engine_of(wide[kind], thread, quant, prompt_cache_bytes=BUDGET)
        off = engine_of(wide[kind], thread, quant)
        (params, images) = one(kind, 0, 8, top_logprobs=2)
        messages = list(params.messages)
        for turn in range(3):
            asked = GenerationParams(
                tuple(messages),
                max_tokens=8,
                sampling=SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
            )
            cached = await run(on, (asked, images))
            fresh = await run(off, (asked, images))
            assert max_logprob_difference(cached, fresh) <= TOL
            if turn:
                assert final(cached).cached_tokens > final(cached).prompt_tokens // 2
            answer = "".join(e.text for e in tokens(fresh))
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
            ]
        assert on.prompt_cache.statistics().hits >= 2

    @pytest.mark.parametrize("kind", ["text", "vision", "deep"])
    @pytest.mark.parametrize("bits", [8, 4])
    async def test_a_prompt_in_chunks_equals_it_at_once(
        self, thread: MLXThread, wide: dict[str, LoadedModel], kind: str, bits: int
    ) -> None:
        quant = KVQuant(bits)
        long = "A long question about trees, clouds and roads. " * 6
        req = one(kind, 0, 10, prompts=(long,), top_logprobs=2)
        chunked = engine_of(wide[kind], thread, quant, prefill_step_size=16)
        whole = engine_of(wide[kind], thread, quant)
        got, expected = await run(chunked, req), await run(whole, req)
        assert final(got).prompt_tokens > 3 * 16  # four chunks or more
        assert max_logprob_difference(got, expected) <= TOL
        assert chunked.statistics().prefill_passes > whole.statistics().prefill_passes


class TestGrammarSpeculation:
    async def test_steps_cut_back_answer_as_alone(
        self, thread: MLXThread, wide: dict[str, LoadedModel]
    ) -> None:
        # Grammar rows drawn unmasked (no logprobs) are checked after; a
        # refused one has the step's quantized cache entries cut back
        # (trim) and the step built again, with rows joining meanwhile.
        schema = {"type": "object", "properties": {"name": {"type": "string"}}}
        grammar = Grammar("json_schema", json.dumps(schema))
        reqs = [text_request(i, 24, logprobs=False, grammar=grammar) for i in range(3)]
        loaded, quant = wide["text"], KVQuant(8)

        def drive(reqs: list[Request], joins: list[int]) -> list[list[int]]:
            return drive_rows(BatchState(loaded, kv_quant=quant), reqs, joins)

        masked = [text_request(i, 24, logprobs=True, grammar=grammar) for i in range(3)]

        def run() -> tuple[list[list[int]], list[list[int]], int]:
            solo = [drive([req], [0])[0] for req in reqs]
            # Reading logprobs, a row is always masked: never cut back.
            assert [drive([req], [0])[0] for req in masked] == solo
            rebuilt = 0
            method = Speculation.rebuild

            def counted(self: Speculation, *args: Any) -> Any:
                nonlocal rebuilt
                rebuilt += 1
                return method(self, *args)

            Speculation.rebuild = counted  # type: ignore[method-assign]
            try:
                staggered = drive(reqs, [0, 3, 7])
            finally:
                Speculation.rebuild = method  # type: ignore[method-assign]
            return solo, staggered, rebuilt

        solo, staggered, rebuilt = await thread.run(run)
        assert staggered == solo
        assert rebuilt > 0


class TestBytes:
    async def test_a_token_takes_half_the_bytes_or_fewer(
        self, thread: MLXThread, wide: dict[str, LoadedModel]
    ) -> None:
        per_token = {}
        for bits in (None, 8, 4):
            quant = None if bits is None else KVQuant(bits)
            batch = engine_of(wide["text"], thread, quant)
            assert batch.counters().kv_bytes_per_token == 0  # nothing measured yet
            await run(batch, text_request(0, 4))
            per_token[bits] = batch.counters().kv_bytes_per_token
            # What the gate charges by, measured at load, is what rows take.
            assert batch.facts.kv_bytes_per_token == per_token[bits]
        # float32: 2 layers x 2 heads x 64 values x (keys, values) x 4 bytes.
        assert per_token[None] == 2 * 2 * HEAD * 2 * 4
        assert per_token[8] <= per_token[None] / 2
        assert per_token[4] <= per_token[8] * 0.6

    async def test_a_deeper_model_keeps_its_last_layer_in_floats(
        self, thread: MLXThread, wide: dict[str, LoadedModel]
    ) -> None:
        batch = engine_of(wide["deep"], thread, KVQuant(8))
        await run(batch, text_request(0, 4))
        assert batch.facts.kv_bytes_per_token == batch.counters().kv_bytes_per_token
        values = 2 * HEAD * 2  # a layer's, per token: 2 heads, keys and values
        # Two layers of a byte a value plus a float32 scale and bias per 64
        # values, and the last one in float32 (mlx-vlm's rule).
        assert batch.counters().kv_bytes_per_token == 2 * values * 1.125 + values * 4

    async def test_the_prompt_cache_holds_the_quantized_bytes(
        self, thread: MLXThread, wide: dict[str, LoadedModel]
    ) -> None:
        held = {}
        for bits in (None, 8):
            quant = None if bits is None else KVQuant(bits)
            batch = engine_of(wide["text"], thread, quant, prompt_cache_bytes=BUDGET)
            await run(batch, text_request(1, 6))
            held[bits] = batch.prompt_cache.statistics().bytes
        assert 0 < held[8] <= held[None] / 2

    async def test_health_and_metrics_report_it(
        self, wide_paths: dict[str, Path], lifespan: Any
    ) -> None:
        import httpx

        from mlx_pinned.server import create_app

        seen = {}
        for bits in (None, 8):
            app = create_app(wide_paths["text"], served_model_name=MODEL, kv_bits=bits)
            transport = CheckedTransport(httpx.ASGITransport(app=app))
            async with (
                lifespan(app),
                httpx.AsyncClient(transport=transport, base_url="http://t") as client,
            ):
                body = {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "Hello there."}],
                    "max_tokens": 4,
                }
                assert (await client.post("/v1/chat/completions", json=body)).is_success
                health = (await client.get("/health")).json()["models"][MODEL]
                metrics = (await client.get("/metrics")).text
            line = f'mlx_pinned_kv_cache_bytes_per_token{{model="{MODEL}"}}'
            (sample,) = [m for m in metrics.splitlines() if m.startswith(line)]
            assert float(sample.split()[-1]) == health["kv_bytes_per_token"]
            seen[bits] = health["kv_bytes_per_token"]
        assert 0 < seen[8] <= seen[None] / 2


@pytest.mark.slow
def test_a_model_the_flag_cannot_take_fails_start_up_with_its_reason() -> None:
    # The server exits 3, the status of a failed load, its log line naming
    # the reason (uvicorn still logs the failed start-up's traceback).
    command = [sys.executable, "-m", "mlx_pinned.server", "serve"]
    command += [str(tiny_vlm_path("gemma3")), "--kv-bits", "8", "--port", "0"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stderr
    (line,) = [x for x in done.stderr.splitlines() if "failed:" in x]
    assert "--kv-bits" in line
