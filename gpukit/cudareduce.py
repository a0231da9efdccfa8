"""The staging buffer of a CUDA reduction split across thread blocks, in bytes, as PyTorch's kernel sizes it.

From aten/src/ATen/native/cuda/Reduce.cuh (``setReduceConfig``, ``gpu_reduce_kernel``):
``sum`` and ``mean`` over some dimensions run ``gpu_reduce_kernel`` (ReduceSumProdKernel.cu, ReduceMomentKernel.cu;
``mean_out`` in ReduceOps.cpp takes it for non-CPU tensors), which splits a long reduction across thread blocks
where the outputs are few (``should_global_reduce``) and then allocates, for the kernel's duration, a buffer of
``global_memory_size()`` bytes and ``semaphore_size()`` bytes of semaphores from the caching allocator. Where the
reduced dimensions are not the fastest-moving ones (a bias's gradient: ``sum`` over the batch of a row-major
gradient, from autograd's ``sum_to``) the buffer is ``sizeof(acc) x outputs x ctas_per_output x block.x x
output_vec_size``: 132 MiB for the (8192, 4096) gradient of a 4096-wide Linear on 132 SMs, in float32 and in
float16 alike (the accumulator is float32). ``ctas_per_output`` depends on the card's multiprocessor count and
resident threads per multiprocessor (``target_grid_size``), taken here for the cards gpukit knows, one per
compute capability (``REDUCTION_MULTIPROCESSORS``); for another capability such a reduction is named in
``unmodelled``. The rule follows TensorIterator's ordering and coalescing of dimensions
(aten/src/ATen/TensorIterator.cpp, ``reorder_dimensions``, ``coalesce_dimensions``). Not modelled: the buffer of a
reduction along the fastest-moving dimension (``sizeof(acc) x outputs x ctas_per_output``, a few KiB at most:
there a block serves one output and the grid is at most the target), and a reduction too large for 32-bit
indexing (split into several kernels, ``with_32bit_indexing``). ``gpukit.cudarules`` adds the blocks to a CUDA
prediction.
"""

from __future__ import annotations

import torch

SM90 = (9, 0)  # Hopper: the card a CUDA prediction is for unless one is named

# Multiprocessors and resident threads per multiprocessor (``multiProcessorCount``, ``maxThreadsPerMultiProcessor``)
# of the card gpukit knows at each compute capability (gpukit.cards), for Reduce.cuh's ``target_grid_size``. The
# threads are the CUDA C++ Programming Guide's "Maximum number of resident threads per SM" per compute capability;
# the multiprocessors each card's architecture whitepaper gives: T4 40 (Turing), A100 108 (Ampere GA100), L4 58
# (Ada), H100 SXM5 and H200 132 (Hopper GH100). 8.6 (the A10G) is left out: AWS's variant has no figure of its own.
REDUCTION_MULTIPROCESSORS = {(7, 5): (40, 1024), (8, 0): (108, 2048), (8, 9): (58, 1536), (9, 0): (132, 2048)}
REDUCTION_OPS = {"aten.sum.dim_IntList", "aten.mean.dim"}  # gpu_reduce_kernel, a float (double) accumulator
_INT32_MAX = 2**31 - 1


def _reduction_dimensions(sizes, in_strides, reduced, out_element):
    """TensorIterator's (shape, output strides, input strides) in bytes for a reduction of a tensor of ``sizes`` and
    byte ``in_strides`` over the dimensions ``reduced``: the output is contiguous over the kept dimensions and 0
    along the reduced ones (``review_reduce_result``), dimensions are ordered as ``reorder_dimensions`` orders them
    (the reduced ones first, then by increasing stride, the output's first) and adjacent ones coalesced as
    ``coalesce_dimensions`` coalesces them."""
    n = len(sizes)
    out_strides, step = [0] * n, out_element
    for d in reversed(range(n)):
        if d not in reduced:
            out_strides[d] = step
            step *= sizes[d]

    def should_swap(d0, d1):
        for strides, is_output in ((out_strides, True), (in_strides, False)):
            s0, s1 = strides[d0], strides[d1]
            if is_output and (s0 == 0) != (s1 == 0):
                return 1 if s1 == 0 else -1  # reduced dimensions to the front
            if s0 == 0 or s1 == 0:
                continue
            if s0 != s1:
                return -1 if s0 < s1 else 1
            if sizes[d0] > sizes[d1]:
                return 1
        return 0

    perm = list(reversed(range(n)))
    for i in range(1, n):
        dim1 = i
        for dim0 in range(i - 1, -1, -1):
            comparison = should_swap(perm[dim0], perm[dim1])
            if comparison > 0:
                perm[dim0], perm[dim1] = perm[dim1], perm[dim0]
                dim1 = dim0
            elif comparison < 0:
                break
    shape = [sizes[p] for p in perm]
    strides = [[out_strides[p] for p in perm], [in_strides[p] for p in perm]]
    prev = 0
    for d in range(1, n):
        if shape[prev] == 1 or shape[d] == 1 or all(shape[prev] * s[prev] == s[d] for s in strides):
            if shape[prev] == 1:
                for s in strides:
                    s[prev] = s[d]
            shape[prev] *= shape[d]
        else:
            prev += 1
            if prev != d:
                for s in strides:
                    s[prev] = s[d]
                shape[prev] = shape[d]
    if n:
        del shape[prev + 1:]
        for s in strides:
            del s[prev + 1:]
    return shape, strides[0], strides[1]


