"""GPU cards as data: the figures gpukit plans with for the cards people train on (T4, L4, A10G, A100, H100, H200).

Every figure is the one the vendor's data sheet prints, with its source (URL, document, the words quoted) in
``Card.sources``; a figure the sheet does not print is ``None``, never a guess. Two exceptions say so in their
sources: the T4's bandwidth is its product page's, and the A10G, AWS's variant of the A10 with no sheet of its own,
has the A10 sheet's figures. Two fields are no vendor's: ``torch_total_memory``, what
``torch.cuda.get_device_properties(0).total_memory`` reports, which no data sheet gives and which is filled only
where a public report is recorded (its source says which); and ``context_allowance``, the memory a CUDA process
holds beyond PyTorch's, None (gpukit's 1 GiB) unless you set it. The words quoted in the sources were taken from
copies of the sheets' tables, not read from the PDFs themselves: check a figure there before relying on its last
digit.

Units: ``memory_bytes`` is the sheet's "GB" read as the SI unit (16 GB = 16 * 10**9 bytes): a marketing figure,
not a capacity to plan against (the physical DRAM is usually a binary size, and what torch reports is less again,
after the driver's and ECC's shares). ``memory_bandwidth`` is in bytes/s, the sheet's GB/s or TB/s read as SI.
TFLOP/s are 10**12 operations a second, the tensor-core figures dense: data sheets often print the figure "with
sparsity" (2:4 structured sparsity, twice the dense one, marked with an asterisk); where a sheet prints only that
one, the dense figure here is half of it, and the source says so.

    from gpukit.cards import card
    h100 = card("NVIDIA H100 80GB HBM3")      # or "h100", "H100"; torch.cuda.get_device_name() spellings work
    h100.bf16_tflops, h100.flash_attention     # 989.5, True
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

import torch

__all__ = ["Card", "CARDS", "card", "FIGURES", "REHEARSE_VAR", "rehearsed_card"]

# The fields that hold a figure; each has its source in Card.sources (the data sheet's URL first) where not None.
FIGURES = ("memory_bytes", "memory_bandwidth", "compute_capability", "fp16_tflops", "fp16_sparse_tflops",
           "bf16_tflops", "bf16_sparse_tflops", "fp32_tflops", "torch_total_memory")

# -- the documents ----------------------------------------------------------------------------------------------

CUDA_GPUS = "https://developer.nvidia.com/cuda-gpus"  # NVIDIA's "CUDA GPUs - Compute Capability" list
T4_SHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/tesla-t4/"
            "t4-tensor-core-datasheet-951643.pdf")  # "NVIDIA T4 Tensor Core GPU" data sheet
T4_PAGE = "https://www.nvidia.com/en-us/data-center/tesla-t4/"  # NVIDIA T4 product page, its specifications table
L4_SHEET = "https://nvdam.widen.net/s/rvq98gbwsw/l4-datasheet-2595652"  # "NVIDIA L4 Tensor Core GPU" data sheet
A10_SHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a10/pdf/"
             "a10-datasheet.pdf")  # "NVIDIA A10 Tensor Core GPU" data sheet
A100_SHEET = ("https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
              "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf")  # "NVIDIA A100 Tensor Core GPU" data sheet
H100_SHEET = "https://resources.nvidia.com/en-us-gpu-resources/h100-datasheet-24306"  # "NVIDIA H100 Tensor Core GPU"
H200_SHEET = ("https://nvdam.widen.net/s/nb5zzzsjdf/"
              "hpc-datasheet-sc23-h200-datasheet-3002446")  # "NVIDIA H200 Tensor Core GPU" data sheet
A10G_VS_A10 = "https://www.baseten.co/blog/nvidia-a10-vs-a10g-for-ml-model-inference/"  # Baseten, not a vendor
SDP_UTILS = ("https://github.com/pytorch/pytorch/blob/main/aten/src/ATen/native/transformers/cuda/sdp_utils.cpp")

# PyTorch's fused attention kernels, as aten/src/ATen/native/transformers/cuda/sdp_utils.cpp gates them (read at
# pytorch main, commit 001f694): check_flash_attention_hardware_support accepts check_sm_version<sm80, sm121>, and
# check_dtypes_flash_attention float16 and bfloat16 only; check_mem_efficient_hardware_support accepts
# check_sm_version<sm50, sm121>, and can_use_mem_efficient_attention takes float16 and float32 below sm80
# (less_than_sm80_mem_efficient_dtypes) and bfloat16 too where dprop->major >= 8. The upper bounds have moved
# between releases as new architectures came; every card here is sm90 or older, well inside them.
FLASH_SM = ((8, 0), (12, 1))
MEM_EFFICIENT_SM = ((5, 0), (12, 1))

GB, TB = 10**9, 10**12
MiB = 2**20


def _dense_of_sparse(sparse_tflops: float) -> float:
    """The dense tensor-core figure where a sheet prints only the one "with sparsity" (2:4 sparsity doubles it)."""
    return sparse_tflops / 2


@dataclass(frozen=True)
class Card:
    """One GPU card, its figures as its data sheet prints them (``sources`` says where each comes from)."""

    key: str                              # lower-case: "t4", "a100-80gb", ...
    name: str                             # the card's full name, form factor included where it matters
    memory_text: str                      # the sheet's memory line as printed: "16 GB GDDR6"
    memory_bytes: int                     # that figure in bytes, its "GB" read as SI: 16 GB = 16 * 10**9
    bandwidth_text: str                   # the sheet's memory bandwidth as printed: "300GB/s"
    memory_bandwidth: float               # bytes/s, SI
    compute_capability: tuple[int, int]   # (major, minor), NVIDIA's CUDA GPUs list
    fp16_tflops: float                    # float16 on tensor cores, dense
    fp16_sparse_tflops: float | None      # "with sparsity"; None where the card has none (Turing)
    bf16_tflops: float | None             # bfloat16 on tensor cores, dense; None where it has none
    bf16_sparse_tflops: float | None
    fp32_tflops: float                    # float32 on CUDA cores (not TF32 tensor cores)
    torch_total_memory: int | None        # torch.cuda.get_device_properties().total_memory, where a report is known
    sources: Mapping[str, str] = field(compare=False, hash=False, repr=False)  # figure field -> "URL (what)"
    # No data sheet's either: GPU memory a CUDA process holds beyond PyTorch's (its CUDA context, cuBLAS and
    # cuDNN), bytes; None: gpukit's allowance (``gpukit.allocator.CONTEXT_ALLOWANCE``, 1 GiB). ``gpukit.plan``
    # adds it to every need; measure yours and set it with ``dataclasses.replace(card, context_allowance=...)``.
    context_allowance: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "memory_bandwidth", float(self.memory_bandwidth))
        object.__setattr__(self, "sources", MappingProxyType(dict(self.sources)))  # read-only, as the card is

    @property
    def device_bytes(self) -> int:
        """The memory a simulated device of this card gets: what torch reports as its total where a report is
        recorded (a T4's 14,930 MiB), else the data sheet's figure (an H100's 80 GB)."""
        return self.torch_total_memory or self.memory_bytes

    @property
    def bf16_tensor_cores(self) -> bool:
        """Whether bfloat16 runs on tensor cores: compute capability 8.0 (Ampere) and later. On a T4 (7.5) bfloat16
        has none: its matmuls are far slower than float16's, and ``torch.cuda.is_bf16_supported()`` says True only
        by counting emulation (``including_emulation=True``, the default)."""
        return self.compute_capability >= (8, 0)

    @property
    def flash_attention(self) -> bool:
        """Whether PyTorch's flash attention kernel (``SDPBackend.FLASH_ATTENTION``) runs on this card: sm80 to
        sm121 (``check_flash_attention_hardware_support`` in sdp_utils.cpp), for float16 and bfloat16 inputs."""
        low, high = FLASH_SM
        return low <= self.compute_capability <= high

    @property
    def efficient_attention_dtypes(self) -> tuple[torch.dtype, ...]:
        """The dtypes PyTorch's memory-efficient attention kernel (``SDPBackend.EFFICIENT_ATTENTION``) takes here:
        float16 and float32 from sm50, bfloat16 too from sm80 (``can_use_mem_efficient_attention`` in
        sdp_utils.cpp); none outside sm50 to sm121. Elsewhere attention runs the math fallback, which keeps the
        whole attention matrix."""
        low, high = MEM_EFFICIENT_SM
        if not low <= self.compute_capability <= high:
            return ()
        if self.compute_capability >= (8, 0):
            return (torch.float16, torch.float32, torch.bfloat16)
        return (torch.float16, torch.float32)

    def fast_dtypes(self) -> tuple[torch.dtype, ...]:
        """The autocast dtypes with tensor-core throughput here, the preferred first: bfloat16 (no loss scaling
        needed) then float16 from sm80, float16 alone on sm70 to sm75 (the T4). float32 is not listed: its matmuls
        reach TF32 tensor cores only when asked (``torch.set_float32_matmul_precision("high")``), and float8
        (L4, H100, H200) is not an autocast dtype."""
        if self.bf16_tensor_cores:
            return (torch.bfloat16, torch.float16)
        if self.compute_capability >= (7, 0):
            return (torch.float16,)
        return ()


# -- the cards --------------------------------------------------------------------------------------------------

_T4 = Card(
    key="t4", name="NVIDIA T4",
    memory_text="16 GB GDDR6", memory_bytes=16 * GB,
    bandwidth_text="320+ GB/s", memory_bandwidth=320 * GB,
    compute_capability=(7, 5),
    fp16_tflops=65.0, fp16_sparse_tflops=None,  # Turing's tensor cores have no structured sparsity
    bf16_tflops=None, bf16_sparse_tflops=None,
    fp32_tflops=8.1,
    torch_total_memory=14_930 * MiB,
    sources={
        "memory_bytes": f"{T4_SHEET} (NVIDIA T4 Tensor Core GPU data sheet: GPU Memory '16 GB GDDR6')",
        "memory_bandwidth": f"{T4_PAGE} (NVIDIA T4 product page, specifications: '320+ GB/s'. The data sheet PDF "
                            f"prints '300 GB/sec'; NVIDIA's T4 board product brief 'Up to 320 GBytes/s', a 256-bit "
                            f"bus at 5001 MHz)",
        "compute_capability": f"{CUDA_GPUS} (CUDA GPUs list: T4, 7.5)",
        "fp16_tflops": f"{T4_SHEET} (data sheet: 'Mixed-Precision (FP16/FP32) 65 TFLOPS', dense: Turing has no "
                       f"sparsity)",
        "fp16_sparse_tflops": f"{T4_SHEET} (data sheet: no sparse figure; Turing has no structured sparsity)",
        "bf16_tflops": f"{CUDA_GPUS} (compute capability 7.5: Turing's tensor cores take FP16, INT8, INT4, not "
                       f"BF16; the T4 data sheet {T4_SHEET} lists no BF16 figure)",
        "bf16_sparse_tflops": f"{T4_SHEET} (data sheet: no BF16 figure)",
        "fp32_tflops": f"{T4_SHEET} (data sheet: 'Single-Precision 8.1 TFLOPS')",
        "torch_total_memory": "gpukit tests/test_t4.py, T4_BYTES: 14,930 MiB, the least total_memory Colab users "
                              "report (15,095 MiB the usual report); not measured here, no GPU was lent",
    },
)

_L4 = Card(
    key="l4", name="NVIDIA L4",
    memory_text="24GB", memory_bytes=24 * GB,
    bandwidth_text="300GB/s", memory_bandwidth=300 * GB,
    compute_capability=(8, 9),
    # The L4 sheet prints only the figures with sparsity ('242 teraFLOPS*'): the dense ones are their halves.
    fp16_tflops=_dense_of_sparse(242), fp16_sparse_tflops=242.0,
    bf16_tflops=_dense_of_sparse(242), bf16_sparse_tflops=242.0,
    fp32_tflops=30.3,
    torch_total_memory=None,
    sources={
        "memory_bytes": f"{L4_SHEET} (NVIDIA L4 Tensor Core GPU data sheet: GPU memory '24GB')",
        "memory_bandwidth": f"{L4_SHEET} (data sheet: GPU memory bandwidth '300GB/s')",
        "compute_capability": f"{CUDA_GPUS} (CUDA GPUs list: L4, 8.9)",
        "fp16_tflops": f"{L4_SHEET} (data sheet: FP16 Tensor Core '242 teraFLOPS*', * with sparsity; halved here)",
        "fp16_sparse_tflops": f"{L4_SHEET} (data sheet: FP16 Tensor Core '242 teraFLOPS*', * with sparsity)",
        "bf16_tflops": f"{L4_SHEET} (data sheet: BFLOAT16 Tensor Core '242 teraFLOPS*', * with sparsity; halved here)",
        "bf16_sparse_tflops": f"{L4_SHEET} (data sheet: BFLOAT16 Tensor Core '242 teraFLOPS*', * with sparsity)",
        "fp32_tflops": f"{L4_SHEET} (data sheet: FP32 '30.3 teraFLOPs')",
    },
)

# The A10G is AWS's variant of the A10 (EC2 G5 instances), with no NVIDIA data sheet of its own: its figures are the
# A10 sheet's. Memory and bandwidth match (24 GB GDDR6, 600 GB/s); its clocks differ and AWS states its throughput
# only vaguely, so its TFLOP/s are the A10's and may not be the A10G's (Baseten's comparison reports the A10G lower
# in tensor throughput, higher in FP32).
_A10G_CAVEAT = f"the A10's figure: the A10G, AWS's variant, has no NVIDIA data sheet; its clocks differ ({A10G_VS_A10})"
_A10G = Card(
    key="a10g", name="NVIDIA A10G (AWS's variant of the A10)",
    memory_text="24GB GDDR6", memory_bytes=24 * GB,
    bandwidth_text="600GB/s", memory_bandwidth=600 * GB,
    compute_capability=(8, 6),
    fp16_tflops=125.0, fp16_sparse_tflops=250.0,
    bf16_tflops=125.0, bf16_sparse_tflops=250.0,
    fp32_tflops=31.2,
    torch_total_memory=None,
    sources={
        "memory_bytes": f"{A10_SHEET} (NVIDIA A10 Tensor Core GPU data sheet: GPU memory '24GB GDDR6'; "
                        f"{_A10G_CAVEAT})",
        "memory_bandwidth": f"{A10_SHEET} (A10 data sheet: GPU memory bandwidth '600GB/s'; {_A10G_CAVEAT})",
        "compute_capability": f"{CUDA_GPUS} (CUDA GPUs list: A10, 8.6; the A10G is the same Ampere GA102 chip)",
        "fp16_tflops": f"{A10_SHEET} (A10 data sheet: FP16 Tensor Core '125 | 250 teraFLOPS*', the first dense; "
                       f"{_A10G_CAVEAT})",
        "fp16_sparse_tflops": f"{A10_SHEET} (A10 data sheet: FP16 Tensor Core '250 teraFLOPS*', * with sparsity; "
                              f"{_A10G_CAVEAT})",
        "bf16_tflops": f"{A10_SHEET} (A10 data sheet: BF16 Tensor Core '125 | 250 teraFLOPS*', the first dense; "
                       f"{_A10G_CAVEAT})",
        "bf16_sparse_tflops": f"{A10_SHEET} (A10 data sheet: BF16 Tensor Core '250 teraFLOPS*', * with sparsity; "
                              f"{_A10G_CAVEAT})",
        "fp32_tflops": f"{A10_SHEET} (A10 data sheet: FP32 '31.2 teraFLOPS'; {_A10G_CAVEAT})",
    },
)


def _a100(key: str, gigabytes: int, memory: str, bandwidth: str, bytes_per_s: float) -> Card:
    column = f"A100 {gigabytes}GB SXM"
    return Card(
        key=key, name=f"NVIDIA A100 {gigabytes} GB (SXM)",
        memory_text=memory, memory_bytes=gigabytes * GB,
        bandwidth_text=bandwidth, memory_bandwidth=bytes_per_s,
        compute_capability=(8, 0),
        fp16_tflops=312.0, fp16_sparse_tflops=624.0,
        bf16_tflops=312.0, bf16_sparse_tflops=624.0,
        fp32_tflops=19.5,
        torch_total_memory=None,
        sources={
            "memory_bytes": f"{A100_SHEET} (NVIDIA A100 Tensor Core GPU data sheet, {column}: GPU Memory '{memory}')",
            "memory_bandwidth": f"{A100_SHEET} (data sheet, {column}: GPU Memory Bandwidth '{bandwidth}')",
            "compute_capability": f"{CUDA_GPUS} (CUDA GPUs list: A100, 8.0)",
            "fp16_tflops": f"{A100_SHEET} (data sheet: FP16 Tensor Core '312TF | 624TF*', the first dense)",
            "fp16_sparse_tflops": f"{A100_SHEET} (data sheet: FP16 Tensor Core '624TF*', * with sparsity)",
            "bf16_tflops": f"{A100_SHEET} (data sheet: BFLOAT16 Tensor Core '312TF | 624TF*', the first dense)",
            "bf16_sparse_tflops": f"{A100_SHEET} (data sheet: BFLOAT16 Tensor Core '624TF*', * with sparsity)",
            "fp32_tflops": f"{A100_SHEET} (data sheet: FP32 '19.5 TFLOPS')",
        },
    )


_A100_40GB = _a100("a100-40gb", 40, "40GB HBM2", "1,555GB/s", 1_555 * GB)
_A100_80GB = _a100("a100-80gb", 80, "80GB HBM2e", "2,039GB/s", 2_039 * GB)


def _hopper(key: str, name: str, sheet: str, document: str, memory: str, gigabytes: int, bandwidth: str,
            bytes_per_s: float) -> Card:
    # Both Hopper sheets print the tensor-core figures only with sparsity ('1,979 teraFLOPS*'): the dense figures
    # here are their halves, 989.5 (NVIDIA's Hopper architecture whitepaper gives the dense one as 989.4).
    column = f"{name.split()[1]} SXM"
    return Card(
        key=key, name=name,
        memory_text=memory, memory_bytes=gigabytes * GB,
        bandwidth_text=bandwidth, memory_bandwidth=bytes_per_s,
        compute_capability=(9, 0),
        fp16_tflops=_dense_of_sparse(1_979), fp16_sparse_tflops=1_979.0,
        bf16_tflops=_dense_of_sparse(1_979), bf16_sparse_tflops=1_979.0,
        fp32_tflops=67.0,
        torch_total_memory=None,
        sources={
            "memory_bytes": f"{sheet} ({document} data sheet, {column}: GPU memory '{memory}')",
            "memory_bandwidth": f"{sheet} ({document} data sheet, {column}: GPU memory bandwidth '{bandwidth}')",
            "compute_capability": f"{CUDA_GPUS} (CUDA GPUs list: {name.split()[1]}, 9.0)",
            "fp16_tflops": f"{sheet} (data sheet, {column}: FP16 Tensor Core '1,979 teraFLOPS*', * with sparsity; "
                           f"halved here)",
            "fp16_sparse_tflops": f"{sheet} (data sheet, {column}: FP16 Tensor Core '1,979 teraFLOPS*', * with "
                                  f"sparsity)",
            "bf16_tflops": f"{sheet} (data sheet, {column}: BFLOAT16 Tensor Core '1,979 teraFLOPS*', * with "
                           f"sparsity; halved here)",
            "bf16_sparse_tflops": f"{sheet} (data sheet, {column}: BFLOAT16 Tensor Core '1,979 teraFLOPS*', * with "
                                  f"sparsity)",
            "fp32_tflops": f"{sheet} (data sheet, {column}: FP32 '67 teraFLOPS')",
        },
    )


_H100 = _hopper("h100", "NVIDIA H100 SXM (80 GB)", H100_SHEET, "NVIDIA H100 Tensor Core GPU", "80GB", 80,
                "3.35TB/s", 3.35 * TB)
_H200 = _hopper("h200", "NVIDIA H200 SXM (141 GB)", H200_SHEET, "NVIDIA H200 Tensor Core GPU", "141GB", 141,
                "4.8TB/s", 4.8 * TB)

CARDS: dict[str, Card] = {c.key: c for c in (_T4, _L4, _A10G, _A100_40GB, _A100_80GB, _H100, _H200)}

# -- looking a card up by name ----------------------------------------------------------------------------------

# Words a name may carry that do not change which card it is: the vendor, the old "Tesla" brand, the SXM form
# factor (these cards are the SXM ones) and the memory's type. "PCIe" and "NVL" are not dropped: those are other
# cards, with other figures (the A100 80GB PCIe has 1,935GB/s, the H100 PCIe and NVL other clocks).
_IGNORED = {"nvidia", "tesla", "gpu", "sxm", "sxm4", "sxm5", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6"}
_ALIASES = {
    "t4": "t4", "l4": "l4", "a10g": "a10g",
    "a100-40gb": "a100-40gb", "a100-40g": "a100-40gb",
    "a100-80gb": "a100-80gb", "a100-80g": "a100-80gb",
    "h100": "h100", "h100-80gb": "h100",       # torch names it "NVIDIA H100 80GB HBM3"
    "h200": "h200", "h200-141gb": "h200",
}


def _normalized(name: str) -> str:
    words = re.findall(r"[a-z0-9]+", re.sub(r"(\d)\s+(gb?)\b", r"\1\2", name.lower()))
    return "-".join(w for w in words if w not in _IGNORED)


def card(name: str) -> Card:
    """The card ``name`` names: its key in any case ("t4", "A100-80GB"), a common spelling ("H100", "a100 80gb",
    "A100 80 GB", "h100 sxm") or the name ``torch.cuda.get_device_name()`` gives ("Tesla T4", "NVIDIA A10G",
    "NVIDIA A100-SXM4-80GB", "NVIDIA H100 80GB HBM3"). Anything else, an A100 without its memory size, a PCIe or
    NVL card, or something not a string, raises ValueError listing the keys."""
    key = _ALIASES.get(_normalized(name)) if isinstance(name, str) else None
    if key is None:
        raise ValueError(f"no GPU card {name!r} in gpukit.cards: the cards are {', '.join(CARDS)} (any case; "
                         f"'H100', 'a100 80gb' and torch's device names work too; PCIe and NVL variants are other "
                         f"cards, not listed)")
    return CARDS[key]


# A rehearsal (``python3 kit.py rehearse --card t4``) runs on the CPU as if on a card: this variable names it.
REHEARSE_VAR = "GPUKIT_REHEARSE"


def rehearsed_card() -> Card | None:
    """The card a rehearsal runs for (``GPUKIT_REHEARSE``, a card's name as ``card`` reads it), or None."""
    name = os.environ.get(REHEARSE_VAR, "").strip()
    return card(name) if name else None
