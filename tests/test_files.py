"""drafters/files.replace_directory, the one atomic-directory writer (exports, final/, the target caches)."""

import os

import pytest

from drafters.files import replace_directory


def write(directory, name, text):
    with open(os.path.join(directory, name), "w") as f:
        f.write(text)


def read(directory, name):
    with open(os.path.join(directory, name)) as f:
        return f.read()


def test_success_replaces_and_failure_leaves_the_old_directory(tmp_path):
    final = str(tmp_path / "out")
    with replace_directory(final) as tmp:
        write(tmp, "a", "first")
    with pytest.raises(RuntimeError), replace_directory(final) as tmp:
        write(tmp, "a", "second")
        raise RuntimeError("refused")
    assert os.listdir(final) == ["a"] and read(final, "a") == "first"
    with replace_directory(final) as tmp:
        write(tmp, "b", "third")
    assert os.listdir(final) == ["b"]
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temporary or old directory left behind


def test_keep_leaves_a_directory_another_process_completed(tmp_path):
    final = str(tmp_path / "cache")
    complete = lambda directory: os.path.isfile(os.path.join(directory, "done"))  # noqa: E731
    os.makedirs(final)
    write(final, "partial", "")  # a leftover without the marker is replaced
    with replace_directory(final, keep=complete) as tmp:
        write(tmp, "done", "ours")
    assert os.listdir(final) == ["done"] and read(final, "done") == "ours"
    with replace_directory(final, keep=complete) as tmp:
        write(tmp, "done", "theirs")  # the same content from a second process: the first copy stays
    assert read(final, "done") == "ours"
    assert sorted(os.listdir(tmp_path)) == ["cache"]


def test_the_directory_mode_follows_the_umask(tmp_path):
    previous = os.umask(0o022)
    try:
        with replace_directory(str(tmp_path / "out")) as tmp:
            write(tmp, "a", "x")
    finally:
        os.umask(previous)
    assert os.stat(tmp_path / "out").st_mode & 0o777 == 0o755
