"""`serving.quantize`'s inputs, checked before any library loads: the calibration sample, the int4
group size, and the refusals the command line reports. (The quantization itself, with the real
library and real replicas: test_quantized_export.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from serving.quantize import QuantizeError, calibration_documents, int4_group_size, main


def test_the_calibration_sample_is_seeded_sized_and_in_file_order(tmp_path: Path) -> None:
    data = tmp_path / "data.txt"
    data.write_text("\n\n".join(f"document {i}" for i in range(100)) + "\n\n\n")
    first = calibration_documents(data, 10, seed=3)
    assert first == calibration_documents(data, 10, seed=3)
    assert first != calibration_documents(data, 10, seed=4)
    assert len(first) == 10 and first == sorted(first, key=lambda d: int(d.split()[1]))
    assert calibration_documents(data, 500, seed=3) == [f"document {i}" for i in range(100)]


def test_jsonl_rows_give_their_text_or_their_rendered_chat(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    rows = [
        {"text": "plain"},
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    ]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    rendered = calibration_documents(data, 5, seed=0, chat=lambda m: "|".join(x["content"] for x in m))
    assert rendered == ["plain", "hi|yo"]
    assert calibration_documents(data, 5, seed=0) == ["plain", "hi\nyo"]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("data.csv", "a,b", "must be a .txt or .jsonl file"),
        ("data.txt", "\n\n  \n", "holds no documents"),
        ("data.jsonl", '{"prompt": "x"}', "data.jsonl:1: a row needs a 'text' or 'messages' field; got ['prompt']"),
    ],
)
def test_calibration_files_it_cannot_use_are_refused_with_the_reason(
    tmp_path: Path, name: str, content: str, message: str
) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(QuantizeError, match=message.replace("[", r"\[").replace("]", r"\]").replace(".", r"\.")):
        calibration_documents(tmp_path / name, 4, seed=0)


def test_int4_groups_are_the_largest_of_128_64_32_dividing_every_linear_input() -> None:
    assert int4_group_size([128, 384]) == 128
    assert int4_group_size([256, 96]) == 32
    with pytest.raises(QuantizeError, match="multiple of 32"):
        int4_group_size([128, 100])


def test_the_command_fails_with_a_stage_line_naming_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "data.txt"
    data.write_text("some text")
    quantized = tmp_path / "quantized"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq"}}))
    for export, reason in ((tmp_path / "missing", "no config.json"), (quantized, "already quantized (gptq)")):
        code = main([str(export), str(tmp_path / "out"), "--scheme", "int8", "--calibration", str(data)])
        last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert code == 2 and last["stage"] == "failed" and reason in last["error"], last
    assert not (tmp_path / "out").exists()


def test_a_long_document_is_drawn_from_as_pieces_cut_at_line_ends(tmp_path: Path) -> None:
    data = tmp_path / "story.txt"  # one document to training: no blank line
    data.write_text("".join(f"line {i:03d} of the story\n" for i in range(200)) + "x" * 250 + "\n")
    pieces = calibration_documents(data, 1000, seed=0, piece_chars=100)
    assert all(0 < len(p) <= 100 for p in pieces) and "".join(pieces) == data.read_text()
    assert pieces[0] == "".join(f"line {i:03d} of the story\n" for i in range(4))  # 4 lines of 23 characters
    assert len(calibration_documents(data, 8, seed=0, piece_chars=100)) == 8
    assert calibration_documents(data, 8, seed=0) == [data.read_text()]
