"""`ds4jax batch` rejects bad flags and paths up front (exit 2, naming the flag or the file) before a model is
loaded or a row is written: engine flags (also on a Namespace built by hand), sampling defaults, unreadable or
binary inputs, outputs that are devices, directories, not ours or not writable, and a full disk mid-run. Nothing
here compiles a model: the checks run before the model loads (`_load` fails the test if reached)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re

import pytest

from ds4jax import batch, batch_files, cli
from ds4jax.errors import UsageError


@pytest.fixture(autouse=True)
def no_model(monkeypatch):
    def load(args):
        raise AssertionError("the model must not be loaded: the check should have failed first")

    monkeypatch.setattr(cli, "_load", load)


def _input(tmp_path) -> str:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"id": 1, "prompt": "hi"}) + "\n")
    return str(src)


def _args(tmp_path, **changes) -> argparse.Namespace:
    args = cli.build_parser().parse_args(["batch", _input(tmp_path), str(tmp_path / "out.jsonl"), "--no-progress"])
    for k, v in changes.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("argv, says", [
    (["--steps-per-call", "0"], "--steps-per-call: must be >= 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk: must be >= 1"),
    (["--max-slots", "-1"], "--max-slots: must be >= 1"),
    (["--temperature", "-1"], "--temperature: must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens: must be >= 1"),
    (["--top-p", "0"], "--top-p: must be in (0, 1]"),
    (["--top-k", "-1"], "--top-k: must be >= 0"),
    (["--max-new-tokens", "4096"], "--max-new-tokens=4096: leaves no room for a prompt"),
])
def test_bad_flags_exit_2_before_any_row(tmp_path, capsys, argv, says):
    out = tmp_path / "out.jsonl"
    code = cli.main(["batch", _input(tmp_path), str(out), *argv])
    assert code == 2 and says in capsys.readouterr().err and not out.exists()


@pytest.mark.parametrize("attr, value, says", [
    ("steps_per_call", 0, "--steps-per-call=0: must be >= 1"),
    ("prefill_chunk", 0, "--prefill-chunk=0: must be >= 1"),
    ("max_context", "big", "--max-context='big': must be an integer"),
    ("temperature", -1.0, "--temperature=-1.0: must be >= 0"),
    ("max_new_tokens", 0, "--max-new-tokens=0: must be in [1"),
    ("top_p", float("nan"), "--top-p=nan"),
    ("seed", 2**70, "--seed="),
])
def test_bad_values_on_a_namespace_name_the_flag(tmp_path, attr, value, says):
    args = _args(tmp_path, **{attr: value})
    with pytest.raises(UsageError) as e:
        batch.run(args)
    assert says in str(e.value) and not os.path.exists(args.output)


def test_engine_flags_the_model_cannot_take_name_the_flag():
    from bad_inputs import small_config
    from ds4jax.commands.engine_options import build_engine
    from ds4jax.model.handle import Model

    model = Model(config=small_config(), params={})  # no mtp.* weights; the engine refuses before reading any
    args = argparse.Namespace(max_slots=1, max_context=32, speculative=2, prefill_chunk=8, steps_per_call=1)
    with pytest.raises(UsageError, match="--speculative=2: the engine cannot be built: .*MTP"):
        build_engine(model, args)


def _binary(p):
    p.write_bytes(b"\x7fELF\x00\x01" + bytes(range(256)))


def _utf16(p):
    p.write_text('{"id": 1, "prompt": "hi"}\n', encoding="utf-16")


@pytest.mark.parametrize("make, says", [
    (None, "INPUT.jsonl=.*: does not exist"),
    (os.mkdir, "is a directory, not a regular file"),
    (lambda p: os.symlink("/dev/zero", p), "is a link to /dev/zero, a character device"),
    (_binary, "looks binary"),
    (_utf16, "UTF-16"),
])
def test_bad_input_files_exit_2(tmp_path, capsys, make, says):
    src = tmp_path / "in.jsonl"
    if make is not None:
        make(src)
    code = cli.main(["batch", str(src), str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err
    assert code == 2 and re.search(says, err) and "internal" not in err, err


@pytest.mark.parametrize("output, says", [
    ("/dev/zero", "is a character device, not a regular file"),
    ("DIR", "is a directory, not a regular file"),
    ("/proc/version", "cannot be written"),
    ("/proc/no-such-dir/out.jsonl", "cannot be created"),
    ("/proc/out.jsonl", "no file can be created in /proc"),
])
def test_bad_output_paths_exit_2(tmp_path, capsys, output, says):
    code = cli.main(["batch", _input(tmp_path), str(tmp_path) if output == "DIR" else output])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "OUTPUT.jsonl=" in err and "internal" not in err, err


def test_an_output_that_is_not_ours_is_left_alone(tmp_path, capsys):
    src = _input(tmp_path)
    before = open(src, "rb").read()
    code = cli.main(["batch", src, src])  # the arguments swapped: the input given as the output
    assert code == 2 and "line 1 is not a ds4jax batch result" in capsys.readouterr().err
    assert open(src, "rb").read() == before


def test_scan_output_rewrites_atomically(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    rows = [{"key": "a", "error": None}, {"key": "b", "error": "internal"}, {"key": "c", "error": None}]
    out.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"key": "d", "err')  # torn by a kill
    os.chmod(out, 0o640)
    seen = batch_files.scan_output(str(out), lambda row: row.error == "internal")
    assert seen.done == {"a", "c"} and seen.retried == {"internal": 1}
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in (rows[0], rows[2]))
    assert os.stat(out).st_mode & 0o777 == 0o640 and os.listdir(tmp_path) == ["out.jsonl"]

    def crash(*a):  # a kill between the copy and the rename leaves the old file whole and no temporary file
        raise OSError(errno.EIO, "Input/output error")

    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(batch_files.os, "replace", crash)
    with pytest.raises(UsageError, match="it is unchanged"):
        batch_files.scan_output(str(out), lambda row: row.error == "internal")
    assert out.read_text() == "".join(json.dumps(r) + "\n" for r in rows) and os.listdir(tmp_path) == ["out.jsonl"]


def test_a_full_disk_is_a_usage_error_and_keeps_whole_lines(tmp_path, monkeypatch):
    out = batch_files.Appender(str(tmp_path / "out.jsonl"))
    out.write({"key": "a"})
    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(batch_files.os, "fsync", full)
    out.write({"key": "b"})
    out.write({"key": "c"})  # after a failure nothing more is attempted
    out.close()
    assert isinstance(out.failed, UsageError) and "No space left on device" in str(out.failed)
    assert (tmp_path / "out.jsonl").read_text().count('"key": "c"') == 0


@pytest.mark.parametrize("error, by_default", [(None, False), ("internal", True), ("cancelled", True),
                                               ("non_finite", True), ("invalid_request", False),
                                               ("prompt_too_long", False), ("capacity_exceeded", False)])
def test_which_rows_a_rerun_retries(error, by_default):
    row = batch_files.Row(1, 'id:"a"', error, "d1")
    same, edited = {'id:"a"': "d1"}, {'id:"a"': "d2"}
    assert batch._retry(row, retry_failed=False, digests=same) is by_default
    assert batch._retry(row, retry_failed=True, digests=same) is (error is not None)
    assert batch._retry(row, retry_failed=False, digests=edited) is (error is not None)  # the line was fixed
    assert batch._retry(row, retry_failed=True, digests={}) is False  # the id left the input: its row stays
    line = batch_files.Row(2, "line:2", "invalid_request", "d1")  # a line that could not be parsed
    assert [batch._retry(line, retry_failed=False, digests=d) for d in ({"line:2": "d1"}, {"line:2": "d2"}, {})] == [
        False, True, True]


@pytest.mark.parametrize("raw, says", [
    ("{not json", "invalid JSON"),
    ('{"id": 1, "prompt": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),  # past Python's recursion
    ("[1, 2]", "expected an object"),
    ('{"id": 1, "prompt": 5}', "'prompt' must be"),
])
def test_a_bad_line_is_that_line_s_error(raw, says):
    """A line the reader cannot use becomes that line's error row (the run goes on), never an exception: a line
    nested deeper than Python's JSON parser recurses once raised RecursionError and ended the whole batch."""
    key, _, problem = batch._parse(7, raw, {}, set())
    assert isinstance(problem, str) and problem.startswith("line 7:") and says in problem, problem
    assert key.startswith(("line:7", "id:"))
