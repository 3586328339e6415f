"""Writes the fuzz targets' seed corpora (nothing large is committed).

usage: make_seeds.py OUT_DIR [GOLDENS_DIR]

OUT_DIR/safetensors, OUT_DIR/manifest, OUT_DIR/cli and OUT_DIR/policy_table receive seeds that reach what the
hostile corpus (tests/hostile/corpus.py) reaches, at sizes libFuzzer can mutate
(run with -max_len=262144): values nested thousands deep in every field, headers with
thousands of tensors, huge declared shapes with no elements, NUL bytes, escape codes,
deep manifest params, argument lists for every option with edge values, and policy tables
(policy/policies.json whole and cut down, deep, duplicate keys, NUL, escapes, 300 policies).
"""

import json
import os
import struct
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "hostile"))
from corpus import dumps, entry, kda_inputs, nested, safetensors_bytes  # noqa: E402


def main():
    out = sys.argv[1]
    goldens = sys.argv[2] if len(sys.argv) > 2 else None
    seeds = {"safetensors": {}, "manifest": {}, "cli": {}, "policy_table": {}}
    st = seeds["safetensors"]

    header, data = kda_inputs(B=1, T=2, H=1, HV=2, K=2, V=2)
    st["valid_kda"] = safetensors_bytes(dumps(header), data)
    for field in ("dtype", "shape", "data_offsets"):
        h = {name: dict(e) for name, e in header.items()}
        h["q"][field] = "PLACEHOLDER"
        st[f"deep_{field}"] = safetensors_bytes(dumps(h).replace('"PLACEHOLDER"', nested(5000)), data)
    st["deep_metadata"] = safetensors_bytes(dumps({"__metadata__": {"k": "P"}, **header}).replace('"P"', nested(5000)), data)
    st["deep_objects"] = safetensors_bytes('{"q":' + '{"a":' * 5000 + "0" + "}" * 5001)
    many = dict(header)
    for i in range(3000):
        many[f"t{i}"] = entry("U8", [0], len(data), len(data))
    st["many_tensors"] = safetensors_bytes(dumps(many), data)
    huge = {"q": entry("F64", [2 ** 40, 0, 1, 15000], 0, 0), "k": entry("F64", [2 ** 40, 0, 1, 15000], 0, 0),
            "v": entry("F64", [1, 0, 2 ** 36, 1], 0, 0), "z": entry("F64", [0, 2 ** 62, 2 ** 62], 0, 0),
            "w": entry("F64", [2 ** 62], 0, 0), "r": entry("U8", [1] * 64, 0, 1)}
    st["huge_shapes"] = safetensors_bytes(dumps(huge), b"\0")
    st["nul_in_header"] = safetensors_bytes(dumps(header).encode() + b"\0garbage", data)
    st["escapes"] = safetensors_bytes(json.dumps({"\x1b]0;x\x07\u009b": entry("U8", [1], 0, 1),
                                                  "__metadata__": {"\x1b[2J": "\u202e"}}), b"\1")
    st["empty"] = b""
    st["length_only"] = struct.pack("<Q", 2 ** 64 - 1)
    if goldens:
        for name in ("kda_t1", "qb_solver_m8_n4_k1_all_equal", "attnres_block_zero_queries"):
            path = os.path.join(goldens, name + ".safetensors")
            if os.path.exists(path):
                st["golden_" + name] = open(path, "rb").read()

    mf = seeds["manifest"]
    case = {"name": "kda_t1", "op": "kda.recurrent", "file": "kda_t1.safetensors", "seed": 1, "bytes": 4450,
            "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855", "params": {"T": 1}}
    manifest = {"format": "k3ref-golden-manifest", "suite": "default", "generator_version": "1", "cases": [case]}
    mf["valid"] = json.dumps(manifest, indent=2).encode()
    mf["subset"] = json.dumps({**manifest, "subset": True}).encode()
    mf["deep_params"] = json.dumps(manifest).replace('{"T": 1}', nested(3000)).encode()
    mf["deep_objects"] = json.dumps(manifest).replace('{"T": 1}', nested(3000, '{"a":', "}")).encode()
    mf["many_cases"] = json.dumps({**manifest, "cases": [dict(case, name=f"c{i}", file=f"c{i}.safetensors")
                                                         for i in range(900)]}).encode()
    mf["nul"] = mf["valid"] + b"\0garbage"
    if goldens and os.path.exists(os.path.join(goldens, "MANIFEST.json")):
        mf["committed_head"] = open(os.path.join(goldens, "MANIFEST.json"), "rb").read()[:200000]

    cli = seeds["cli"]
    def args(*a):
        return b"\0".join(x.encode() if isinstance(x, str) else x for x in a)
    cli["kda_scale_nan"] = args("kda", "--in", "x", "--out", "y", "--scale", "nan", "--threads", "4294967297")
    cli["kda_force"] = args("kda", "--in", "x", "--out", "x", "--force", "--gate", "lower_bound", "--lower-bound", "-inf")
    cli["compare_window"] = args("compare", "--golden", "g", "--candidate", "c", "--window", "9223372036854775808",
                                 "--policy", "floor:nan", "--tensors", "o,final_state")
    cli["generate_only"] = args("golden", "generate", "--only", "kda_t1", "--only", "kda_t1", "--out", "d", "-j", "0")
    cli["verify"] = args("golden", "verify", "--dir", "d", "--generated", "g", "-j", "-1")
    cli["non_utf8"] = args("kda", "--in", b"\xff\xfe", "--out", b"o\xff")

    pt = seeds["policy_table"]
    table_path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "policy", "policies.json")
    table = json.load(open(table_path))
    pt["committed"] = open(table_path, "rb").read()
    pt["compact"] = json.dumps(table, separators=(",", ":")).encode()
    op = "kda.recurrent"
    small = {"format": table["format"], "version": table["version"],
             "operators": {op: table["operators"][op]},
             "policies": {"p": {"about": "x", "rules": {op: {"output": {"metric": "floor", "multiple": 2},
                                                              "stage": {"metric": "rel-rms", "bound": 1e-3},
                                                              "gradient": {"metric": "max-abs-ulps", "ulps": 4,
                                                                           "floor_dtype": "bf16"}}}}}}
    pt["small"] = json.dumps(small).encode()
    pt["deep_about"] = json.dumps({**small, "about": "P"}).replace('"P"', nested(3000)).encode()
    pt["dup_keys"] = pt["small"].replace(b'"version": 1', b'"version": 1, "version": 1')
    pt["nul"] = pt["small"] + b"\0garbage"
    pt["escapes"] = json.dumps({**small, "policies": {"\x1b[2J\n": {"rules": {}}}}).encode()
    pt["many_policies"] = json.dumps({**small, "policies": {f"p{i}": small["policies"]["p"] for i in range(300)}}).encode()
    pt["non_finite"] = pt["small"].replace(b'"multiple": 2', b'"multiple": 1e999')

    for target, files in seeds.items():
        os.makedirs(os.path.join(out, target), exist_ok=True)
        for name, content in files.items():
            with open(os.path.join(out, target, name), "wb") as f:
                f.write(content)
    print(f"seeds in {out}: " + ", ".join(f"{t} {len(f)}" for t, f in seeds.items()))


if __name__ == "__main__":
    main()
