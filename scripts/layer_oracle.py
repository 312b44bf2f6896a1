#!/usr/bin/env python3
"""layer_oracle.py -- checks megamoe_fp4's output against an independent model.

megamoe-host --dump-check FILE writes the tokens its reference check sampled
(hidden states, top-k ids and weights), the operator's output for them and the
cpu-reference backend's. This script reads the checkpoint itself, with numpy
and none of the plugin's code, computes the layer from the numerics that
docs/ARCHITECTURE.md and plugin/ref_moe.h state, and compares both outputs with
it. So the plugin's checkpoint reading, requantization and layer are checked
against a second implementation, also where the operator runs on the CPU and
its reference is the same code.

    layer_oracle.py --checkpoint DIR --dump FILE [--requant none|group16-to-group32]
                    [--routed-scaling-factor X] [--activation-clamp C] [--tolerance T]
                    [--tokens N]   (the first N dumped tokens only: its time
                                    goes with the experts they reach)
    layer_oracle.py --self-test GOLDEN_DIR    its formats and requant against the
                                              golden vectors (../shared/golden)

Prints one line "layer_oracle: PASS|FAIL ..." (relative Frobenius errors of the
operator and of the reference against this model); exit 0 on PASS, 1 on FAIL,
2 on bad input.
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

# ---- safetensors ---------------------------------------------------------------

_DTYPES = {"U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I32": np.int32,
           "F32": np.float32, "F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "F4": np.uint8}


def read_header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return header, 8 + n


class Tensors:
    """Tensors of one safetensors file or of a sharded checkpoint folder."""

    def __init__(self, path):
        self.where = {}  # name -> (file, data start, entry)
        files = [path]
        if os.path.isdir(path):
            index = os.path.join(path, "model.safetensors.index.json")
            if os.path.exists(index):
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
                files = [os.path.join(path, s) for s in shards]
            else:
                files = [os.path.join(path, "model.safetensors")]
        self.metadata = {}
        for fp in files:
            header, start = read_header(fp)
            self.metadata.update(header.pop("__metadata__", {}) or {})
            for name, entry in header.items():
                self.where[name] = (fp, start, entry)

    def has(self, name):
        return name in self.where

    def get(self, name):
        fp, start, e = self.where[name]
        b, end = e["data_offsets"]
        shape = list(e["shape"])
        if e["dtype"] not in _DTYPES:
            raise ValueError(f"{name}: dtype {e['dtype']} not handled")
        with open(fp, "rb") as f:
            f.seek(start + b)
            raw = f.read(end - b)
        a = np.frombuffer(raw, dtype=_DTYPES[e["dtype"]])
        if e["dtype"] == "F4":  # shape in elements, two per byte
            shape[-1] //= 2
        return a.reshape(shape), e["dtype"]


# ---- number formats ----------------------------------------------------------------

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
E2M1_PAIRS = np.stack([E2M1[np.arange(256) & 15], E2M1[np.arange(256) >> 4]], axis=1)


def e4m3_table():
    t = np.zeros(256, np.float32)
    for b in range(256):
        s = -1.0 if b & 0x80 else 1.0
        e, m = (b >> 3) & 15, b & 7
        if (b & 0x7F) == 0x7F:
            t[b] = np.nan
        elif e == 0:
            t[b] = s * m * 2.0 ** -9
        else:
            t[b] = s * (1 + m / 8) * 2.0 ** (e - 7)
    return t


E4M3 = e4m3_table()
UE8M0 = np.array([np.nan if b == 255 else 2.0 ** (b - 127) for b in range(256)], np.float64).astype(np.float32)


def round_e4m3(x):
    """float32 -> the E4M3 value nearest (ties to even), saturating at 448."""
    m = np.abs(x).astype(np.float64)
    _, e = np.frexp(m)
    ue = np.maximum(e - 1, -6)
    step = np.ldexp(1.0, ue - 3)
    q = np.minimum(np.rint(m / step) * step, 448.0)
    return (np.sign(x) * q).astype(np.float32)


def round_bf16(x):
    u = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def bf16_to_f32(h):
    return (h.astype(np.uint32) << 16).view(np.float32)


def quant_fp8(x):
    """Per row and 128 channels: amax = max(max|x|, 1e-4), q = e4m3(x * (448 / amax)),
    scale = amax / 448, all in float32; returns the dequantized values (float64)."""
    rows, n = x.shape
    xb = x.reshape(rows, n // 128, 128).astype(np.float32)
    amax = np.maximum(np.abs(xb).max(axis=2, keepdims=True), np.float32(1e-4))
    inv = np.float32(448.0) / amax
    q = round_e4m3(xb * inv)
    scale = amax / np.float32(448.0)
    return (q.astype(np.float64) * scale.astype(np.float64)).reshape(rows, n)


# ---- weights -----------------------------------------------------------------------


def load_proj(ck, prefix):
    """One projection as stored: (codes [N, K/2], scale values [N, K/g], global)."""
    codes, _ = ck.get(prefix + ".weight")
    scales, sdt = ck.get(prefix + ".weight_scale")
    if sdt == "F8_E4M3":
        s = E4M3[scales]
    elif sdt in ("U8", "F8_E8M0"):
        s = UE8M0[scales]
    else:
        raise ValueError(f"{prefix}.weight_scale: dtype {sdt} not handled")
    g = np.float32(1.0)
    if ck.has(prefix + ".weight_scale_2"):
        g = np.float32(ck.get(prefix + ".weight_scale_2")[0].reshape(-1)[0])
    return codes, s, g


def dequant(codes, s, g, requant):
    """Rows of a projection: (W as float32 without the row factor, the row factor)."""
    N, K = codes.shape[0], codes.shape[1] * 2
    gran = K // s.shape[1]
    # a byte's two values (element 2j in the low nibble) times the group scale: exact
    w = (E2M1_PAIRS[codes].reshape(N, K // gran, gran) * s[:, :, None]).reshape(N, K)
    if requant and gran == 16:
        return requant_g32(w * g), np.ones(N, np.float32)
    return w, np.full(N, g, np.float32)


def project(ck, prefix, requant, x):
    """x @ W^T times the row factors, in float64, 256 weight rows at a time
    (small temporaries)."""
    codes, s, g = load_proj(ck, prefix)
    n = codes.shape[0]
    y = np.empty((x.shape[0], n), np.float64)
    for r0 in range(0, n, 256):
        w, r = dequant(codes[r0:r0 + 256], s[r0:r0 + 256], g, requant)
        y[:, r0:r0 + w.shape[0]] = x @ w.astype(np.float64).T * r.astype(np.float64)
    return y


def requant_g32(v):
    """group16 -> group32 with UE8M0 scales (../shared/golden/README.md): per 32
    values, E = the smallest integer with amax / 2^E <= 6 (clamped to [-127, 127]),
    codes the nearest E2M1 values of v / 2^E (ties to even); returns the
    dequantized result."""
    N, K = v.shape
    g = v.reshape(N, K // 32, 32)
    amax = np.abs(g).max(axis=2)
    bits = amax.view(np.uint32)
    ex = ((bits >> 23) & 0xFF).astype(np.int64)
    man = bits & 0x7FFFFF
    b = np.where(man <= 0x400000, ex - 2, ex - 1)
    b = np.clip(np.where(ex == 0, 0, b), 0, 254)
    b = np.where(amax == 0, 127, b)
    inv = np.ldexp(1.0, 127 - b).astype(np.float32)[:, :, None]
    x = g * inv  # |x| <= 6
    m = np.abs(x)
    # the nearest E2M1 magnitude, ties to the even code: the grid is 0.5 apart
    # below 2, 1 apart up to 4, 2 apart up to 6, and on each grid an even
    # multiple is an even code, so rint (ties to even) rounds right
    r = np.where(m < 2, np.rint(m * 2) * 0.5, np.where(m < 4, np.rint(m), np.rint(m * 0.5) * 2))
    step = np.ldexp(1.0, b - 127)[:, :, None]
    return (np.copysign(r, x) * step).astype(np.float32).reshape(N, K)


# ---- the layer ---------------------------------------------------------------------


def expert_rows(ck, layer, e, x, pw, requant, clamp):
    """BF16-rounded outputs (float32 [m, H]) of expert e for FP8-dequantized rows x."""
    base = f"model.layers.{layer}.mlp.experts.{e}."
    gate = round_bf16(project(ck, base + "gate_proj", requant, x).astype(np.float32))
    up = round_bf16(project(ck, base + "up_proj", requant, x).astype(np.float32))
    if clamp > 0:
        c = np.float32(clamp)
        gate = np.minimum(gate, c)
        up = np.clip(up, -c, c)
    silu = gate / (np.float32(1.0) + np.exp(-gate))
    a = (silu * up) * pw[:, None]
    y = project(ck, base + "down_proj", requant, quant_fp8(a.astype(np.float32)))
    return round_bf16(y.astype(np.float32))


def self_test(golden):
    """This model's E4M3 table and group16 -> group32 requant against the
    golden vectors of an independent implementation (values, so -0 == 0)."""
    bad = 0
    codecs = Tensors(os.path.join(golden, "codecs.safetensors"))
    code, _ = codecs.get("e4m3.code")
    value, _ = codecs.get("e4m3.value")
    same = np.array_equal(E4M3[code], value, equal_nan=True)
    bad += not same
    print(f"layer_oracle: self-test e4m3 table: {'ok' if same else 'DIFFERS'}")
    for name in ("nvfp4_small", "nvfp4_glm_w13_slice", "nvfp4_glm_w2_slice",
                 "nvfp4_exotic_scales", "ue8m0_g16"):
        path = os.path.join(golden, name + ".safetensors")
        t = Tensors(path)
        codes, sv, g = load_proj(t, "src")
        got = requant_g32(dequant(codes, sv, g, False)[0] * g)
        codes, _ = t.get("dst.weight")
        scales, _ = t.get("dst.weight_scale")
        c = np.empty((codes.shape[0], codes.shape[1] * 2), np.uint8)
        c[:, 0::2], c[:, 1::2] = codes & 15, codes >> 4
        want = E2M1[c] * np.repeat(UE8M0[scales], 32, axis=1)
        same = np.array_equal(got, want)
        bad += not same
        print(f"layer_oracle: self-test requant {name}: {'ok' if same else 'DIFFERS'}")
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--self-test", metavar="GOLDEN_DIR")
    ap.add_argument("--checkpoint")
    ap.add_argument("--dump")
    ap.add_argument("--requant", default="none", choices=["none", "group16-to-group32"])
    ap.add_argument("--routed-scaling-factor", type=float, default=1.0)
    ap.add_argument("--activation-clamp", type=float, default=0.0)
    ap.add_argument("--tolerance", type=float, default=1e-2)
    ap.add_argument("--tokens", type=int, default=0)
    a = ap.parse_args()
    if a.self_test:
        return self_test(a.self_test)
    if not a.checkpoint or not a.dump:
        ap.error("--checkpoint and --dump are required")
    try:
        d = Tensors(a.dump)
        ck = Tensors(a.checkpoint)
        layer = int(d.metadata["layer"])
        hidden = bf16_to_f32(d.get("hidden_bf16")[0])
        ids = d.get("topk_ids")[0]
        tw = d.get("topk_weights")[0]
        out = bf16_to_f32(d.get("out_bf16")[0])
        ref = bf16_to_f32(d.get("reference_bf16")[0])
    except (OSError, KeyError, ValueError) as e:
        print(f"layer_oracle: cannot read the inputs: {e}", file=sys.stderr)
        return 2
    if a.tokens > 0:
        hidden, ids, tw, out, ref = (v[:a.tokens] for v in (hidden, ids, tw, out, ref))
    S, H = hidden.shape
    x = quant_fp8(hidden)
    rows = np.zeros((S, ids.shape[1], H), np.float32)
    requant = a.requant == "group16-to-group32"
    experts = sorted(set(int(i) for i in ids.reshape(-1) if i >= 0))
    for e in experts:
        t, k = np.nonzero(ids == e)
        pw = tw[t, k].astype(np.float32) * np.float32(a.routed_scaling_factor)
        try:
            rows[t, k] = expert_rows(ck, layer, e, x[t], pw, requant, a.activation_clamp)
        except (OSError, KeyError, ValueError) as err:
            print(f"layer_oracle: layer {layer} expert {e}: cannot read {err}", file=sys.stderr)
            return 2
    acc = np.zeros((S, H), np.float32)
    for k in range(ids.shape[1]):  # FP32 sum over k ascending
        acc = np.where((ids[:, k] >= 0)[:, None], acc + rows[:, k], acc)
    want = round_bf16(acc).astype(np.float64)
    den = np.sqrt((want ** 2).sum())

    def rel(got):
        if not np.isfinite(got).all():
            return float("inf")
        return float(np.sqrt(((got.astype(np.float64) - want) ** 2).sum()) / (den if den > 0 else 1.0))

    r_out, r_ref = rel(out), rel(ref)
    ok = r_out <= a.tolerance and r_ref <= a.tolerance
    print(f"layer_oracle: {'PASS' if ok else 'FAIL'} layer {layer}, {S} tokens, "
          f"{len(experts)} experts, requant {a.requant}: "
          f"operator rel {r_out:.3g}, cpu-reference rel {r_ref:.3g} (tol {a.tolerance:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
