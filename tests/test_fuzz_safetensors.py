"""Fuzzing the weights files of every drafter layout (issue #17, loaders): a safetensors header
that lies (shapes, dtypes, offsets past the end or overlapping, a header length larger than the
file) or a file cut short gives headway's own one-line error, never a traceback, and nothing is
allocated in proportion to what the header claims."""

from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from tests.drafting import heads_drafter as load_drafter
from tests.test_fuzz_heads import FUZZ, folders, loads_or_fails_in_one_line, target_for

WEIGHTS = {
    "run": "model.safetensors",
    "medusa": "medusa_lm_head.safetensors",
    "medusa-vllm": "model.safetensors",
    "eagle1": "model.safetensors",
    "eagle3-hf": "model.safetensors",
}
DTYPES = ["F32", "F16", "BF16", "F64", "I64", "I32", "U8", "BOOL", "F8_E4M3", "Q4", ""]
HUGE = st.sampled_from([2**31, 2**40, 10**12, 2**63 - 1, -1, 0])
dims = st.one_of(st.integers(0, 4096), HUGE)


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A safetensors file as its JSON header and the byte buffer after it."""
    (length,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + length]), data[8 + length :]


def join(header: dict[str, Any], body: bytes, *, length: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", (len(raw) if length is None else length) % 2**64) + raw + body


def lie(data: st.DataObject, header: dict[str, Any], body: bytes) -> bytes:
    """One lie about one tensor, or about the file as a whole."""
    names = sorted(name for name in header if name != "__metadata__")
    entry = header[data.draw(st.sampled_from(names))]
    kind = data.draw(
        st.sampled_from(["shape", "rank", "dtype", "offsets", "swap", "length", "cut", "body"])
    )
    if kind == "shape":
        entry["shape"] = [data.draw(dims) for _ in entry["shape"]]
    elif kind == "rank":
        entry["shape"] = data.draw(st.lists(dims, max_size=4))
    elif kind == "dtype":
        entry["dtype"] = data.draw(st.sampled_from(DTYPES))
    elif kind == "offsets":
        entry["data_offsets"] = [
            data.draw(st.one_of(st.integers(0, len(body) * 2), HUGE)) for _ in range(2)
        ]
    elif kind == "swap":
        entry["data_offsets"] = entry["data_offsets"][::-1]
    elif kind == "length":
        return join(header, body, length=data.draw(st.one_of(HUGE, st.integers(0, 64))))
    elif kind == "cut":
        return join(header, body)[: data.draw(st.integers(0, len(body)))]
    else:
        return join(header, body[: len(body) // 2])
    return join(header, body)


@FUZZ
@given(st.data())
def test_a_lying_weights_file_loads_or_fails_in_one_line(data: st.DataObject) -> None:
    layout = data.draw(st.sampled_from(sorted(WEIGHTS)))
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / layout
        shutil.copytree(folders()[layout], folder)
        path = folder / WEIGHTS[layout]
        header, body = split(path.read_bytes())
        path.write_bytes(lie(data, header, body))
        loads_or_fails_in_one_line(lambda: load_drafter(folder, target_for(layout)), "drafter")
