"""``tide bench unit-io | trace``: the prompt cache's I/O and hit rates (``directory_bench``: its directory)."""

from __future__ import annotations

import json
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachedir.hashing import Namespace, chain_keys
from cachedir.layout import LAYOUTS
from cachedir.store import StoreConfig, UnitStore
from cachedir.trace import read_trace, replay, unique_unit_count
from cachedir.unit import Unit
from deploy.bench.machine import machine

UNIT_TOKENS = 64
READ_RUN_UNITS = 128  # units a request persists and loads together in the I/O bench (an 8K-token prompt)
# (layers, values per token, dtype, bytes per value)
UNIT_SHAPES = {
    "bench_model": (8, 160, "float32", 4),  # the bench config, fp32 on CPU
    "deepseek_v3": (61, 576, "bfloat16", 2),  # ~4.3 MiB
}


def bench_unit_bytes() -> int:
    layers, dim, _, item = UNIT_SHAPES["bench_model"]
    return layers * UNIT_TOKENS * dim * item


IO_THREADS = 4  # the store's reader threads: the queue depth fio is given
SEGMENT_READ_BYTES = 4 << 20  # the segment layout's longest coalesced read (cachedir/layout.py)


def fio_raw(path: Path, nbytes: int, block: int, depth: int = IO_THREADS) -> dict[str, float]:
    """The disk's raw speed from fio (Debian package ``fio``): ``nbytes`` written (fsync at the
    end) and read back in ``block``-sized O_DIRECT requests, ``depth`` in flight; GB/s."""
    exe = shutil.which("fio")
    if exe is None:
        raise RuntimeError("fio is not installed: the raw baseline comes from it (apt-get install fio)")
    size = max(block, nbytes // block * block)
    out = {}
    for rw, extra in (("write", ["--end_fsync=1"]), ("read", [])):
        r = subprocess.run([exe, "--name=raw", f"--filename={path}", f"--size={size}", f"--bs={block}",
                            f"--rw={rw}", "--direct=1", "--ioengine=libaio", f"--iodepth={depth}",
                            "--output-format=json", *extra], capture_output=True, text=True, timeout=600)
        if r.returncode:
            raise RuntimeError(f"fio --rw={rw} failed: {(r.stdout + r.stderr)[-500:]}")
        job = json.loads(r.stdout[r.stdout.index("{"):])["jobs"][0][rw]
        out[f"{rw}_gb_per_s"] = job["bw_bytes"] / 1e9
    path.unlink(missing_ok=True)
    return out


def _units(shape: str, count: int) -> tuple[Namespace, list[Unit]]:
    layers, dim, dtype, item = UNIT_SHAPES[shape]
    ns = Namespace(f"bench-{shape}", "0", dtype, f"latent:{dim}", UNIT_TOKENS)
    tokens = np.arange(count * UNIT_TOKENS) % 50_000
    keys = chain_keys(ns.seed, tokens, UNIT_TOKENS)
    size = layers * UNIT_TOKENS * dim * item
    payloads = np.random.default_rng(1).bytes(size * len(keys))  # no two units alike (a disk
    units, parent = [], ns.seed  # that deduplicates or compresses would flatter repeated ones)
    for i, k in enumerate(keys):
        toks = tuple(int(t) for t in tokens[i * UNIT_TOKENS : (i + 1) * UNIT_TOKENS])
        payload = payloads[i * size : (i + 1) * size]
        units.append(Unit(ns.seed, k, parent, toks, payload, layers, dim, dtype))
        parent = k
    return ns, units


class _StoreRuns:
    """Units written and read as the engine does: runs of ``run_units`` (a prompt's units)
    persisted together, all queued at once; read back cold one run after another, each released
    once read (the engine copies it into its KV pool)."""

    def __init__(self, root: Path, layout: str, ns: Namespace, units: list[Unit], run_units: int) -> None:
        self.root, self.ns, self.units, self.run_units = root, ns, units, run_units
        self.runs = [units[i : i + run_units] for i in range(0, len(units), run_units)]
        self.store = UnitStore(StoreConfig(root, capacity_bytes=1 << 42, io_threads=IO_THREADS, layout=layout))

    def write(self) -> float:
        t0 = time.perf_counter()
        for f in [f for run in self.runs for f in self.store.put_many_async(run)]:
            assert f.result()
        return time.perf_counter() - t0

    def read(self, units: list[Unit]) -> float:
        """Seconds to read ``units`` (some of those written) back cold, run after run."""
        for u in units:
            self.store.drop_page_cache(u.key)
        runs = [units[i : i + self.run_units] for i in range(0, len(units), self.run_units)]
        t0 = time.perf_counter()
        for run in runs:
            got = self.store.get_many_async([u.key for u in run], self.ns.seed, [u.token_ids for u in run]).result()
            assert all(g is not None for g in got)
            del got
        return time.perf_counter() - t0

    def close(self) -> None:
        self.store.close()
        shutil.rmtree(self.root, ignore_errors=True)


def _integrity_costs(ns: Namespace, units: list[Unit], repeats: int, fio_read_gb_per_s: float) -> dict[str, Any]:
    """What authenticating units costs the host, per unit on one core (median of ``repeats``):
    the keyed chain hash (BLAKE2b-128) against the unkeyed xxh3-128 it replaced; sealing a unit
    (AES-256-GCM: encrypt and tag) and opening it (decrypt and verify) as the cache does, against
    the xxh3-64 checksum every unit also carries; ``open_over_fio_read``: how many times faster
    than ``fio_read_gb_per_s`` (the disk, measured in the same run) a unit is opened."""
    import xxhash

    from cachedir.hashing import unit_mac_key
    from cachedir.unitfile import open_sealed, seal

    raw = [np.asarray(u.token_ids, dtype="<u4").tobytes() for u in units]
    tokens = np.concatenate([np.asarray(u.token_ids, dtype=np.int64) for u in units])
    headers = [u.encode_parts()[0] for u in units]
    key = unit_mac_key(b"bench-secret-0123456789", ns.seed)
    sealed = [seal(key, h, u.payload) for h, u in zip(headers, units, strict=True)]
    out = bytearray(len(units[0].payload) + 15)  # the cache opens each unit into a buffer of its own

    def per_unit(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) / len(units))
        return statistics.median(times)

    blake = per_unit(lambda: chain_keys(ns.seed, tokens, UNIT_TOKENS))
    xxh = per_unit(lambda: [xxhash.xxh3_128_digest(ns.seed + r) for r in raw])
    seal_s = per_unit(lambda: [seal(key, h, u.payload) for h, u in zip(headers, units, strict=True)])
    open_s = per_unit(lambda: [open_sealed(key, h, mac, stored, out)
                               for h, (mac, stored) in zip(headers, sealed, strict=True)])
    checksum = per_unit(lambda: [xxhash.xxh3_64_intdigest(u.payload) for u in units])
    unit_bytes = len(units[0].payload)
    opened = unit_bytes / open_s / 1e9
    return {
        "key_hash_us_per_unit": {"blake2b_128_keyed": round(blake * 1e6, 2), "xxh3_128": round(xxh * 1e6, 2)},
        "seal": "AES-256-GCM",
        "seal_us_per_unit": round(seal_s * 1e6, 1), "seal_gb_per_s": round(unit_bytes / seal_s / 1e9, 3),
        "open_us_per_unit": round(open_s * 1e6, 1), "open_gb_per_s": round(opened, 3),
        "open_over_fio_read": round(opened / fio_read_gb_per_s, 2) if fio_read_gb_per_s else None,
        "checksum_us_per_unit": round(checksum * 1e6, 1), "checksum_gb_per_s": round(unit_bytes / checksum / 1e9, 3),
    }


