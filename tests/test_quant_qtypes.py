"""The quant-type register: Python table == C header (PKV_QT_LIST), lookups, size rules."""

from __future__ import annotations

import numpy as np
import pytest

from pagedkv.errors import InvalidArgument, InvalidArgumentType
from pagedkv.hfqm import index as hfqm_index
from pagedkv.quant import qt_register
from pagedkv.quant.qtypes import QTYPES, expected_nbytes, is_registered, qtype

C = qt_register.c_constants()


def test_python_register_is_read_from_the_c_header_for_every_id():
    table = qt_register.c_register()
    for qt_id in range(256):
        c_row = table[qt_id]
        py_row = QTYPES.get(qt_id)
        if py_row is None:
            assert c_row["status"] == C["status_unknown"], qt_id
            assert c_row["size_rule"] == C["size_none"], qt_id
            continue
        assert c_row["group_size"] == py_row.group_size, py_row
        assert c_row["group_bytes"] == py_row.group_bytes, py_row
        assert c_row["size_rule"] == C["size_" + py_row.size_rule], py_row
        assert c_row["status"] == C["status_" + py_row.status], py_row
        flags = ((C["flag_rotated"] if py_row.rotated else 0)
                 | (C["flag_k_mult_256"] if py_row.k_multiple_of_256 else 0)
                 | (C["flag_raw"] if py_row.raw_dtype else 0))
        assert c_row["flags"] == flags, py_row


def test_the_register_holds_exactly_the_ids_of_section_1_1():
    registered = sorted(i for i, r in QTYPES.items() if r.registered)
    assert registered == [*range(23), 24, *range(28, 42), 44, 45, *range(47, 52), 130]
    reserved = sorted(i for i, r in QTYPES.items() if r.status == "reserved")
    assert reserved == [23, 25, 26, 27, 42, 43, 46]
    p1 = sorted(i for i, r in QTYPES.items() if r.decodable)
    assert p1 == [*range(23), 24, 30, 31, 33, 38, 39, 40, 41, 44, 45, 47, 48, 49, 50, 51]
    assert [i for i, r in QTYPES.items() if r.status == "refuse"] == [34, 35, 36, 37]


@pytest.mark.parametrize("qt_id,name,g,b", [
    (3, "Q8F16", 32, 34), (6, "HFQ4G256", 256, 136), (7, "HFQ4G128", 128, 72),
    (8, "HFQ6G256", 256, 200), (11, "HFQ3G256", 256, 104), (13, "MQ4G256", 256, 136),
    (31, "MQ5G256", 256, 168), (44, "MQ4G256V2", 256, 136), (45, "MQ4CG256", 256, 136),
    (47, "MQ6G256V2", 256, 200), (48, "MQ5G256V2", 256, 168), (49, "MQ3G256V2", 256, 104),
    (50, "MQ2G256V2", 256, 72), (20, "MQ3G256Lloyd", 256, 112), (38, "MQ2G256GL", 256, 66),
])
def test_group_geometry_of_the_register(qt_id, name, g, b):
    row = qtype(qt_id)
    assert (row.name, row.group_size, row.group_bytes) == (name, g, b)
    assert qtype(name.lower()) is row
    assert qtype(name) is row


def test_lookup_errors_name_the_value():
    with pytest.raises(InvalidArgument, match="'mq9'"):
        qtype("mq9")
    with pytest.raises(InvalidArgument, match="99"):
        qtype(99)
    with pytest.raises(InvalidArgumentType):
        qtype(1.5)
    with pytest.raises(InvalidArgumentType):
        qtype(True)
    assert qtype(np.uint8(44)).key == "mq4g256v2"
    assert qtype(23).status == "reserved" and not is_registered(23)
    assert is_registered(130) and not is_registered(200)


def test_every_raw_qt_has_a_numpy_dtype_and_only_those():
    raw_flag = {i for i, r in QTYPES.items()
                if qt_register.c_register()[i]["flags"] & C["flag_raw"]}
    assert raw_flag == {i for i, r in QTYPES.items() if r.raw_dtype} == {1, 2, 16, 22}


def test_unknown_id_message_lists_the_registered_ids():
    with pytest.raises(InvalidArgument) as info:
        qtype(99)
    assert str(info.value).endswith("registered ids: 0-22, 24, 28-41, 44, 45, 47-51, 130")


def test_raw_types_and_index_group_size():
    assert {i: QTYPES[i].raw_dtype for i in (1, 2, 16, 22)} == {
        1: "float16", 2: "float32", 16: "uint16", 22: "uint32"}
    assert QTYPES[1].index_group_size == 0
    assert QTYPES[6].index_group_size == 256
    assert QTYPES[3].index_group_size == 32


