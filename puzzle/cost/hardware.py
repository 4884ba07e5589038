"""Accelerator profiles for the roofline model: peak dense FLOP/s per dtype, memory bandwidth and capacity.

Published datacenter GPUs, plus "this-machine": the current CPU, calibrated once per process by a
short measurement (fp32 matmul rate, copy bandwidth, per-op dispatch overhead, a cycle collection, the
sequence mixing of attention and Mamba, SiLU beyond a copy; about 2 s). A run
directory keeps its own calibration (`stored_calibration`, RUN_DIR/hardware.json), measured once and read
back by every later stage and command, so that its figures do not change with the machine's load.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import logging
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from puzzle.cost.timing import median_seconds
from puzzle.files import default_mode
from puzzle.spec import SpecError

_log = logging.getLogger(__name__)
TERA = 1e12
MIB = 1024**2
FEW_ROWS = 16  # matmuls with at most this many rows use HardwareProfile.few_rows_flops

# The defaults of every command, config and search that prices a deployment: the device, and the share of
# its memory a serving engine may use (vLLM's gpu_memory_utilization).
DEFAULT_HARDWARE = "h100-80gb"
DEFAULT_MEMORY_FRACTION = 0.9

# A compute dtype the hardware lacks runs at the rate of the next one up (nvfp4 on Hopper runs as fp8).
_FALLBACK = {"nvfp4": "fp8", "fp8": "bf16", "fp16": "bf16", "bf16": "fp32"}


@dataclass(frozen=True)
class HardwareProfile:
    """One device: `peak_flops` is ((dtype, dense FLOP/s), ...); bandwidth in bytes/s; memory in bytes.

    `op_overhead_s` is the fixed cost of dispatching one op. `eager` says which implementation the
    profile times: True = puzzle.blocks' plain-torch path, op by op (this machine); False = a serving
    engine's fused kernels (grouped-GEMM MoE, fused scan), a handful of kernels per block, each
    costing about a microsecond when replayed from CUDA graphs. `few_rows_flops`, when set, is the
    matmul rate for products with at most FEW_ROWS rows (decode of a small batch), which CPU BLAS
    runs far below its square-matrix rate; None means the peak applies at every size.

    `gpus` > 1: a server of that many devices serving one model copy with tensor and expert parallelism
    (`multi_gpu`): FLOP/s, bandwidth and memory are the devices' sums, and each block's output is
    all-reduced over the interconnect, `interconnect_bandwidth` bytes/s per device and direction.

    `collect_s`: one full run of Python's cycle collector in the calibrating process (`puzzle run` collects
    between stages to free dropped FSDP units; `puzzle.plan_time` prices it on eager profiles; a GPU plan
    leaves it out, negligible next to its stages). `stream_bandwidth`: bytes/s of a copy far larger than
    the caches (`memory_bandwidth` is a cache-resident one's; 0: not measured, the same), at which a training
    step's activations move: the backward reads what the forward wrote long before.

    `mixing_flops`: ((block kind, FLOP/s), ...), the rate of a kind's sequence mixing as its eager code runs it
    (measured on "this-machine": torch's causal SDPA for attention, `puzzle.blocks.ssd.ssd_chunk_scan` for
    Mamba). On a CPU these are many small chunk-sized products with exp, cumsum and masks between them, which
    run at a fraction of the square-matmul peak; `puzzle.plan_time` prices a kind's
    `prefill_mixing_flops_per_token` at this rate. A kind not listed (every GPU profile: fused kernels) runs
    its mixing at the matmul peak. `transcendental_s`: seconds per element of an elementwise transcendental
    function (SiLU, measured) beyond a copy of the same tensor: on one CPU thread such functions are
    compute-bound (about 1 ns per element against about 0.2 ns for the copy's traffic, which the activation
    traffic already prices); 0 on GPU profiles, whose fused kernels hide it under their memory traffic.
    `fresh_page_s`: seconds per byte of first writing freshly mapped memory beyond writing memory already
    mapped (the page faults and the kernel's zeroing of each page). A run on the CPU maps every allocation of
    at least `puzzle.hostmem`'s threshold on its own and unmaps it when freed, so each such tensor (a
    gradient, AdamW's temporaries, a head's chunk buffers) pays it again: measured here 0.45-0.96 ns per byte
    of CPU time, about 10x a streaming copy's. 0 on GPU profiles, whose caching allocator reuses device
    memory.
    """

    name: str
    peak_flops: tuple[tuple[str, float], ...]
    memory_bandwidth: float
    memory_bytes: int
    op_overhead_s: float = 0.0
    eager: bool = False
    few_rows_flops: float | None = None
    source: str = ""
    gpus: int = 1
    interconnect_bandwidth: float = 0.0
    collect_s: float = 0.0
    stream_bandwidth: float = 0.0
    mixing_flops: tuple[tuple[str, float], ...] = ()
    transcendental_s: float = 0.0
    fresh_page_s: float = 0.0

    def mixing_flops_per_s(self, kind: str, dtype: str = "bf16") -> float:
        """FLOP/s of `kind`'s sequence mixing (its calibrated rate, else the matmul peak in `dtype`)."""
        return dict(self.mixing_flops).get(kind) or self.flops_per_s(dtype)

    def matmul_flops_per_s(self, dtype: str = "bf16", rows: int | None = None) -> float:
        """FLOP/s of a matmul with `rows` rows (tokens); the few-rows rate where the profile has one."""
        if self.few_rows_flops is not None and rows is not None and rows <= FEW_ROWS:
            return self.few_rows_flops
        return self.flops_per_s(dtype)

    def flops_per_s(self, dtype: str = "bf16") -> float:
        """Peak dense FLOP/s for matmuls in `dtype`, falling back to wider dtypes the device has."""
        rates = dict(self.peak_flops)
        current = dtype
        while current not in rates:
            if current not in _FALLBACK:
                raise SpecError(
                    f"hardware {self.name!r} has no FLOP rate for {dtype!r}; it has {sorted(rates)}"
                )
            current = _FALLBACK[current]
        return rates[current]


# Sources: NVIDIA datasheets (dense, i.e. without 2:4 sparsity; "fp32" is the TF32 tensor-core rate).
# Capacities are what nvidia-smi reports as total memory, in MiB, since that is what an engine can
# allocate from (B200: the DGX B200 datasheet's 1,440 GB / 8).
PROFILES: dict[str, HardwareProfile] = {
    "h100-80gb": HardwareProfile(
        name="h100-80gb",
        # H100 SXM5 datasheet: FP8 3,958 / BF16 1,979 / TF32 989 TFLOPS *with sparsity*; halved here.
        peak_flops=(("fp8", 1978.9 * TERA), ("bf16", 989.4 * TERA), ("fp32", 494.7 * TERA)),
        memory_bandwidth=3.35e12,  # HBM3, 3.35 TB/s
        memory_bytes=81559 * MIB,  # nvidia-smi on H100 80GB HBM3
        op_overhead_s=1e-6,
        interconnect_bandwidth=450e9,  # NVLink 4: 900 GB/s both directions together
        source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)",
    ),
    "h200-141gb": HardwareProfile(
        name="h200-141gb",
        # Same compute as H100 SXM; more and faster memory.
        peak_flops=(("fp8", 1978.9 * TERA), ("bf16", 989.4 * TERA), ("fp32", 494.7 * TERA)),
        memory_bandwidth=4.8e12,  # HBM3e, 4.8 TB/s
        memory_bytes=143771 * MIB,  # nvidia-smi on H200 141GB
        op_overhead_s=1e-6,
        interconnect_bandwidth=450e9,  # NVLink 4: 900 GB/s both directions together
        source="NVIDIA H200 Tensor Core GPU datasheet (SXM)",
    ),
    "b200": HardwareProfile(
        name="b200",
        # HGX B200 per GPU: FP4 9 PF / FP8 4.5 PF / BF16 2.25 PF / TF32 1.1 PF dense (18/9/4.5/2.2 sparse).
        peak_flops=(
            ("nvfp4", 9000 * TERA),
            ("fp8", 4500 * TERA),
            ("bf16", 2250 * TERA),
            ("fp32", 1100 * TERA),
        ),
        memory_bandwidth=8.0e12,  # HBM3e, 8 TB/s
        memory_bytes=180 * 10**9,  # DGX B200: 1,440 GB over 8 GPUs
        op_overhead_s=1e-6,
        interconnect_bandwidth=900e9,  # NVLink 5: 1.8 TB/s both directions together
        source="NVIDIA HGX B200 / DGX B200 datasheets",
    ),
    "a100-80gb": HardwareProfile(
        name="a100-80gb",
        # A100 SXM4: BF16 312 TFLOPS, TF32 156 TFLOPS dense; no fp8 tensor cores (fp8 weights run as bf16).
        peak_flops=(("bf16", 312 * TERA), ("fp32", 156 * TERA)),
        memory_bandwidth=2.039e12,  # HBM2e, 2,039 GB/s
        memory_bytes=81920 * MIB,  # nvidia-smi on A100-SXM4-80GB
        op_overhead_s=1e-6,
        interconnect_bandwidth=300e9,  # NVLink 3: 600 GB/s both directions together
        source="NVIDIA A100 Tensor Core GPU datasheet (SXM4 80GB)",
    ),
}