def run_unit_io(
    root: Path | None = None, total_mb: int = 256, layouts: tuple[str, ...] = LAYOUTS,
    run_units: int = READ_RUN_UNITS, repeats: int = 3,
) -> dict[str, Any]:
    """Medians of ``repeats`` (each repeat measures fio and every layout, so drift hits all alike)."""
    out: dict[str, Any] = {**machine(), "total_mb_per_measurement": total_mb, "read_mode": "cold (page cache dropped)",
                           "run_units": run_units, "repeats": repeats, "io_threads": IO_THREADS,
                           "raw": "fio, O_DIRECT, libaio, queue depth = the store's I/O threads"}
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        base = Path(tmp)
        for shape in UNIT_SHAPES:
            layers, dim, dtype, item = UNIT_SHAPES[shape]
            unit_bytes = layers * UNIT_TOKENS * dim * item
            count = max(8, total_mb * 2**20 // unit_bytes)
            # the reads are timed on units of their own: the warm-up pass (staging buffers in use,
            # as in a running server) reads another set, so no file's read-ahead is warm
            ns, both = _units(shape, 2 * count)
            warm, units = both[:count], both[count:]
            nbytes = sum(len(u.payload) for u in units)
            # the block the store reads: one unit (unit layout), coalesced runs (segment layout)
            blocks = {"unit": unit_bytes, "segment": max(unit_bytes, min(SEGMENT_READ_BYTES, run_units * unit_bytes))}
            runs: dict[str, list[tuple[float, float]]] = {name: [] for name in (*(f"fio_{x}" for x in layouts), *layouts)}
            for _ in range(repeats):
                for name in layouts:
                    raw = fio_raw(base / "raw.bin", nbytes, blocks[name])
                    runs[f"fio_{name}"].append((raw["write_gb_per_s"], raw["read_gb_per_s"]))
                    target = _StoreRuns(base / f"{shape}-{name}", name, ns, warm + units, run_units)
                    try:
                        write_s = target.write()
                        target.read(warm)
                        read_s = target.read(units)
                        runs[name].append((2 * nbytes / write_s / 1e9, nbytes / read_s / 1e9))
                    finally:
                        target.close()
            result: dict[str, Any] = {"unit_bytes": unit_bytes, "units": count}
            for layout in layouts:
                raw_w = statistics.median(w for w, _ in runs[f"fio_{layout}"])
                raw_r = statistics.median(r for _, r in runs[f"fio_{layout}"])
                w = statistics.median(w for w, _ in runs[layout])
                r = statistics.median(r for _, r in runs[layout])
                result[layout] = {
                    "block_bytes": blocks[layout],
                    "fio_write_gb_per_s": round(raw_w, 3), "fio_read_gb_per_s": round(raw_r, 3),
                    "write_gb_per_s": round(w, 3), "read_gb_per_s": round(r, 3),
                    "read_range": [round(min(x for _, x in runs[layout]), 3), round(max(x for _, x in runs[layout]), 3)],
                    "write_fraction_of_raw": round(w / raw_w, 3),
                    "read_fraction_of_raw": round(r / raw_r, 3),
                }
            fio = max((result[layout]["fio_read_gb_per_s"] for layout in layouts), default=0.0)
            result["integrity"] = _integrity_costs(ns, units, repeats, fio)
            out[shape] = result
    return out


def run_trace(
    trace: Path, policies: list[str], capacity_gb: float | None, capacity_fraction: float | None,
    unit_tokens: int, unit_bytes: int, ram_gb: float | None, eviction: str, limit: int | None,
) -> dict[str, Any]:
    requests = list(read_trace(trace, limit))
    unique = unique_unit_count(requests, unit_tokens)
    if capacity_fraction is not None:
        capacity = int(unique * unit_bytes * capacity_fraction)
    elif capacity_gb is not None:
        capacity = int(capacity_gb * 1e9)
    else:
        capacity = None
    results = []
    for policy in policies:
        t0 = time.perf_counter()
        r = replay(requests, policy, capacity, unit_bytes, unit_tokens,
                   int(ram_gb * 1e9) if ram_gb else None, eviction)
        results.append({**r.as_dict(), "replay_s": round(time.perf_counter() - t0, 2)})
    out: dict[str, Any] = {
        "trace": str(trace),
        "requests": len(requests),
        "unit_tokens": unit_tokens,
        "unit_bytes": unit_bytes,
        "unique_unit_bytes": unique * unit_bytes,
        "capacity_bytes": capacity,
        "eviction": eviction,
    }
    if len(results) == 1:
        out.update(results[0])
    else:
        out["policies"] = results
    return out
