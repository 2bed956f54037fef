"""Bad input to `pagedkv inspect`, `convert` and `demo`: one line on stderr that names the
problem (and the fix where there is one), a non-zero exit status, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from hfqm_samples import write_mixed
from pagedkv.cli import error_text
from pagedkv.cli import main as cli_main
from pagedkv.errors import ContextLengthExceeded, InvalidArgument, PagedKVError
from pagedkv.hfqm import HfqmWriter
from pagedkv.tiny_model import ReferenceConfig, ReferenceModel
from test_hfqm_cli import make_model


def _fails(capsys, argv, status=1) -> str:
    """Run the CLI in-process; return its one stderr line after checking the status."""
    assert cli_main(argv) == status
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith(f"pagedkv {argv[0]}: error: ")
    return lines[0]


def _usage_error(capsys, argv) -> str:
    """argparse refusals: exit status 2 and ``error: argument ...`` as the last line."""
    with pytest.raises(SystemExit) as exc:
        cli_main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# --- inspect -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mixed_bytes(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("hfqm") / "mixed.hfq"
    write_mixed(path)
    return path.read_bytes()


def test_inspect_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.hfq"
    line = _fails(capsys, ["inspect", str(path)])
    assert line == f"pagedkv inspect: error: {path}: No such file or directory"


def test_inspect_directory(tmp_path, capsys):
    line = _fails(capsys, ["inspect", str(tmp_path)])
    assert line == f"pagedkv inspect: error: path {str(tmp_path)!r} is a directory; pass an HFQM file"


def test_inspect_not_hfqm_and_empty(tmp_path, capsys):
    junk = tmp_path / "junk.hfq"
    junk.write_bytes(b"GGUF" + bytes(60))
    assert "magic is b'GGUF', expected b'HFQM'" in _fails(capsys, ["inspect", str(junk)])
    empty = tmp_path / "empty.hfq"
    empty.write_bytes(b"")
    assert "holds 0 bytes from the section start, the HFQM header needs 32" in _fails(
        capsys, ["inspect", str(empty)])


@pytest.mark.parametrize("keep", [40, 200, 2000])
def test_inspect_file_cut_before_the_data_section_says_truncated(tmp_path, capsys, mixed_bytes,
                                                                keep):
    path = tmp_path / "cut.hfq"
    path.write_bytes(mixed_bytes[:keep])
    line = _fails(capsys, ["inspect", str(path)])
    assert line == (f"pagedkv inspect: error: {path}, offset 24: the file is truncated: its "
                    f"header puts the data section at byte 4096 of the section but only {keep} "
                    "bytes are there (an interrupted copy or download?)")


def test_inspect_file_cut_inside_the_last_payload(tmp_path, capsys, mixed_bytes):
    path = tmp_path / "cut.hfq"
    path.write_bytes(mixed_bytes[:-1])
    line = _fails(capsys, ["inspect", str(path)])
    assert "runs past the end of the file (7 bytes left)" in line


# --- convert -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("model") / "m"
    make_model(root)
    return root


def test_convert_missing_source(tmp_path, capsys):
    src = tmp_path / "absent"
    line = _fails(capsys, ["convert", str(src), "-o", str(tmp_path / "o.hfq")])
    assert line == (f"pagedkv convert: error: {str(src)!r} does not exist; pass a .safetensors "
                    "file or a model directory holding *.safetensors shards")


def test_convert_directory_without_shards(tmp_path, capsys):
    line = _fails(capsys, ["convert", str(tmp_path), "-o", str(tmp_path / "o.hfq")])
    assert line.endswith(f"{str(tmp_path)!r} holds no *.safetensors shard")


def test_convert_unknown_format(tmp_path, capsys, model_dir):
    line = _fails(capsys, ["convert", str(model_dir), "-o", str(tmp_path / "o.hfq"),
                           "--format", "q17"])
    assert "--format 'q17' is not a format: use one of mq4" in line
    assert os.listdir(tmp_path) == []


def test_convert_output_is_a_directory_fails_before_converting(tmp_path, capsys, model_dir):
    line = _fails(capsys, ["convert", str(model_dir), "-o", str(tmp_path), "--no-progress"])
    assert line == (f"pagedkv convert: error: path {str(tmp_path)!r} is a directory; pass a "
                    f"file name such as {str(tmp_path / 'model.hfq')!r}")
    assert os.listdir(tmp_path) == []


def test_convert_output_with_a_trailing_slash_fails_before_converting(tmp_path, capsys,
                                                                       model_dir,
                                                                       monkeypatch):
    # `-o out/` meant a directory: the conversion wrote a file named `out` and then failed
    # with "out/: Not a directory" (exit 1, the file left behind).
    monkeypatch.chdir(tmp_path)
    line = _fails(capsys, ["convert", str(model_dir), "-o", "out/", "--no-error",
                           "--no-progress"])
    assert line == ("pagedkv convert: error: path 'out/' ends with a separator but is no "
                    "directory; pass a file name such as 'out/model.hfq' (create the "
                    "directory first)")
    assert os.listdir(tmp_path) == []


def test_convert_empty_output_fails_before_converting(tmp_path, capsys, model_dir,
                                                      monkeypatch):
    # `-o ""` was the working directory: its temporary file went to the parent directory
    # and the rename failed after the work with "<parent>/.<cwd>.<hex>.tmp: Is a directory".
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    line = _fails(capsys, ["convert", str(model_dir), "-o", "", "--no-error",
                           "--no-progress"])
    assert line == ("pagedkv convert: error: the output path is empty; pass a file name such "
                    "as 'model.hfq'")
    assert os.listdir(tmp_path) == ["work"] and os.listdir(work) == []


def test_convert_output_directory_missing(tmp_path, capsys, model_dir):
    out = tmp_path / "no" / "o.hfq"
    line = _fails(capsys, ["convert", str(model_dir), "-o", str(out)])
    assert line == (f"pagedkv convert: error: {out}: directory {out.parent} does not exist; "
                    "create it first")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc (root can "
                    "write to any ordinary directory)")
def test_convert_unwritable_output_names_the_output_not_the_temp_file(capsys, model_dir):
    line = _fails(capsys, ["convert", str(model_dir), "-o", "/proc/o.hfq"])
    assert line.startswith("pagedkv convert: error: /proc/o.hfq: ")
    assert "(creating the temporary file .o.hfq." in line


def test_writer_refuses_a_directory_and_creates_nothing(tmp_path):
    with pytest.raises(InvalidArgument, match="is a directory; pass a file name"):
        HfqmWriter(tmp_path, arch_id=0, metadata={})
    with pytest.raises(FileNotFoundError) as exc:
        HfqmWriter(tmp_path / "x" / "o.hfq", arch_id=0, metadata={})
    assert exc.value.filename == str(tmp_path / "x" / "o.hfq")
    assert os.listdir(tmp_path) == []


# --- demo --------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--requests", "abc"], "argument --requests: 'abc' is not an integer"),
    (["--requests", "0"], "argument --requests: 0 is not >= 1"),
    (["--new-tokens", "-2"], "argument --new-tokens: -2 is not >= 1"),
    (["--system-tokens", "-1"], "argument --system-tokens: -1 is not >= 0"),
    (["--seed", "-1"], "argument --seed: -1 is not >= 0"),
    (["--max-blocks", "99999999999"],
     "argument --max-blocks: 99,999,999,999 is above the limit 1,048,576"),
    (["--block-size", "7"], "argument --block-size: invalid choice: 7 (choose from 8, 16, 32)"),
    (["--backend", "torch"], "argument --backend: invalid choice: 'torch'"),
])
def test_demo_refuses_nonsense_options(capsys, argv, message):
    line = _usage_error(capsys, ["demo", *argv])
    assert line.startswith("pagedkv demo: error: ")
    assert message in line


@pytest.mark.parametrize("argv, message", [
    (["--initial-blocks", "100", "--max-blocks", "10"],
     ("--initial-blocks 100 exceeds --max-blocks 10; lower --initial-blocks or raise "
     "--max-blocks")),
    (["--initial-blocks", "2", "--max-blocks", "2"],
     ("a request needs 9 blocks of 16 tokens (143 tokens) but --max-blocks is 2; raise "
     "--max-blocks to at least 9 or shorten the prompt")),
    (["--system-tokens", "5000", "--max-blocks", "1000"],
     ("a request spans 5,079 positions (5,064 prompt + 16 new tokens - 1) but the reference "
     "model holds 4,096; shorten --system-tokens, --fewshot-tokens, --user-tokens or "
     "--new-tokens")),
])
def test_demo_refuses_sizes_that_cannot_run_before_serving(capsys, tmp_path, monkeypatch,
                                                           argv, message):
    monkeypatch.chdir(tmp_path)
    line = _fails(capsys, ["demo", *argv], status=2)
    assert line == f"pagedkv demo: error: {message}"
    assert os.listdir(tmp_path) == []   # refused before any cold-tier directory is made


def test_demo_at_the_exact_block_limit_runs(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo's default cold-tier directory is relative
    # 64 + 48 + 16 prompt + 16 new - 1 = 143 tokens = 9 blocks of 16: the bound is tight.
    assert cli_main(["demo", "--requests", "2", "--initial-blocks", "9",
                     "--max-blocks", "9", "--no-cold"]) == 0
    assert os.listdir(tmp_path) == []
    assert "parity: OK (2/2" in capsys.readouterr().out


# --- the last-resort handler and the message helper ---------------------------------------

def test_unexpected_pagedkv_error_is_one_line(monkeypatch, capsys):
    import pagedkv.cli.inspect as inspect_cmd

    def boom(args):
        raise PagedKVError("something the command did not expect")
    monkeypatch.setattr(inspect_cmd, "run", boom)
    line = _fails(capsys, ["inspect", "x.hfq"])
    assert line == "pagedkv inspect: error: something the command did not expect"


def test_error_text():
    assert error_text(FileNotFoundError(2, "No such file or directory", "/a/b")) == \
        "/a/b: No such file or directory"
    assert error_text(OSError(13, "Permission denied")) == "Permission denied"
    assert error_text(InvalidArgument("n = -1 is outside [0, 8)")) == "n = -1 is outside [0, 8)"


def test_real_process_exit_status_and_stderr(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pagedkv", "inspect", str(tmp_path)],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 1
    assert out.stderr == (f"pagedkv inspect: error: path {str(tmp_path)!r} is a directory; "
                          "pass an HFQM file\n")


# --- the reference model's position limit --------------------------------------------------

def test_forward_past_max_position_is_refused_with_kv_unchanged():
    model = ReferenceModel(ReferenceConfig(max_position=32))
    kv = model.new_flat_kv()
    model.forward(np.arange(30), kv)
    with pytest.raises(ContextLengthExceeded,
                       match=r"positions \[30, 33\) exceed max_position=32 of the reference "
                             r"config"):
        model.forward(np.arange(3), kv)
    assert kv.num_tokens == 30
    model.forward(np.arange(2), kv)  # up to the limit is fine
    assert kv.num_tokens == 32


def test_truncation_message_is_the_same_on_the_read_path(tmp_path, mixed_bytes):
    # Files above the whole-file mapping limit parse header and index with plain reads.
    from pagedkv.errors import Truncated
    from pagedkv.hfqm import HfqmFile
    path = tmp_path / "cut.hfq"
    path.write_bytes(mixed_bytes[:200])
    messages = []
    for limit in (1 << 40, 0):
        with pytest.raises(Truncated) as exc:
            HfqmFile(path, _whole_file_mmap_limit_bytes=limit)
        messages.append(str(exc.value))
    assert messages[0] == messages[1]
    assert "the file is truncated: its header puts the data section at byte 4096" in messages[0]
