#!/usr/bin/env python3
"""Pack and load throughput of the packed store on a real-geometry synthetic checkpoint.

Makes a checkpoint with tools/make_synthetic_checkpoint.py (real Flash-Next shapes, fewer layers/experts), packs
it with `vavilov pack`, verifies it, and loads store and checkpoint with `vavilov logits` (one token), reading the
engine's own load summary ("loading DIR: 3.9 GB in 2.1 s (1.9 GB/s)"). "Cold" runs first drop the files from the
page cache with posix_fadvise(DONTNEED) (the host below a VM may still cache them: see the disk notes in the
result). Writes one JSON result.

    python3 bench/pack/bench_pack.py --binary build/vavilov --work /tmp/vavilov-pack-bench \\
        --out bench/results/$(date -u +%F)-pack-$(hostname).json
"""
import argparse
import datetime
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOAD_LINE = re.compile(r"loading (.*): ([\d.]+) (B|kB|MB|GB|TB) in ([\d.]+) s \(([\d.]+) (B|kB|MB|GB|TB)/s\)")
UNITS = {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def evict(path: str) -> None:
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run(cmd: list) -> tuple:
    start = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.monotonic() - start
    if result.returncode != 0:
        sys.exit("failed: %s\n%s" % (" ".join(cmd), result.stderr))
    return seconds, result.stderr


def load(binary: str, model: str, work: str, cold: bool) -> dict:
    if cold:
        evict(model)
    seconds, stderr = run([binary, "logits", "--model", model, "--ids", "1", "--out", os.path.join(work, "logits.f32")])
    match = [m for m in map(LOAD_LINE.search, stderr.splitlines()) if m][-1]
    loaded = float(match.group(2)) * UNITS[match.group(3)]
    load_seconds = float(match.group(4))
    return {"cold": cold, "weight_bytes": loaded, "load_seconds": load_seconds, "GB_per_s": loaded / load_seconds / 1e9,
            "command_seconds": round(seconds, 3)}


def disk_notes(path: str) -> dict:
    df = subprocess.run(["df", "--output=source,fstype,size", path], capture_output=True, text=True).stdout
    source, fstype, size = df.splitlines()[1].split()
    device = os.path.basename(source)
    notes = {"filesystem": fstype, "device": source, "size_1k_blocks": int(size)}
    rotational = "/sys/block/%s/queue/rotational" % device.rstrip("0123456789")
    if os.path.exists(rotational):
        notes["rotational_flag"] = open(rotational).read().strip() == "1"
    notes["kind"] = "virtio block device of a VM (the kernel reports it rotational; the host's storage is unknown)"
    return notes


def dd_write(work: str) -> float:
    """Sequential write speed of the disk: 2 GB with dd, synced."""
    path = os.path.join(work, "dd.tmp")
    start = time.monotonic()
    subprocess.run(["dd", "if=/dev/zero", "of=" + path, "bs=16M", "count=128", "conv=fdatasync"],
                   check=True, capture_output=True)
    seconds = time.monotonic() - start
    os.remove(path)
    return 128 * 16 * 2**20 / seconds / 1e9


def machine() -> dict:
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "")
    mem = next(int(l.split()[1]) for l in open("/proc/meminfo") if l.startswith("MemTotal"))
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(), "ram_GB": round(mem / 1e6, 1),
            "load_average_at_start": os.getloadavg()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "vavilov"))
    ap.add_argument("--config", default="/work/shared/data/flash-next/config.json")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--precisions", default="4", help="--experts of vavilov pack")
    ap.add_argument("--work", default="/tmp/vavilov-pack-bench")
    ap.add_argument("--out", required=True)
    ap.add_argument("--reuse", action="store_true", help="keep a checkpoint already made in --work")
    args = ap.parse_args()

    os.makedirs(args.work, exist_ok=True)
    checkpoint, store = os.path.join(args.work, "checkpoint"), os.path.join(args.work, "store")
    start, make_seconds = time.monotonic(), None
    if not (args.reuse and os.path.exists(os.path.join(checkpoint, "model.safetensors.index.json"))):
        subprocess.run([sys.executable, os.path.join(ROOT, "tools", "make_synthetic_checkpoint.py"), "--config",
                        args.config, "--layers", str(args.layers), "--experts", str(args.experts), "--out",
                        checkpoint], check=True)
        make_seconds = round(time.monotonic() - start, 1)
    with open(os.path.join(checkpoint, "config.json")) as f:
        made = json.load(f)
    if (made["num_hidden_layers"], made["num_experts"]) != (args.layers, args.experts):
        sys.exit("%s was made with other --layers/--experts; drop --reuse" % checkpoint)
    shutil.rmtree(store, ignore_errors=True)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": machine(), "disk": disk_notes(args.work),
              "checkpoint": {"config": args.config, "layers": args.layers, "experts_per_layer": args.experts,
                             "mtp_layers": 1, "bytes": dir_bytes(checkpoint), "write_seconds": make_seconds}}

    evict(checkpoint)
    seconds, _ = run([args.binary, "pack", "--model", checkpoint, "--out", store, "--experts", args.precisions])
    stored = dir_bytes(store)
    result["pack"] = {"experts": args.precisions, "seconds": round(seconds, 2), "store_bytes": stored,
                      "read_GB_per_s": result["checkpoint"]["bytes"] / seconds / 1e9,
                      "write_GB_per_s": stored / seconds / 1e9,
                      "note": "checkpoint evicted from the page cache first; includes quantization (quantize_rows) and fsync"}
    dense_store = os.path.join(args.work, "store-dense")
    shutil.rmtree(dense_store, ignore_errors=True)
    evict(checkpoint)
    seconds, _ = run([args.binary, "pack", "--model", checkpoint, "--out", dense_store, "--experts", "dense"])
    result["pack_dense_experts"] = {"seconds": round(seconds, 2), "store_bytes": dir_bytes(dense_store),
                                    "write_GB_per_s": dir_bytes(dense_store) / seconds / 1e9,
                                    "note": "no quantization: what the disk allows"}
    shutil.rmtree(dense_store)
    result["disk"]["dd_write_GB_per_s"] = dd_write(args.work)
    evict(store)
    seconds, _ = run([args.binary, "pack", "--verify", store])
    result["verify"] = {"seconds": round(seconds, 2), "GB_per_s": stored / seconds / 1e9, "cold": True}
    result["load_store"] = [load(args.binary, store, args.work, True), load(args.binary, store, args.work, False)]
    result["load_checkpoint"] = [load(args.binary, checkpoint, args.work, True),
                                 load(args.binary, checkpoint, args.work, False)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
