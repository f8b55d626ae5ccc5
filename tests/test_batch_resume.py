"""`ds4jax batch` (in process, on the one-layer tiny model): a run that dies halfway (Ctrl-C, or an exception no
request handler catches) keeps every result it finished and a rerun writes each remaining id once; a request
whose engine step fails becomes an `internal` error result, the others complete, and a rerun retries it (once);
request failures wait for --retry-failed or an edited line. (tests/test_batch.py kills the real script with
SIGKILL; tests/test_batch_inputs.py checks flags and paths up front.)"""

from __future__ import annotations

import argparse
import json

import pytest

from ds4jax import batch
from ds4jax.generation.engine import Engine
from ds4jax.io.tokenizer import ByteTokenizer
from small_engine import one_layer_model

# two short requests finish in the first decode call, the next ones need three calls each (2 tokens per call)
ROWS = ([{"id": "short0", "prompt": [5, 6, 7], "max_new_tokens": 2}, {"id": "short1", "prompt": "hi", "max_new_tokens": 2},
         "not json"]
        + [{"id": f"long{i}", "prompt": f"prompt {i}", "max_new_tokens": 6} for i in range(4)])
IDS = ["short0", "short1", None, "long0", "long1", "long2", "long3"]


@pytest.fixture(scope="module")
def model():
    return one_layer_model()


def _args(tmp_path, out: str) -> argparse.Namespace:
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in ROWS) + "\n")
    return argparse.Namespace(input=str(src), output=str(tmp_path / out), max_new_tokens=4, temperature=0.0,
                              top_p=1.0, top_k=0, seed=0, speculative=0, max_slots=2, max_context=64,
                              prefill_chunk=8, steps_per_call=2, no_progress=True)


def _lines(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(x) for x in f.read().splitlines()]


def _failing_call(monkeypatch, n: int, exc: BaseException) -> None:
    """The n-th plain decode call of any engine raises `exc`."""
    real, calls = Engine._decode_call, [0]

    def call(self, rows):
        calls[0] += 1
        if calls[0] == n:
            raise exc
        return real(self, rows)

    monkeypatch.setattr(Engine, "_decode_call", call)


@pytest.fixture(scope="module")
def clean(model, tmp_path_factory):
    """Results of an uninterrupted run, by id."""
    args = _args(tmp_path_factory.mktemp("clean"), "out.jsonl")
    assert batch.run(args, model, ByteTokenizer()) == 0
    rows = _lines(args.output)
    assert sorted(map(str, (r["id"] for r in rows))) == sorted(map(str, IDS))
    return {r["id"]: r for r in rows}


@pytest.mark.parametrize("crash", [KeyboardInterrupt(), SystemExit(3)], ids=["ctrl-c", "uncaught"])
def test_run_dying_halfway_then_rerun_writes_every_id_once(model, clean, tmp_path, monkeypatch, crash):
    args = _args(tmp_path, "out.jsonl")
    _failing_call(monkeypatch, 3, crash)  # after the short requests finished, while long0 / long1 decode
    with pytest.raises(type(crash)):
        batch.run(args, model, ByteTokenizer())
    monkeypatch.undo()
    first = _lines(args.output)
    assert sorted(map(str, (r["id"] for r in first))) == ["None", "short0", "short1"]  # nothing finished lost

    assert batch.run(args, model, ByteTokenizer()) == 0
    final = _lines(args.output)
    assert final[: len(first)] == first
    assert sorted(map(str, (r["id"] for r in final))) == sorted(map(str, IDS))  # each id exactly once
    for r in final:
        want = clean[r["id"]]
        assert (r["tokens"], r["finish_reason"], r["error"]) == (want["tokens"], want["finish_reason"],
                                                                 want["error"]), r["id"]


