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
from gpuflex.hub.ops import cli

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
    out["zip_parquet"] = tmp_path / "train.parquet"  # a zip of something else under another name
    with zipfile.ZipFile(out["zip_parquet"], "w") as z:
        z.writestr("part-0.csv", "a,b,label\n1,2,0\n")
    out["zip_npz"] = tmp_path / "other.npz"
    with zipfile.ZipFile(out["zip_npz"], "w") as z:
        z.writestr("readme.txt", "hello")
    out["parquet"] = tmp_path / "real.parquet"  # Parquet's magic, binary metadata, magic again
    out["parquet"].write_bytes(b"PAR1\x15\x04\x15\x80\x01\x15\x80\x01\x4c\x15\x04\x00\x00" * 8 + b"PAR1")
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
        ("zip_parquet", "a zip archive that is not an .npz (whose members are .npy arrays) (its first member is"
                        " 'part-0.csv')"),
        ("zip_npz", "a zip archive that is not an .npz"),
        ("parquet", "the file is a Parquet file"),
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


def test_zip_that_is_not_npz_is_named(files):
    """A zip archive whose members are not .npy arrays is named as such by the reader too, not
    called an .npz; an .npz of other arrays is refused naming the arrays it holds."""
    from gpuflex.hub.base.errors import Unprocessable
    from gpuflex.hub.policy.dataset import read_arrays

    with pytest.raises(Unprocessable, match=r"zip archive that is not an \.npz .* first member is 'readme\.txt'"):
        read_arrays(files["zip_npz"], label_column="label", what="train")
    other = files["zip_npz"].with_name("ab.npz")
    np.savez(other, a=np.zeros(2), b=np.zeros(2))
    with pytest.raises(Unprocessable, match=r"'x' and 'y' \(found \['a', 'b'\]\)"):
        read_arrays(other, label_column="label", what="train")


async def test_hub_names_zip_parquet_and_csv_columns(running_hub, files, tmp_path):
    """The hub names a zip and a Parquet upload for what they are, and a CSV without the label
    column gets the columns it has; the job is not created."""
    no_label = tmp_path / "wine.csv"
    no_label.write_text("alcohol,ash,class\n13.2,2.1,0\n12.4,2.3,1\n")
    async with aiohttp.ClientSession() as s:
        for path, expected in ((files["zip_parquet"], "zip archive that is not an .npz"),
                               (files["parquet"], "the file is a Parquet file"),
                               (no_label, "CSV has no label column 'label' (set [data] label_column);"
                                          " its columns: 'alcohol', 'ash', 'class'")):
            r = await submit_job(s, running_hub, files["spec"], path)
            body = await r.json()
            assert r.status == 422 and body["error"] == "bad_dataset", body
            assert expected in body["detail"] and "\n" not in body["detail"], body
        r = await s.get(f"{running_hub.url}/v1/jobs", headers=running_hub.auth())
        assert (await r.json())["jobs"] == []
