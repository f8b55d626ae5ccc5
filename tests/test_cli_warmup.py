"""``ds4jax warmup``: builds the engine ``ds4jax batch`` builds from the same flags, compiles its programs and
prints them as a table (`programs.WarmupReport`); bad flags exit 2 with one line. On the seeded random tiny model."""

from __future__ import annotations

import jax
import pytest

from ds4jax.cli import main
from ds4jax.generation.programs import Program, WarmupReport
from random_default import random_default  # noqa: F401 (autouse: the random tiny model, cache off)


def test_report_table_lists_every_program_and_the_total():
    report = WarmupReport((Program("prefill", 2, 64, 3, 1, 1.5, 2.0), Program("decode", 8, 8, 1, 0, 0.5, 0.75),
                           Program("slot-reset", 0, 0, 0, 0, 0.0, 0.01)))
    assert (report.compiles, report.disk_hits, report.compile_seconds, report.seconds) == (4, 1, 2.0, 2.76)
    lines = str(report).splitlines()
    assert lines[0].split() == ["program", "shape", "compiles", "from", "cache", "compile", "s", "wall", "s"]
    assert lines[2].split() == ["prefill", "2", "rows", "x", "64", "tokens", "3", "1", "1.50", "2.00"]
    assert lines[3].split()[:6] == ["decode", "8", "rows", "x", "8", "steps"]
    assert lines[4].split()[:3] == ["slot-reset", "every", "slot"]
    assert lines[-1].split() == ["total", "(3", "programs)", "4", "1", "2.00", "2.76"]


def test_warmup_prints_the_engine_programs(capsys):
    # 2 slots, 16 prompt tokens per prefill call: one prefill row bucket (2 rows would get 8 < 16 tokens each)
    code = main(["warmup", "--max-slots", "2", "--max-context", "64", "--prefill-chunk", "16", "--prefill-tokens",
                 "16", "--steps-per-call", "4"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = out.splitlines()
    rules = [i for i, line in enumerate(lines) if set(line) == {"-"}]
    rows = [line.split() for line in lines[rules[0] + 1:rules[1]]]
    assert [r[0] for r in rows] == ["prefill", "decode", "decode", "fingerprint", "restore", "snapshot-save",
                                    "snapshot-load", "slot-reset"]
    assert rows[0][1:5] == ["1", "row", "x", "16"] and rows[2][1:5] == ["2", "rows", "x", "4"]
    assert lines[rules[1] + 1].startswith("total (8 programs)")
    # the fused programs (prefill, 2 decodes, restore) were compiled on a pool: the elapsed line says on how many
    assert lines[rules[1] + 2].startswith("elapsed ") and "compiled on" in lines[rules[1] + 2]
    # the cache JAX really uses (the test run's own, tests/run_cache.py, or none)
    assert f"compilation cache: {jax.config.jax_compilation_cache_dir or 'off'}" in err and "8 programs" in err


@pytest.mark.parametrize("flags, message", [
    (["--max-slots", "0"], "--max-slots: must be >= 1"),
    (["--speculative", "-1"], "--speculative: must be >= 0"),
    (["--max-context", "1000000"], "exceeds cfg.max_position_embeddings"),
])
def test_bad_engine_flags_exit_2(capsys, flags, message):
    assert main(["warmup", *flags]) == 2
    assert message in capsys.readouterr().err
