"""hip/tune.py, the kernels' tuning sweep: its variant expansion and nvcc command lines, and
that every -D knob it is documented with still builds (needs nvcc; no GPU)."""

from __future__ import annotations

import shutil

import pytest

from compile_ahead import TUNE_KNOBS


def test_sets_multiply_into_variants_in_order(tune):
    sets = tune.parse_sets(["A=1,2", "B=x,y,z"])
    assert sets == {"A": ["1", "2"], "B": ["x", "y", "z"]}
    got = tune.variants(sets)
    assert len(got) == 6 and got[0] == {"A": "1", "B": "x"} and got[-1] == {"A": "2", "B": "z"}
    assert tune.variants({}) == [{}]  # no --set: the defaults, once
    for bad in ("A", "A=", "=1", "1A=2"):
        with pytest.raises(SystemExit, match="expected NAME=v1,v2"):
            tune.parse_sets([bad])


def test_a_variant_names_each_value_once(tune):
    assert tune.parse_variant("A=3,B=1024") == {"A": "3", "B": "1024"}
    for bad in ("A", "A=", "A=1,A=2", "A=1,", "1A=2"):
        with pytest.raises(SystemExit, match="expected NAME=v,NAME2=v2"):
            tune.parse_variant(bad)


def test_attn_cases_set_seqs_and_tokens_on_the_bench_case(tune):
    base = {"seqs": 32, "tokens": 4096, "kv_heads": 8, "head_dim": 128}
    got = tune.attn_cases("32x4096,1x32768,8x32768", base)
    assert [(c["seqs"], c["tokens"]) for c in got] == [(32, 4096), (1, 32768), (8, 32768)]
    assert all(c["kv_heads"] == 8 and c["head_dim"] == 128 for c in got)
    assert base["seqs"] == 32  # the bench's case is not modified
    for bad in ("32", "x4096", "32x", "0x16", "8x32k", "8x-1"):
        with pytest.raises(SystemExit, match="expected SEQSxTOKENS"):
            tune.attn_cases(bad, base)


def test_gemvx_shapes_are_m_by_k_with_whole_groups(tune):
    assert tune.gemv_shapes("14336x4096,272x512") == ((14336, 4096), (272, 512))
    assert tune.gemv_shapes(tune.GEMVX_SHAPES)[-1] == (272, 512)  # 17 tiles: a partial block
    for bad in ("4096", "x4096", "0x256", "16x-256"):
        with pytest.raises(SystemExit, match="--shapes .*expected MxK"):
            tune.gemv_shapes(bad)
    with pytest.raises(SystemExit, match="K must be a multiple of 256"):
        tune.gemv_shapes("16x1000")
    with pytest.raises(SystemExit, match="--shapes '12'"):  # checked before any device or build
        tune.main(["gemvx", "--shapes", "12"])
    with pytest.raises(SystemExit, match="--shapes '12'"):  # gemvf16 takes them too
        tune.main(["gemvf16", "--shapes", "12"])
    with pytest.raises(SystemExit, match="only gemvx and gemvf16 take weight shapes, not attn"):
        tune.main(["attn", "--shapes", "4096x4096"])


def test_attn_kv_takes_the_kernel_kinds_and_the_compressed_pairs(tune):
    from pagedkv.bench import gpu as B
    assert tune.attn_kind("q8s") == ("q8", {"q8_stage": True})
    assert tune.attn_kind("fwht4/lloyd4") == ("fwht4/lloyd4", {})
    for bad in ("q9", "fwht4", "fwht4/float16"):
        with pytest.raises(SystemExit, match="compressed pair such as fwht4/lloyd4"):
            tune.attn_kind(bad)
    # lloyd and 3-bit codebooks are the R256 family's: their case is head_dim 256
    assert tune.attn_base_case(B, "fwht4/lloyd4", None) is B.ATTENTION_CASE_256
    assert tune.attn_base_case(B, "fwht3/q8", None) is B.ATTENTION_CASE_256
    assert tune.attn_base_case(B, "fwht4/q8", None) is B.ATTENTION_CASE
    assert tune.attn_base_case(B, "fwht4/q8", 256) is B.ATTENTION_CASE_256
    assert tune.attn_base_case(B, "q8s", None) is B.ATTENTION_CASE
    with pytest.raises(SystemExit, match="--kv 'q9'"):  # checked before any build
        tune.main(["attn", "--kv", "fwht4/lloyd4,q9"])


def test_nvcc_command_names_the_source_defines_and_arch(tune, tmp_path):
    cmd = tune.nvcc_command("kvcache", {"PKV_ATTN_PARTITION_F16": "512"}, "sm_90",
                            tmp_path / "k.cubin")
    assert cmd[:4] == ["nvcc", "-cubin", "-arch=sm_90", "-O3"]
    assert "-DPKV_ATTN_PARTITION_F16=512" in cmd
    assert cmd[-3:] == [str(tune.HIP / "kvcache.hip"), "-o", str(tmp_path / "k.cubin")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="no nvcc")
@pytest.mark.parametrize("source", [
    pytest.param(source, marks=pytest.mark.compile_ahead(f"tune:{source}"))
    for source in TUNE_KNOBS])
def test_every_documented_knob_builds(compiled_ahead, source):
    """tune.build's nvcc command (tune.nvcc_command) with TUNE_KNOBS[source], run ahead."""
    image = compiled_ahead.output(f"tune:{source}").read_bytes()
    assert image[:4] == b"\x7fELF"  # a cubin


def test_without_a_gpu_it_says_so_in_one_line(tune, capsys):
    from pagedkv.errors import NoDeviceError
    from pagedkv.kernels import open_device
    try:
        open_device()
        pytest.skip("a GPU is present")
    except NoDeviceError:
        pass
    assert tune.main(["attn"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("hip/tune.py: ") and err.count("\n") == 1