@pytest.mark.parametrize("qt,shape,nbytes", [
    ("f16", [4], 8), ("f32", [3, 5], 60), ("bf16", [7], 14), ("tidi32", [2, 3], 24),
    ("hfq4g256", [1, 256], 136),
    ("hfq4g256", [300], 272),            # docs/contracts/hfqm-and-quant.md, '5.2 Ramp group per format' short last group: 2 groups
    ("hfq4g128", [256], 144),
    ("q8f16", [256], 272),
    ("q8f16", [3, 33], 4 * 34),          # groups straddle rows
    ("mq4g256v2", [4, 512], 8 * 136),
    ("hfp4g32", [2, 64], 2 * (16 + 2 * 17)),
    ("mfp4g32", [1, 32], 33),
    ("q8hfq", [2, 64], 2 * 128),         # 2*2 + 64 = 68 -> 128
    ("q8hfq", [1, 128], 256),            # 8 + 128 = 136 -> 256
    ("calibhessian", [4, 4], 16 + 12),
    ("paro4g128", [8, 8], None), ("mfp4g32e8", [4, 32], None),
])
def test_expected_nbytes_follows_the_size_rules(qt, shape, nbytes):
    assert expected_nbytes(qt, shape) == nbytes
    row = qtype(qt)
    numel = int(np.prod(shape))
    assert qt_register.c_expected_nbytes(row.id, numel, shape[-1]) == (nbytes or 0)


def test_v2_needs_k_multiple_of_256():
    with pytest.raises(InvalidArgument, match="multiple of 256"):
        expected_nbytes("mq4g256v2", [2, 128])
    assert expected_nbytes("mq4g256", [2, 128]) == 136   # v1 pads the last group


def test_header_and_record_layout_match_the_c_structs():
    rec = hfqm_index.record_layout()
    dt = hfqm_index.TENSOR_RECORD_DTYPE
    assert dt.itemsize == rec["itemsize"] == 72
    for field in dt.names:
        assert dt.fields[field][1] == rec[field], field
    hdr = hfqm_index.header_layout()
    assert hdr["itemsize"] == 32
    for field in ("magic", "version", "arch_id", "n_tensors", "metadata_offset", "data_offset"):
        assert hdr[field] == hdr["const_" + field], field
    assert [hdr[f] for f in ("magic", "version", "arch_id", "n_tensors", "metadata_offset",
                             "data_offset")] == [0, 4, 8, 12, 16, 24]


def test_the_numpy_twins_are_the_documented_layouts():
    assert hfqm_index.TENSOR_RECORD_DTYPE == np.dtype({
        "names": ["offset", "nbytes", "name_offset", "shape", "name_len", "group_size",
                  "qt", "ndim"],
        "formats": ["<u8", "<u8", "<u8", ("<u4", (8,)), "<u4", "<u4", "u1", "u1"],
        "offsets": [0, 8, 16, 24, 56, 60, 64, 65], "itemsize": 72})
    assert hfqm_index.HEADER_DTYPE == np.dtype({
        "names": ["magic", "version", "arch_id", "n_tensors", "metadata_offset", "data_offset"],
        "formats": [("u1", (4,)), "<u4", "<u4", "<u4", "<u8", "<u8"],
        "offsets": [0, 4, 8, 12, 16, 24], "itemsize": 32})


def test_pack_header_is_what_parse_header_reads():
    raw = hfqm_index.pack_header(7, 3, 8192)
    assert raw == (b"HFQM" + (1).to_bytes(4, "little") + (7).to_bytes(4, "little")
                   + (3).to_bytes(4, "little") + (32).to_bytes(8, "little")
                   + (8192).to_bytes(8, "little"))
    assert hfqm_index.parse_header(raw, "x.hfq") == (1, 7, 3, 32, 8192)
    assert hfqm_index.MAGIC == b"HFQM" and hfqm_index.INCOMPLETE_MAGIC == b"HFQ!"
    assert hfqm_index.MTP_TRAILER_BYTES == 16


def test_every_quant_codec_qt_has_a_size_rule():
    # The converter plans exact data sizes for the pagedkv.quant codecs it writes.
    from pagedkv.quant.formats import CODECS
    for codec in CODECS.values():
        assert expected_nbytes(codec.qt.id, (4, 256)) == codec.payload_nbytes((4, 256)), codec
        if not codec.row_multiple:
            assert codec.payload_nbytes((4, 256)) == codec.nbytes(4 * 256), codec