def reduction_staging_blocks(input: torch.Tensor, dims, capability: tuple[int, int] = SM90) -> list[int] | None:
    """The blocks (bytes: the buffer, the semaphores) that ``gpu_reduce_kernel`` (Reduce.cuh) allocates for the
    kernel's duration when it reduces ``input`` over ``dims`` (``sum``/``mean``) on a card of this compute capability
    with the reduced dimensions not the fastest-moving ones; ``[]`` where it allocates none (or none this rule
    models: see the module's notes); ``None`` where it may and the card's multiprocessors are not known here."""
    if not input.dtype.is_floating_point or input.numel() == 0 or input.dim() == 0:
        return []
    element = input.element_size()
    acc = 8 if input.dtype == torch.float64 else 4  # at::opmath_type: float for float, half and bfloat16
    sizes = list(input.shape)
    n = len(sizes)
    reduced = set(range(n)) if dims is None or len(dims) == 0 else {d % n for d in dims}
    in_strides = [s * element for s in input.stride()]
    if sum((size - 1) * abs(s) for size, s in zip(sizes, in_strides)) > _INT32_MAX or input.numel() > _INT32_MAX:
        return []  # split into 32-bit-indexable kernels (with_32bit_indexing): not modelled
    shape, out_strides, strides = _reduction_dimensions(sizes, in_strides, reduced, element)
    nr = sum(1 for s in out_strides if s == 0)
    if nr == len(shape) or strides[0] < strides[nr]:
        return []  # a reduction along the fastest-moving dimension: its buffer, a few KiB at most, is not modelled
    outputs = 1
    for size, s in zip(shape, out_strides):
        if s != 0:
            outputs *= size
    inputs = input.numel() // outputs
    vec = 1
    if strides[nr] == element:  # "vectorize along output" (get_output_vec_size), from a block's aligned start
        vec = 4
        for value in [input.storage_offset(), shape[nr]] + [s // element for j, s in enumerate(strides) if j != nr]:
            while value % vec:
                vec //= 2
    max_threads = 512 // vec  # mnt_wrapper: 512 threads (256 for complex double, not a float type here)

    def pow2(x):
        return max_threads if x >= max_threads else 1 << (max(int(x), 1).bit_length() - 1)

    dim0, dim1 = outputs // vec, inputs
    width = min(pow2(dim0), 32)
    height = min(pow2(dim1), max_threads // width)
    width = min(pow2(dim0), max_threads // height)
    step_output, step_input = width, 1  # output_mult[0]: outputs across a warp's lanes
    if -(-inputs // step_input) < min(height * 16, 256):
        return []  # each warp its own output: no split of the input across warps, nor across blocks
    step_input *= height
    per_thread = -(-inputs // step_input)
    grid = -(-(outputs // vec) // step_output)
    if capability not in REDUCTION_MULTIPROCESSORS:
        return None if per_thread >= 256 else []
    multiprocessors, threads = REDUCTION_MULTIPROCESSORS[capability]
    target = multiprocessors * (threads // (width * height))
    if per_thread < 256 or grid > target:
        return []
    ctas = max(min(-(-target // grid), -(-per_thread // 16)), -(-per_thread // 256))
    if ctas <= 1:
        return []
    return [acc * outputs * ctas * width * vec, 4 * grid]  # global_memory_size(), semaphore_size()


__all__ = ["REDUCTION_MULTIPROCESSORS", "REDUCTION_OPS", "SM90", "reduction_staging_blocks"]