def test_failing_request_becomes_an_error_result_and_a_rerun_retries_it_once(model, clean, tmp_path, monkeypatch):
    args = _args(tmp_path, "out.jsonl")
    _failing_call(monkeypatch, 2, RuntimeError("device fell over"))  # long0 and long1's first decode call
    assert batch.run(args, model, ByteTokenizer()) == 0
    monkeypatch.undo()
    first = _lines(args.output)
    by_id = {r["id"]: r for r in first}
    assert sorted(map(str, by_id)) == sorted(map(str, IDS)) and len(first) == len(IDS)
    for rid in ("long0", "long1"):
        assert by_id[rid]["error"] == "internal" and "device fell over" in by_id[rid]["message"], by_id[rid]
        assert by_id[rid]["tokens"] == clean[rid]["tokens"][:1]  # what was made before the failure is kept
    for rid in ("short0", "short1", "long2", "long3"):
        assert by_id[rid]["error"] is None and by_id[rid]["tokens"] == clean[rid]["tokens"], rid
    assert by_id[None]["error"] == "invalid_request" and "line 3" in by_id[None]["message"]

    # the rerun is killed while it retries: the internal rows were removed first, nothing finished is lost
    _failing_call(monkeypatch, 1, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        batch.run(args, model, ByteTokenizer())
    monkeypatch.undo()
    kept = [r for r in first if r["error"] != "internal"]
    assert _lines(args.output) == kept

    assert batch.run(args, model, ByteTokenizer()) == 0  # internal failures are retried by default
    final = _lines(args.output)
    assert final[: len(kept)] == kept and len(final) == len(IDS)  # each id exactly once, retried ones at the end
    for r in final:
        assert (r["tokens"], r["error"]) == (clean[r["id"]]["tokens"], clean[r["id"]]["error"]), r["id"]
    with open(args.output, "rb") as f:
        done = f.read()
    assert batch.run(args, model, ByteTokenizer()) == 0
    with open(args.output, "rb") as f:
        assert f.read() == done  # nothing left to retry: the file is not touched


def test_request_failures_wait_for_retry_failed_or_an_edited_line(model, tmp_path, capsys):
    args = _args(tmp_path, "out.jsonl")
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join([json.dumps({"id": "a", "prompt": [5, 6], "max_new_tokens": 2}).encode(),
                                b"\xff\xfe not utf-8",
                                json.dumps({"id": "long", "prompt": "x", "max_new_tokens": 500}).encode(),
                                json.dumps({"id": "b", "prompt": [7], "max_new_tokens": 2}).encode()]) + b"\n")
    assert batch.run(args, model, ByteTokenizer()) == 0
    first = {r["key"]: r for r in _lines(args.output)}
    assert first["line:2"]["error"] == "invalid_request" and "line 2: not valid UTF-8" in first["line:2"]["message"]
    assert first['id:"long"']["error"] == "prompt_too_long" and first['id:"a"']["error"] is None
    assert "2 failed because of their request (--retry-failed runs them again)" in capsys.readouterr().err

    assert batch.run(args, model, ByteTokenizer()) == 0  # nothing outside the requests failed: nothing to redo
    assert {r["key"]: r for r in _lines(args.output)} == first

    args.retry_failed = True  # every failed row runs again, and still appears once
    assert batch.run(args, model, ByteTokenizer()) == 0
    again = _lines(args.output)
    assert sorted(r["key"] for r in again) == sorted(first) and [r["key"] for r in again[:2]] == ['id:"a"', 'id:"b"']

    args.retry_failed = False  # fixing the lines is enough: an edited line's failure is retried by default
    src.write_text("\n".join(json.dumps(r) for r in [{"id": "a", "prompt": [5, 6], "max_new_tokens": 2},
                                                     {"id": "fixed", "prompt": "y", "max_new_tokens": 2},
                                                     {"id": "long", "prompt": "x", "max_new_tokens": 5},
                                                     {"id": "b", "prompt": [7], "max_new_tokens": 2}]) + "\n")
    assert batch.run(args, model, ByteTokenizer()) == 0
    final = {r["key"]: r for r in _lines(args.output)}
    assert len(_lines(args.output)) == 4 and "line:2" not in final
    assert all(r["error"] is None for r in final.values()), final
    assert final['id:"a"'] == first['id:"a"']  # a finished result is final


def test_progress_bar_shows_tokens_per_second(model, tmp_path, capsys):
    args = _args(tmp_path, "out.jsonl")
    args.no_progress = False
    assert batch.run(args, model, ByteTokenizer()) == 0
    err = capsys.readouterr().err
    assert f"{len(IDS)}/{len(IDS)}" in err and "tok_s=" in err, err[-500:]


def test_a_prefill_step_too_big_for_the_free_memory_names_the_flags(model, monkeypatch):
    from ds4jax.commands.engine_options import build_engine
    from ds4jax.errors import DeviceMemoryError
    from ds4jax.runtime import memory

    answers = iter([1 << 40])  # the pools fit; then 1000 bytes are left for the step
    monkeypatch.setattr(memory, "free_bytes", lambda device: next(answers, 1000))
    args = argparse.Namespace(max_slots=2, max_context=64, speculative=0, prefill_chunk=8, steps_per_call=2)
    with pytest.raises(DeviceMemoryError, match=r"a prefill step's working memory \(16 tokens: --prefill-tokens"):
        build_engine(model, args)
