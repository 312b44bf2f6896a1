#!/usr/bin/env python3
"""make_seeds.py -- writes the seed corpora of the fuzz targets into
tests/fuzz/corpus/<target>/ (small files; run once, results are committed).
Reproducers of fixed crashes live beside the seeds as regress-* files and are
not touched by this script."""
import json, os, random, struct, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
rnd = random.Random(1)

def put(target, name, data):
    os.makedirs(os.path.join(root, target), exist_ok=True)
    if isinstance(data, str):
        data = data.encode()
    with open(os.path.join(root, target, name), "wb") as f:
        f.write(data)

# ---- config ----------------------------------------------------------------------
src = os.path.join(os.path.dirname(root), "..", "..", "conf", "megamoe.yaml")
with open(src) as f:
    put("config", "seed-megamoe.yaml", f.read())
put("config", "seed-min.yaml", "schema-version: 1\n")
put("config", "seed-flow.yaml",
    "schema-version: 1\nbackend: cpu-reference\nmodel: {hidden-size: 256, moe-intermediate-size: 128, "
    "num-experts: 4, top-k: 2}\nnum-max-tokens-per-rank: 64\ncpu: {threads: 1}\n")
put("config", "seed-all.yaml",
    "schema-version: 1\ngran-k: 32\nrequant:\n  policy: group16-to-group32\n  max-rel-error: 0.5\n"
    "compute:\n  mode: fp8\nmodel:\n  hidden-size: 6144\n  moe-intermediate-size: 2048\n"
    "  num-experts: 256\n  top-k: 8\n  routed-scaling-factor: 2.5\n  activation-clamp: 10.0\n"
    "ep-size: 8\nnum-max-tokens-per-rank: 4096\ndispatch-mode: low-latency\ndispatch:\n"
    "  low-latency-max-tokens: 128\nbackend: auto\ncpu:\n  threads: 4\ncomm:\n  timeout-ms: 1000\n"
    "log-level: debug\n")
put("config", "seed-json.yaml",
    "schema-version: 1\nmodel:\n  top-k: 4\n\n#%json\n" +
    json.dumps({"hidden_size": 1024, "moe_intermediate_size": 256, "n_routed_experts": 16,
                "num_experts_per_tok": 2, "routed_scaling_factor": 2.5,
                "architectures": ["GlmMoeForCausalLM"], "nested": {"a": [1, 2.5e-3, None, True]}}) + "\n")
put("config", "seed-set.yaml",
    "schema-version: 1\n\n#%set\nep-size=4\nmodel.num-experts=16\ngran-k=auto\nlog-level=warn\n"
    "requant.policy=none\n")
put("config", "seed-anchors.yaml",
    "schema-version: 1\nmodel: &m\n  top-k: 2\n  num-experts: 8\nx: *m\n")
put("config", "seed-bad.yaml", "schema-version: 1\nep-size: 3\nep-size: 4\nmodel: [1, 2\n")

# ---- safetensors ------------------------------------------------------------------
def st_file(tensors, meta=None, pad=True, raw_header=None):
    """tensors: list of (name, dtype, shape, bytes)."""
    hdr, data = {}, b""
    if meta is not None:
        hdr["__metadata__"] = meta
    for name, dt, shape, b in tensors:
        hdr[name] = {"dtype": dt, "shape": shape, "data_offsets": [len(data), len(data) + len(b)]}
        data += b
    h = raw_header if raw_header is not None else json.dumps(hdr, separators=(",", ":")).encode()
    if pad:
        h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data

def nvfp4_layer(experts, H=64, I=32, prefix="model.layers.0.mlp.", mx=False):
    out = []
    for e in range(experts):
        for p, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            base = f"{prefix}experts.{e}.{p}_proj."
            out.append((base + "weight", "U8", [n, k // 2], bytes(rnd.randrange(256) for _ in range(n * k // 2))))
            if mx:
                out.append((base + "weight_scale", "U8", [n, k // 32], bytes(rnd.randrange(118, 126) for _ in range(n * k // 32))))
            else:
                out.append((base + "weight_scale", "F8_E4M3", [n, k // 16], bytes(rnd.randrange(0x28, 0x50) for _ in range(n * k // 16))))
                out.append((base + "weight_scale_2", "F32", [], struct.pack("<f", 0.01)))
                out.append((base + "input_scale", "F32", [], struct.pack("<f", 1.0)))
    return out

put("safetensors", "seed-nvfp4-layer.safetensors", st_file(nvfp4_layer(2), meta={"format": "pt"}))
put("safetensors", "seed-mxfp4-layer.safetensors", st_file(nvfp4_layer(2, mx=True, prefix="")))
put("safetensors", "seed-small.safetensors",
    st_file([("a", "F32", [2, 2], struct.pack("<4f", 1, 2, 3, 4)), ("b", "BF16", [3], b"\0\x3f" * 3),
             ("c", "I32", [0], b""), ("d", "F4", [2, 4], b"\x12\x34\x56\x78"), ("e", "F8_E8M0", [1], b"\x7f")]))
put("safetensors", "seed-empty.safetensors", st_file([]))
put("safetensors", "seed-meta-only.safetensors", st_file([], meta={"k": "v", "": "x"}))
# hostile headers (the reader must reject them with a clear error)
put("safetensors", "seed-overlap.safetensors",
    st_file([], raw_header=b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},"b":{"dtype":"U8","shape":[4],"data_offsets":[2,6]}}') + b"\0" * 8)
put("safetensors", "seed-truncated.safetensors", st_file(nvfp4_layer(1))[:-100])
put("safetensors", "seed-hdrlen.safetensors", struct.pack("<Q", 1 << 40) + b"{}")
put("safetensors", "seed-deep.safetensors", st_file([], raw_header=b'{"__metadata__":' + b"[" * 40 + b"]" * 40 + b"}"))
put("safetensors", "seed-sizes.safetensors",
    st_file([], raw_header=b'{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]},"b":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,0]}}') + b"\0" * 4)

# index files (an input starting with '{' is a model.safetensors.index.json
# beside the target's two fixed shards: a.safetensors {x, y}, b.safetensors {z})
put("safetensors", "seed-index.json", json.dumps({"metadata": {"total_size": 15},
    "weight_map": {"x": "a.safetensors", "y": "a.safetensors", "z": "b.safetensors"}}))
put("safetensors", "seed-index-wrong-shard.json", json.dumps({"weight_map": {"x": "b.safetensors", "z": "b.safetensors"}}))
put("safetensors", "seed-index-escape.json", json.dumps({"weight_map": {"x": "../a.safetensors"}}))

# ---- abi_tensors: byte programs (any bytes work; these start near each action) ----
for i, prog in enumerate([b"\x00" * 16, b"\x00\x00\x03\xa0\x04\x00", b"\x03\x01\x00\x00",
                          b"\x03\x02\x01\x04\x05\x06\x01\x00\x00\x00", b"\x05\x03\x00",
                          b"\x06\x05\x00\x00\x01\x02\x03\x04\x05", b"\x07\x05\x00",
                          b"\x00\x00\x08\xff\x0a\xff\x0b\xff\x0c\xf0\x01"]):
    put("abi_tensors", f"seed-{i}", prog)
for i in range(4):
    put("abi_tensors", f"seed-rand-{i}", bytes(rnd.randrange(256) for _ in range(200)))
print("seeds written under", root)
