"""`gpuflex-hub job submit` with the wrong files: one clear line each, never a traceback.

The CLI checks a dataset by content and by name before anything is uploaded; the hub
decides by content and names what it got (JSON, a bare .npy) instead of a CSV complaint.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

import aiohttp
import numpy as np
import pytest
from gpuflex.hub import cli

from tests.helpers import submit_job, write_digits

NOWHERE = "http://127.0.0.1:9"  # nothing listens: a file check must answer before any request


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    train, val, spec = write_digits(tmp_path / "d")
    out = {"train": train, "val": val, "spec": spec}
    out["json"] = tmp_path / "train.json"
    out["json"].write_text('{"x": [[1, 2]], "y": [0]}')
    out["csv"] = tmp_path / "train.csv"
    out["csv"].write_text("a,b,label\n1,2,0\n3,4,1\n")
    out["txt"] = tmp_path / "train.txt"
    out["txt"].write_text("a,b,label\n1,2,0\n3,4,1\n")
    out["npy_named"] = tmp_path / "renamed.npy"
    out["npy_named"].write_bytes(train.read_bytes())  # an .npz archive called .npy
    out["npz_csv"] = tmp_path / "csv-inside.npz"
    out["npz_csv"].write_text("a,b,label\n1,2,0\n")
    out["bare_npy"] = tmp_path / "x.npz"
    buf = io.BytesIO()
    np.save(buf, np.zeros((3, 2), dtype=np.float32))
    out["bare_npy"].write_bytes(buf.getvalue())
    return out


def _submit(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli.main(["job", "submit", *argv, "--hub", NOWHERE, "--token", "gft_x"])
    err = capsys.readouterr().err
    return code, err


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        ("missing", "no such file"),
        ("dir", "is a directory"),
        ("json", "the file is JSON"),
        ("txt", "ends in '.txt'"),
        ("npy_named", "the content is an .npz archive"),
        ("npz_csv", "the name says .npz but the content is CSV text"),
        ("bare_npy", "single .npy array"),
    ],
)
def test_submit_names_the_file_problem_in_one_line(files, tmp_path, capsys, case, expected):
    train = {"missing": tmp_path / "nonexistent.csv", "dir": tmp_path}.get(case) or files[case]
    code, err = _submit(capsys, str(files["spec"]), "--train", str(train))
    assert code == 1
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert expected in err, err
    assert str(train) in err
    if case not in ("missing", "dir"):
        assert ".npz (arrays x and y" in err and ".csv" in err, err  # the accepted formats


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_submit_unreadable_file(files, capsys):
    files["csv"].chmod(0)
    code, err = _submit(capsys, str(files["spec"]), "--train", str(files["csv"]))
    assert code == 1 and "not readable" in err and "Traceback" not in err


def test_submit_missing_spec_and_val(files, tmp_path, capsys):
    code, err = _submit(capsys, str(tmp_path / "nope.toml"), "--train", str(files["train"]))
    assert code == 1 and "spec" in err and "no such file" in err
    code, err = _submit(capsys, str(files["spec"]), "--train", str(files["train"]), "--val", str(tmp_path / "v.npz"))
    assert code == 1 and "--val" in err and "no such file" in err


async def test_hub_names_json_and_npy_uploads(running_hub, files):
    """The hub decides by content: JSON and a bare .npy are named, not 'CSV has no label column'."""
    async with aiohttp.ClientSession() as s:
        for key, expected in (("json", "the file is JSON"), ("bare_npy", "single .npy array")):
            r = await submit_job(s, running_hub, files["spec"], files[key])
            body = await r.json()
            assert r.status == 422 and body["error"] == "bad_dataset", body
            assert expected in body["detail"] and "has no label column" not in body["detail"], body
        r = await submit_job(s, running_hub, files["spec"], files["npy_named"])  # content decides on the hub
        assert r.status == 201, await r.text()


def test_zip_that_is_not_npz_is_named(tmp_path):
    """A zip archive without x/y is still refused by the npz reader with its own message."""
    from gpuflex.hub.dataset import read_arrays
    from gpuflex.hub.errors import Unprocessable

    path = tmp_path / "other.npz"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("readme.txt", "hello")
    with pytest.raises(Unprocessable, match="'x' and 'y'"):
        read_arrays(path, label_column="label", what="train")
