from dataclasses import dataclass

import pytest

from osvl.jsonl import iter_jsonl, iter_records, write_jsonl


@dataclass
class Row:
    name: str

    @classmethod
    def from_dict(cls, data):
        if not isinstance(data.get("name"), str):
            raise ValueError("row lacks a string 'name'")  # noqa: TRY004 (bad input is a ValueError)
        return cls(data["name"])


def test_yields_values_with_their_line_numbers_and_skips_blank_lines(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n\n   \n[2, 3]\n"x"\n', encoding="utf-8")
    assert list(iter_jsonl(path)) == [(1, {"a": 1}), (4, [2, 3]), (5, "x")]


def test_reads_utf8_and_a_last_line_without_newline(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"t": "Zürich"}\n{"t": "東京"}', encoding="utf-8")
    assert [v["t"] for _, v in iter_jsonl(str(path))] == ["Zürich", "東京"]


def test_bad_line_names_file_and_line_after_yielding_the_good_ones(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"a": 1}\n\n{"a": \n', encoding="utf-8")
    rows = iter_jsonl(path)
    assert next(rows) == (1, {"a": 1})
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not JSON \(Expecting value\)"):
        next(rows)


def test_empty_file_yields_nothing_and_missing_file_is_an_os_error(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    assert list(iter_jsonl(tmp_path / "empty.jsonl")) == []
    with pytest.raises(FileNotFoundError):
        list(iter_jsonl(tmp_path / "absent.jsonl"))


def test_records_are_parsed_and_bad_ones_name_their_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"name": "a"}\n\n{"name": "b"}\n', encoding="utf-8")
    assert list(iter_records(path, Row.from_dict)) == [Row("a"), Row("b")]
    path.write_text('{"name": "a"}\n{"name": 1}\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: row lacks a string 'name'"):
        list(iter_records(path, Row.from_dict))
    path.write_text('{"name": "a"}\n["a"]\n', encoding="utf-8")
    with pytest.raises(ValueError, match=r"rows\.jsonl:2: expected a JSON object"):
        list(iter_records(path, Row.from_dict))


def test_write_sorts_keys_appends_on_request_and_round_trips(tmp_path):
    path = tmp_path / "new" / "dir" / "rows.jsonl"
    assert write_jsonl(path, iter([{"b": 1, "a": "é"}, [1, 2]])) == 2
    assert path.read_bytes() == '{"a": "é", "b": 1}\n[1, 2]\n'.encode()
    assert write_jsonl(path, [{"z": None}], append=True) == 1
    assert [v for _, v in iter_jsonl(path)] == [{"a": "é", "b": 1}, [1, 2], {"z": None}]
    assert write_jsonl(path, []) == 0 and path.read_bytes() == b""
