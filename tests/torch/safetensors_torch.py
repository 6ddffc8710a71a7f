#!/usr/bin/python3
"""The torch side of the safetensors round trips in tests/test_safetensors.cpp.

Debian has no python3-safetensors, so this script writes and reads the format
itself, from its specification (an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets}}, then each tensor's little-endian
bytes), with torch tensors as the values. It shares no code with
<ddiloco/safetensors.hpp>.

  safetensors_torch.py make DIR
      writes DIR/torch.safetensors (float32 and bfloat16 tensors made by torch,
      with a __metadata__ entry) and DIR/expected.f32: the same values as
      float32, concatenated in file order, as torch widens them.
  safetensors_torch.py check FILE EXPECTED.f32 SHAPES_JSON
      reads FILE (written by ddiloco) with torch, checks that every tensor is
      float32, that names and shapes in data order equal SHAPES_JSON
      ([["name", [d0, ...]], ...]) and that the values equal EXPECTED.f32
      bit for bit. Prints "ok" or exits non-zero with the difference.
Exit status 77: torch is not installed (the C++ test then says so and skips).
"""
import json
import struct
import sys

try:
    import torch
except ImportError:
    sys.exit(77)

DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16}


def make(directory):
    torch.manual_seed(16)
    tensors = [
        ("tok_embeddings.weight", torch.randn(5, 3)),
        ("layers.0.norm.weight", torch.randn(7).to(torch.bfloat16)),
        ("layers.0.attention.wq.weight", torch.randn(2, 3, 4)),
        ("scale", torch.tensor(0.25)),
        ("lm_head.weight", (torch.randn(3, 5) * 1e3).to(torch.bfloat16)),
    ]
    header, blobs, offset = {"__metadata__": {"format": "pt", "made_by": "torch " + torch.__version__}}, [], 0
    for name, t in tensors:
        t = t.contiguous()
        dtype = "BF16" if t.dtype == torch.bfloat16 else "F32"
        raw = (t.view(torch.int16) if dtype == "BF16" else t).numpy().astype("<" + ("i2" if dtype == "BF16" else "f4"))
        blob = raw.tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(directory + "/torch.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    expected = torch.cat([t.float().flatten() for _, t in tensors])
    with open(directory + "/expected.f32", "wb") as f:
        f.write(expected.numpy().astype("<f4").tobytes())


def check(path, expected_path, shapes_json):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    body = data[8 + n :]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    got = []
    for name, e in entries:
        if e["dtype"] != "F32":
            sys.exit(f"{name}: dtype {e['dtype']}, expected F32")
        begin, end = e["data_offsets"]
        t = torch.frombuffer(bytearray(body[begin:end]), dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        got.append((name, list(t.shape), t))
    want = json.loads(shapes_json)
    if [[n, s] for n, s, _ in got] != want:
        sys.exit(f"names/shapes {[[n, s] for n, s, _ in got]} != {want}")
    if entries and entries[-1][1]["data_offsets"][1] != len(body):
        sys.exit(f"data section holds {len(body)} bytes, tensors end at {entries[-1][1]['data_offsets'][1]}")
    values = torch.cat([t.flatten() for _, _, t in got]) if got else torch.zeros(0)
    expected = torch.frombuffer(bytearray(open(expected_path, "rb").read()), dtype=torch.float32)
    if not torch.equal(values.view(torch.int32), expected.view(torch.int32)):
        sys.exit(f"values differ: {values} vs {expected}")
    print("ok")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "make":
        make(sys.argv[2])
    elif len(sys.argv) == 5 and sys.argv[1] == "check":
        check(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(__doc__)