ALIASES: dict[str, str] = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h200": "h200-141gb",
    "h200-sxm": "h200-141gb",
    "b200-180gb": "b200",
    "a100": "a100-80gb",
    "a100-sxm-80gb": "a100-80gb",
    "cpu": "this-machine",
    "local": "this-machine",
    "this_machine": "this-machine",
}


def _physical_memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


@functools.lru_cache(maxsize=1)
def calibrate_this_machine(clock: Callable[[], float] = time.perf_counter) -> HardwareProfile:
    """Measure this process's CPU as the CPU reference path sees it (cached per process, ~2 s).

    `clock`: wall time (the default), or `time.process_time` for the CPU time alone, as one thread would run
    on an idle machine (benchmarks/plan_vs_measured.py compares the plan with run.json's `cpu_seconds` so
    on a CPU other jobs share).

    Each figure is a median of timed calls after warm-up, the statistic `measure.py` reports, so that
    on a CPU shared with other processes prediction and measurement see the same load. Sized for
    the small models the CPU runs: the matmul rate is that of 512^3 fp32 products (CPU BLAS
    efficiency depends on size: larger products run faster, smaller ones slower), the few-rows rate
    that of a [4, 512] x [512, 2048] product (decode-sized); the bandwidth is a 4 MiB tensor copied
    into another (8 MiB moved, cache-resident like a small block's weights; DRAM streaming is
    slower); the per-op overhead is the time per op of a chain of tiny nn.Linear / ReLU modules
    (Python, module call and dispatch costs included); the mixing rates are those of torch's SDPA and of
    `ssd_chunk_scan` on a training micro-batch of small blocks (`_mixing_rates`); `transcendental_s` is a
    SiLU's time per element beyond a copy's. One rate serves every dtype: the CPU reference path runs fp32.
    Uses the process's torch thread count.
    """
    import torch
    from torch import nn

    with torch.inference_mode():
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        out = torch.empty(n, n)
        # A sample is several products back to back, so that it spans as long as a small model's prefill
        # and is time-sliced by other processes as much.
        products = 8

        def matmuls() -> None:
            for _ in range(products):
                torch.mm(a, b, out=out)

        matmul_s = median_seconds(matmuls, 5, clock=clock) / products
        matmul_flops = 2.0 * n**3 / matmul_s

        rows = torch.randn(4, n)
        weight = torch.randn(4 * n, n)  # 4 MiB, like a small block's projection
        few_rows_s = median_seconds(lambda: torch.nn.functional.linear(rows, weight), 9, clock=clock)
        few_rows_flops = 2.0 * rows.shape[0] * weight.numel() / few_rows_s

        src = torch.ones(MIB)  # 4 MiB of fp32
        dst = torch.empty_like(src)
        copy_s = median_seconds(lambda: dst.copy_(src), 9, clock=clock)
        bandwidth = 2.0 * src.numel() * src.element_size() / copy_s
        big = torch.ones(16 * MIB)  # 64 MiB of fp32: past the caches, as DRAM streams it
        big_out = torch.empty_like(big)
        stream_s = median_seconds(lambda: big_out.copy_(big), 5, clock=clock)
        stream_bandwidth = 2.0 * big.numel() * big.element_size() / stream_s

        layers = 10
        chain = nn.Sequential(*[module for _ in range(layers) for module in (nn.Linear(16, 16), nn.ReLU())])
        tiny = torch.randn(2, 16)
        overhead_s = median_seconds(lambda: chain(tiny), 15, clock=clock) / (2 * layers)
        mixing_flops = _mixing_rates(clock, overhead_s)
        # SiLU against a copy of the same 1 MiB tensor (a small block's activations at a training batch).
        values = torch.randn(MIB // 4)
        copied = torch.empty_like(values)
        silu_s = median_seconds(lambda: torch.nn.functional.silu(values, inplace=False), 9, clock=clock)
        plain_s = median_seconds(lambda: copied.copy_(values), 9, clock=clock)
        transcendental_s = max(silu_s - plain_s, 0.0) / values.numel()
        fresh_page_s = _fresh_page_seconds(clock)
    # The cycle collector's cost grows with the objects the process holds: measured here, it is that of the
    # process calibrating (the run's own when the run stores its calibration, RUN_DIR/hardware.json).
    collect_s = median_seconds(gc.collect, 3, warmup=1, clock=clock)

    return HardwareProfile(
        name="this-machine",
        peak_flops=(("fp32", matmul_flops),),
        memory_bandwidth=bandwidth,
        memory_bytes=_physical_memory_bytes(),
        op_overhead_s=overhead_s,
        eager=True,
        few_rows_flops=few_rows_flops,
        source=f"calibrated in-process ({torch.get_num_threads()} torch threads"
        + (", CPU time)" if clock is time.process_time else ")"),
        collect_s=collect_s,
        stream_bandwidth=stream_bandwidth,
        mixing_flops=mixing_flops,
        transcendental_s=transcendental_s,
        fresh_page_s=fresh_page_s,
    )


def _fresh_page_seconds(clock: Callable[[], float]) -> float:
    """Seconds per byte of filling a freshly mapped 8 MiB (an anonymous `mmap`, what glibc gives an
    allocation above its mmap threshold) beyond filling one already written. Timed on mappings of its own,
    so the process's allocator settings are neither needed nor changed."""
    import mmap

    import torch

    size = 8 * MIB
    warm = torch.empty(size // 4)
    warm.fill_(1.0)
    warm_s = median_seconds(lambda: warm.fill_(1.0), 9, clock=clock)

    def fresh() -> None:
        with mmap.mmap(-1, size) as mapped:
            tensor = torch.frombuffer(mapped, dtype=torch.float32)
            tensor.fill_(1.0)
            del tensor  # the buffer's export must end before the mapping closes

    fresh_s = median_seconds(fresh, 9, clock=clock)
    return max(fresh_s - warm_s, 0.0) / size


def _mixing_rates(clock: Callable[[], float], overhead_s: float) -> tuple[tuple[str, float], ...]:
    """The sequence mixing of attention and Mamba as `puzzle.blocks` runs it on the CPU, in FLOP/s of each
    kind's `prefill_mixing_flops_per_token` (`puzzle.cost.kinds`), at a training micro-batch of small blocks:
    4 sequences of 128 tokens, 4 heads of 32 channels (attention: 2 KV heads; Mamba: 2 groups of state 16,
    chunks of 64). Timed on the code itself: its products are chunk-sized (64 x 64 tiles, far below the
    512^3 matmul rate's efficiency) with exp, cumsum and masks between them."""
    import torch
    import torch.nn.functional as F

    from puzzle.blocks import ssd
    from puzzle.cost.kinds import block_cost
    from puzzle.spec import AttentionSpec, MambaSpec

    b, t, h, d = 4, 128, 4, 32
    attention = AttentionSpec(num_heads=h, num_kv_heads=2, head_dim=d)
    q = torch.randn(b, h, t, d)
    kv = torch.randn(b, 2, t, d)
    attention_s = median_seconds(
        lambda: F.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True), 5, clock=clock
    )
    mamba = MambaSpec(num_heads=h, head_dim=d, state_size=16, n_groups=2, chunk_size=64)
    x = torch.randn(b, t, h, d)
    dt = torch.full((b, t, h), 0.05)
    a = -torch.linspace(0.5, 2.0, h)
    groups = torch.randn(b, t, 2, mamba.state_size)
    scan_s = median_seconds(
        lambda: ssd.ssd_chunk_scan(x, dt, a, groups, groups, mamba.chunk_size), 5, clock=clock
    )
    # The scan's ops are dispatched one by one: `MambaCost.eager_ops` counts them per chunk (those beyond a
    # chunk-less call), and they are priced at the dispatch overhead, so the rate is that of the time beyond.
    cost = block_cost(mamba)
    scan_ops = cost.eager_ops(mamba, b, t, decode=False) - cost.eager_ops(mamba, b, 0, decode=False)
    rates = []
    for spec, seconds, ops in ((attention, attention_s, 1), (mamba, scan_s, scan_ops)):
        flops = b * t * block_cost(spec).prefill_mixing_flops_per_token(spec, t)
        # A tenth of the timing at least: a load spike during the overhead's measurement could leave none.
        rates.append((spec.kind, flops / max(seconds - ops * overhead_s, 0.1 * seconds)))
    return tuple(rates)


def hardware_names() -> list[str]:
    """Names `get_hardware` accepts (aliases excluded; any GPU profile also as `NxNAME`, e.g. 8xb200)."""
    return [*sorted(PROFILES), "this-machine"]


def multi_gpu(profile: HardwareProfile, gpus: int) -> HardwareProfile:
    """`gpus` devices of `profile` serving one model copy, tensor- and expert-parallel (named `8xb200`).

    Every block's weights, FLOPs, KV cache and recurrent state are split evenly over the devices (Mamba
    and attention by heads, experts by expert or by slice, embeddings and lm_head by vocabulary), so
    FLOP/s, bandwidth and memory add up; what does not scale is the per-kernel overhead (every device
    runs every kernel) and the all-reduce of each block's output over the interconnect, which
    `roofline.roofline_seconds` adds. Not modelled: KV heads replicated when there are fewer KV heads than
    devices (engines replicate them, or run attention data-parallel), and imbalance between experts.
    """
    if profile.eager or profile.gpus != 1:
        raise SpecError(f"{gpus}x{profile.name}: only a single-GPU profile can be multiplied")
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise SpecError(f"the number of GPUs must be a positive integer, found {gpus!r}")
    if gpus == 1:
        return profile
    return dataclasses.replace(
        profile,
        name=f"{gpus}x{profile.name}",
        peak_flops=tuple((dtype, rate * gpus) for dtype, rate in profile.peak_flops),
        memory_bandwidth=profile.memory_bandwidth * gpus,
        memory_bytes=profile.memory_bytes * gpus,
        gpus=gpus,
        source=f"{gpus} x {profile.source}, tensor/expert parallel",
    )


_MULTI = re.compile(r"(\d+)\s*x\s*(.+)")


def get_hardware(name: str | HardwareProfile) -> HardwareProfile:
    """A profile by name ("h100-80gb", "h200-141gb", "b200", "a100-80gb", "this-machine", or `NxNAME` for N
    GPUs of a GPU profile, e.g. "8xb200"); profiles pass through."""
    if isinstance(name, HardwareProfile):
        return name
    key = hardware_key(name)
    if key == "this-machine":
        return calibrate_this_machine()
    match = _MULTI.fullmatch(key)
    if match:
        return multi_gpu(PROFILES[match.group(2)], int(match.group(1)))
    return PROFILES[key]


def hardware_key(name: str) -> str:
    """The canonical name of hardware `name` (aliases and case resolved; "8 x B200" -> "8xb200"), without
    calibrating anything.

    Raises SpecError for a name `get_hardware` does not know.
    """
    text = name.strip().lower()
    match = _MULTI.fullmatch(text)
    if match:
        gpus, single = int(match.group(1)), hardware_key(match.group(2))
        if single == "this-machine" or gpus < 1:
            raise SpecError(
                f"hardware {name!r}: NxNAME needs N >= 1 and a GPU profile, one of {sorted(PROFILES)}"
            )
        return single if gpus == 1 else f"{gpus}x{single}"
    key = ALIASES.get(text, text)
    if key != "this-machine" and key not in PROFILES:
        raise SpecError(
            f"unknown hardware {name!r}; choose one of {hardware_names()} (or NxNAME, e.g. 8xb200)"
        )
    return key


def split_gpus(name: str) -> tuple[int, str]:
    """(N, the one GPU's canonical name) of hardware `name`: "8xb200" -> (8, "b200"), "h100" -> (1, "h100-80gb").

    Where each rank holds one GPU (`puzzle plan`, `puzzle run`'s plan check), `NxNAME` is N ranks of NAME,
    not one rank with N GPUs' memory. SpecError for a name `get_hardware` does not know."""
    key = hardware_key(name)
    match = _MULTI.fullmatch(key)
    return (int(match.group(1)), match.group(2)) if match else (1, key)


CALIBRATION_FORMAT = 1


def profile_to_json(profile: HardwareProfile) -> dict[str, Any]:
    """A profile as plain JSON data (`profile_from_json` reads it back, float for float)."""
    data = dataclasses.asdict(profile)
    data["peak_flops"] = [list(pair) for pair in profile.peak_flops]
    data["mixing_flops"] = [list(pair) for pair in profile.mixing_flops]
    return {"format": CALIBRATION_FORMAT, "profile": data}


def profile_from_json(data: Any, where: str) -> HardwareProfile:
    """The profile `profile_to_json` wrote; SpecError naming `where` (the file) if the data is not one."""
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise SpecError(f"{where}: expected a hardware calibration of format {CALIBRATION_FORMAT}")
    fields = data.get("profile")
    try:
        fields = dict(fields)
        fields["peak_flops"] = tuple((str(dtype), float(rate)) for dtype, rate in fields["peak_flops"])
        # Absent from calibrations stored before it was measured: the kinds then mix at the matmul peak.
        fields["mixing_flops"] = tuple((str(k), float(rate)) for k, rate in fields.get("mixing_flops", ()))
        return HardwareProfile(**fields)
    except (TypeError, ValueError, KeyError) as error:
        raise SpecError(f"{where}: not a hardware profile ({error})") from None


def _create_once(path: Path, data: bytes) -> bool:
    """Write `path` atomically unless it exists; False if another writer made it first (theirs is kept)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as file:
            file.write(data)
        os.chmod(temporary, default_mode())
        os.link(temporary, path)  # fails if the file exists: two processes never both win
        return True
    except FileExistsError:
        return False
    finally:
        Path(temporary).unlink(missing_ok=True)


def stored_calibration(path: str | Path) -> HardwareProfile:
    """This machine as calibrated once for a run and stored at `path` (RUN_DIR/hardware.json).

    Read back when the file exists (never re-measured: every stage and command of the run sees the same
    figures); otherwise measured now (`calibrate_this_machine`, fresh, at the process's torch thread
    count) and written. The first writer wins when two processes calibrate at once, and both use its
    figures. If the file cannot be written (a read-only run directory), the measurement is used with a
    warning. SpecError naming the file if it exists but is not a calibration.
    """
    path = Path(path)
    if not path.is_file():
        measured = calibrate_this_machine.__wrapped__()
        text = json.dumps(profile_to_json(measured), indent=2) + "\n"
        try:
            if _create_once(path, text.encode()):
                return measured
        except OSError as error:
            _log.warning("cannot store this machine's calibration in %s (%s): using it unstored", path, error)
            return measured
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise SpecError(f"{path}: cannot read the hardware calibration ({error})") from None
    return profile_from_json(data, str(path))
