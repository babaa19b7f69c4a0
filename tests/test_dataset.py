"""MuSiQue-format loading and its errors."""

import json

import pytest

from cachecraft.dataset import DatasetError, load_items


def write(tmp_path, data, name="d.json"):
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_loads_items_and_limit(tmp_path):
    item = {"ctxs": [{"title": "T", "text": "body"}], "question": " q? ", "answers": ["a"]}
    items = load_items(write(tmp_path, [item, item, item]), limit=2)
    assert len(items) == 2
    assert items[0].question == "q?" and items[0].passages == (("T", "body"),) and items[0].answers == ("a",)


def test_skip_leaves_out_the_first_items(tmp_path):
    data = [{"ctxs": [{"text": "body"}], "question": f"q{i}"} for i in range(5)]
    path = write(tmp_path, data)
    assert [i.question for i in load_items(path, limit=2, skip=3)] == ["q3", "q4"]
    assert [i.index for i in load_items(path, limit=2, skip=3)] == [3, 4]
    assert [i.question for i in load_items(path, skip=1)] == ["q1", "q2", "q3", "q4"]
    with pytest.raises(DatasetError, match="cannot skip 5 of its 5 items"):
        load_items(path, skip=5)
    data[4]["question"] = ""
    with pytest.raises(DatasetError, match="item 4"):  # positions in the file, not after the skip
        load_items(write(tmp_path, data), skip=3)


@pytest.mark.parametrize("data,message", [
    ("not json", "not a JSON file"),
    ({"a": 1}, "non-empty JSON list"),
    ([], "non-empty JSON list"),
    ([{"ctxs": [{"text": "x"}], "question": ""}], "question"),
    ([{"ctxs": [], "question": "q"}], "ctxs"),
    ([{"ctxs": [{"title": "t"}], "question": "q"}], r"ctxs\[0\]"),
    ([{"ctxs": [{"text": "x"}], "question": "q", "answers": [1]}], "answers"),
])
def test_bad_files_are_explained(tmp_path, data, message):
    with pytest.raises(DatasetError, match=message):
        load_items(write(tmp_path, data))


def test_missing_file(tmp_path):
    with pytest.raises(DatasetError, match="not found"):
        load_items(tmp_path / "missing.json")
