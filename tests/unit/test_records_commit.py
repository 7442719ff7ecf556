"""The commit a record cites (``fsdp_cudagraph.checker.records.commit``): HEAD, marked ``+changes`` where tracked
files differ from it, so that a record of code that was never committed does not cite a commit as if it ran it."""

import subprocess

from fsdp_cudagraph.checker.records import commit, versions


def _git(cwd, *args):
    return subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_commit_is_head_and_says_when_tracked_files_changed(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.chdir(tmp_path)
    assert commit() == head
    (tmp_path / "new.py").write_text("untracked\n")  # untracked files are not the code that ran
    assert commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")
    assert commit() == head + "+changes" and versions()["commit"] == head + "+changes"
    monkeypatch.setenv("GIT_COMMIT", "abc1234")  # a copy without .git passes it in
    assert commit() == "abc1234"


def test_commit_outside_git_is_unknown(tmp_path, monkeypatch):
    monkeypatch.delenv("GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.chdir(tmp_path)
    assert commit() == "unknown"
