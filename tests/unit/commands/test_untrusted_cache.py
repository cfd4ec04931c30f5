"""What the cache reads back is untrusted input (a shared or planted folder): a kept answer is
replayed without terminal control sequences, and a malformed one is planned again; a folder that
another user owns or that group or others may write is not used; ``cache clear`` never follows a
link; ``HF_MEMKIT_NO_CACHE`` is on, off, or refused."""

from __future__ import annotations

import json
import os
import stat
import zlib

import pytest

from hf_memkit import HfMemkitError
from hf_memkit import _store as store
from tests.unit.commands.test_kept_answers import _run

QUESTION = ["plan", "gpt2", "--gpu", "T4", "--seq-len", "256", "--target-batch", "8"]


@pytest.fixture(autouse=True)
def fresh_warnings(monkeypatch):
    """Each test sees the cache folder's warnings afresh (they are said once per process)."""
    monkeypatch.setattr(store, "_WARNED", set())


def _tamper(folder, change) -> None:
    """Rewrite the one entry in ``folder`` with ``change(value)`` as its value."""
    [p] = folder.glob("*" + store.SUFFIX)
    entry = json.loads(zlib.decompress(p.read_bytes()))
    entry["value"] = change(entry["value"])
    p.write_bytes(zlib.compress(json.dumps(entry).encode()))


# ----------------------------------------------------------------------------------------------
# Kept answers
# ----------------------------------------------------------------------------------------------


def test_a_kept_answer_replays_its_exit_code(kept, capsys, tmp_path):
    """A tight plan exits 3; its replay exits 3 too (it used to say 0)."""
    from hf_memkit.commands import _answers

    key = _answers.question_key(main_args(["plan", "gpt2", "--gpu", "L4", "--seq-len", "64",
                                           "--target-batch", "2"]))
    for code in (3, 1):
        with _answers.recording(key) as rec:
            print(f"answer {code}")
        rec.keep(code)
        capsys.readouterr()
        assert _answers.replay(key, "plan") == 3       # exit 1 is never kept: 3 stays
        assert capsys.readouterr().out == "answer 3\n"


def main_args(argv):
    from hf_memkit.commands.main import build_parser

    return build_parser().parse_args(argv)


ATTACK = "\x1b]0;pwned\x07\x1b[2J\x1b[1;1Hattacker text\r\x00\x7f\x9b2J\x1bP+q\x1b\\"


def test_a_tampered_answer_is_replayed_without_control_sequences(kept, capsys, tmp_path):
    _, out1, _ = _run(QUESTION, capsys)
    _tamper(tmp_path / "cache" / "answers",
            lambda v: dict(v, stdout=ATTACK + "\x1b[1mbold\x1b[0m\t\n" + v["stdout"],
                           stderr="\x1b]52;c;cGF5bG9hZA==\x07"))
    rc, out, err = _run(QUESTION, capsys)
    assert rc == 0 and len(kept) == 1 and "kept from" in err  # replayed, not planned
    assert out == "attacker text2Jbold\t\n" + out1           # no escape of any kind
    assert "\x1b]" not in err and "cGF5" not in err


@pytest.mark.parametrize("change", [
    lambda v: dict(v, stdout=5),                                # not text
    lambda v: [v["stdout"]],                                    # not an object
    lambda v: {"stdout": v["stdout"], "stderr": ""},            # a field missing
    lambda v: dict(v, extra="x"),                               # a field never written
    lambda v: dict(v, when="\x1b]0;pwned\x07"),                 # not a time
    lambda v: dict(v, code=1),                                  # a code never kept
], ids=["number", "list", "missing", "extra", "when", "code"])
def test_a_malformed_answer_is_planned_again_and_overwritten(kept, capsys, tmp_path, change):
    _, out1, _ = _run(QUESTION, capsys)
    _tamper(tmp_path / "cache" / "answers", change)
    rc, out, err = _run(QUESTION, capsys)
    assert rc == 0 and len(kept) == 2 and "kept from" not in err and out == out1
    rc, out, err = _run(QUESTION, capsys)                       # the entry was rewritten
    assert rc == 0 and len(kept) == 2 and "kept from" in err and out == out1


# ----------------------------------------------------------------------------------------------
# The folders
# ----------------------------------------------------------------------------------------------

posix = pytest.mark.skipif(not hasattr(os, "getuid"), reason="owners and modes are POSIX")


