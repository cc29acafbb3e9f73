"""Disk faults said in words: which errors are about a full or read-only folder."""

from __future__ import annotations

import errno
import os

import pytest

from engine import disk
from engine.errors import DiskFault


@pytest.mark.parametrize(("number", "cause", "words"), [
    (errno.ENOSPC, disk.FULL, "is full. Free some space"),
    (errno.EDQUOT, disk.FULL, "is full"),
    (errno.EROFS, disk.READ_ONLY, "read-only disk"),
    (errno.EACCES, disk.UNWRITABLE, "may not write to"),
])
def test_a_write_errno_becomes_a_fault_naming_the_folder(tmp_path, number, cause, words):
    error = OSError(number, os.strerror(number), str(tmp_path / "kv" / "x.json"))
    fault = disk.fault_of(error, retry="send the message again")
    assert isinstance(fault, DiskFault) and fault.cause == cause
    assert words in str(fault) and str(tmp_path / "kv") in str(fault)
    assert str(fault).endswith("send the message again.")


def test_errors_not_about_a_disk_are_left_alone():
    assert disk.fault_of(OSError(errno.ENOENT, "No such file")) is None
    assert disk.fault_of(RuntimeError("boom")) is None
    assert disk.fault_of(ValueError("[Compile::eval_cpu] Failed to")) is None


def test_the_probe_sees_a_folder_that_takes_files(tmp_path):
    assert disk.probe(tmp_path) is None


@pytest.mark.parametrize(("number", "cause"), [(errno.ENOSPC, disk.FULL),
                                               (errno.EROFS, disk.READ_ONLY),
                                               (errno.EIO, disk.UNWRITABLE)])
def test_the_probe_names_why_a_folder_takes_no_file(tmp_path, monkeypatch, number, cause):
    # Root writes through permission bits, so the refusal is the OS's, injected.
    def refuse(*args, **kwargs):
        raise OSError(number, os.strerror(number))

    monkeypatch.setattr(disk.os, "fsync", refuse)
    assert disk.probe(tmp_path) == cause


def test_a_compile_failure_whose_folder_is_fine_now_still_names_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    fault = disk.fault_of(RuntimeError(
        '[Compile::eval_cpu] Failed to compile function f: "g++ -o x.so", the output is: '
        "cc1plus: fatal error: x.cpp: No such file or directory"))
    assert fault is not None and str(tmp_path) in str(fault) and "g++" not in str(fault)
