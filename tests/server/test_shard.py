"""Sharding: the plan's checks in process, and sharded against whole models
over a real ring group of two ranks on loopback, started by ``mlx.launch``."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlx_pinned.server.cli import main
from mlx_pinned.server.engine.shard import PLANS, ShardError, plan
from mlx_pinned.testing import tiny_lm_path, tiny_vlm_path

HERE = Path(__file__).parent


def lazy_model(path: Path) -> Any:
    from mlx_vlm.utils import load_model

    return load_model(path, lazy=True, strict=False)


class TestPlan:
    def test_the_tiny_families_split_over_two_ranks(self) -> None:
        for path in (tiny_vlm_path(), tiny_vlm_path("qwen2_5_vl"), tiny_lm_path()):
            assert callable(plan(lazy_model(path), 2))

    def test_heads_that_do_not_divide_are_refused_by_layer(self) -> None:
        with pytest.raises(
            ShardError,
            match=r"3 ranks: layer 0 has 4 attention heads, not a multiple of 3",
        ):
            plan(lazy_model(tiny_vlm_path()), 3)

    def test_a_family_without_a_plan_is_refused(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delitem(PLANS, "qwen3_vl")
        with pytest.raises(ShardError, match="qwen3_vl family cannot be split"):
            plan(lazy_model(tiny_vlm_path()), 2)

    def test_serving_without_a_group_exits_2(
        self, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name in ("MLX_RANK", "MLX_HOSTFILE"):
            monkeypatch.delenv(name, raising=False)
        status = main(["serve", "--demo", "--distributed", "tensor", "--port", "0"])
        assert status == 2
        assert "start every rank with mlx.launch" in caplog.text


def consecutive_free_ports(count: int) -> int:
    """A first port such that it and the next ``count - 1`` are free now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count > 65535:
            continue
        sockets = [socket.socket() for _ in range(count)]
        try:
            for offset, sock in enumerate(sockets):
                sock.bind(("127.0.0.1", first + offset))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
        return first
    raise AssertionError("no free ports")


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_sharded_models_generate_as_whole_ones(tmp_path: Path) -> None:
    launch = Path(sys.executable).parent / "mlx.launch"
    command = [str(launch), "--backend", "ring", "-n", "2", "--python", sys.executable]
    command += ["--starting-port", str(consecutive_free_ports(2))]
    command += [str(HERE / "sharded_run.py"), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=150)
    # mlx.launch exits 0 even when a rank fails: each rank's file says it ran.
    results = []
    for rank in range(2):
        found = tmp_path / f"rank{rank}.json"
        assert found.exists(), done.stdout + done.stderr
        results.append(json.loads(found.read_text()))
    assert all(r["size"] == 2 for r in results)
    assert all(r["sum"] == 3.0 for r in results)  # all_sum on the MLX thread
    for family in ("qwen3_vl", "qwen3"):
        whole, sharded = results[0][family]["whole"], results[0][family]["sharded"]
        for alone, split in zip(whole, sharded, strict=True):
            assert len(alone) == 16
            assert [t for t, _ in split] == [t for t, _ in alone]
            gaps = [abs(a - b) for (_, a), (_, b) in zip(split, alone, strict=True)]
            assert max(gaps) < 1e-4, (family, gaps)
        # Each rank computed the same tokens; each holds less than the whole.
        assert results[1][family]["sharded"] == sharded
        total, part = results[0][family]["parameters"]
        assert part < total