@pytest.fixture
def traces(monkeypatch, tmp_path):
    """The trace store, with one entry, in a folder of this test's own."""
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(store, "_WARNED", set())
    s = store.TraceStore()
    s.put("k", [1, 2])
    assert s.get("k") == [1, 2]
    return s


@posix
@pytest.mark.parametrize("which, mode", [("root", 0o777), ("root", 0o770), ("traces", 0o722)])
def test_a_folder_others_may_write_is_not_used(traces, tmp_path, which, mode):
    folder = tmp_path / "cache" / "traces" if which == "traces" else tmp_path / "cache"
    folder.chmod(mode)
    with pytest.warns(UserWarning) as w:
        assert traces.get("k") is None
        traces.put("other", 1)
        assert traces.get("other") is None
    assert len(w) == 1                                          # once per process
    msg = str(w[0].message)
    assert f"the cache folder {folder} is writable by group or others (mode {mode:#o})" in msg
    assert f"chmod go-w {folder}" in msg and "HF_MEMKIT_CACHE to a folder you own" in msg
    assert not traces.path("other").exists()
    assert traces.info().problem is not None
    folder.chmod(0o700)
    assert traces.get("k") == [1, 2]                            # fixed: used again


@posix
def test_a_folder_of_another_user_is_not_used(traces, monkeypatch):
    uid = os.getuid()
    monkeypatch.setattr(os, "getuid", lambda: uid + 1)
    with pytest.warns(UserWarning, match=f"belongs to uid {uid}, not to you \\(uid {uid + 1}\\)"
                                         ".*set HF_MEMKIT_CACHE to a folder you own"):
        assert traces.get("k") is None


@posix
def test_the_cli_plans_again_when_the_cache_is_writable_by_others(kept, capsys, tmp_path):
    _run(QUESTION, capsys)
    (tmp_path / "cache").chmod(0o777)
    rc, _, err = _run(QUESTION, capsys)
    assert rc == 0 and len(kept) == 2 and "kept from" not in err
    assert f"warning: the cache folder {tmp_path / 'cache'} is writable" in err


@posix
def test_the_folders_hf_memkit_creates_are_its_users_own(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "a" / "b"))
    store.TraceStore().put("k", 1)
    for folder in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "b" / "traces"):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder


# ----------------------------------------------------------------------------------------------
# cache clear
# ----------------------------------------------------------------------------------------------


def test_cache_clear_never_follows_a_link(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("HF_MEMKIT_CACHE", str(tmp_path / "cache"))
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.trace").write_bytes(b"someone else's")
    (other / "b.trace").write_bytes(b"someone else's too")
    (tmp_path / "cache").mkdir(mode=0o700)
    (tmp_path / "cache" / "traces").symlink_to(other)           # the folder: a link
    (tmp_path / "cache" / "answers").mkdir(mode=0o700)
    (tmp_path / "cache" / "answers" / "x.trace").symlink_to(other / "b.trace")  # an entry
    rc, out, err = _run(["cache", "clear"], capsys)
    assert rc == 0 and "removed 0 traces" in out
    assert (other / "a.trace").read_bytes() == b"someone else's"
    assert (other / "b.trace").read_bytes() == b"someone else's too"
    assert not (tmp_path / "cache" / "traces").is_symlink()     # the link itself is gone
    assert not (tmp_path / "cache" / "answers" / "x.trace").is_symlink()
    assert f"{tmp_path / 'cache' / 'traces'} was a link (to {other})" in err


# ----------------------------------------------------------------------------------------------
# HF_MEMKIT_NO_CACHE
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value, on", [
    ("1", False), ("TRUE", False), (" yes ", False), ("on", False),
    ("", True), ("0", True), ("false", True), ("No", True), ("off", True),
])
def test_the_no_cache_switch_reads_the_usual_spellings(monkeypatch, value, on):
    monkeypatch.setenv(store.NO_CACHE_ENV, value)
    assert store.enabled() is on


@pytest.mark.parametrize("value", ["maybe", "2", "disable"])
def test_a_no_cache_switch_neither_on_nor_off_is_refused(monkeypatch, capsys, value):
    monkeypatch.setenv(store.NO_CACHE_ENV, value)
    with pytest.raises(HfMemkitError) as e:
        store.enabled()
    msg = str(e.value)
    assert f"HF_MEMKIT_NO_CACHE={value!r} is neither on nor off" in msg
    assert "allowed: 1, true, yes, on (no cache) or 0, false, no, off" in msg
    rc, _, err = _run(QUESTION, capsys)
    assert rc == 2 and f"HF_MEMKIT_NO_CACHE={value!r}" in err
