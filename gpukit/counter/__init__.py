"""The exact live-tensor counter that stands in for the CUDA allocator on CPU.

PyTorch keeps no statistics for CPU memory, so gpukit counts it itself: every
tensor's memory lives in an *untyped storage*; views share their base's storage
and add nothing, and the memory is freed when the storage's last user dies.

* Allocations: a ``TorchDispatchMode`` sees every ATen op run inside a measured
  block and records each output storage it has not seen before (factory ops,
  results, gradients, optimizer state...). ``Tensor.resize_`` and
  ``UntypedStorage.resize_`` that change a storage's size are seen too.
* Frees: each known storage carries a ``weakref`` whose callback fires when the
  storage dies (PyTorch keeps one Python object per live storage), wherever that
  happens: ``del x``, ``optimizer.zero_grad()``, the end of ``backward()``.
* Storages that existed before the block are found when it starts, by a scan of
  every tensor Python can reach (``gc``), their ``.grad``, and the tensors saved
  by autograd graphs hanging off them, so that freeing them counts.

Threads: PyTorch keeps its dispatch modes on a stack per thread
(``torch.utils._python_dispatch``, ``TorchDispatchModeTLS`` in c10), so each
thread that opens a block pushes a counting mode of its own and pops it from its
own stack. Every open block counts the process, as the CUDA allocator does:
allocations made on any thread that is inside a block, and every free.

Ctrl-C: a SIGINT that arrives while gpukit updates its own state waits until the
update is done (``INTERRUPTS``), so an interrupt never leaves a block half open.

Every size is kept as requested (the CUDA allocator's ``requested_bytes``) and also
rounded up to a multiple of 512 bytes (its ``allocated_bytes``). What that reproduces of
the CUDA caching allocator (c10/cuda/CUDACachingAllocator.cpp, default configuration):

* requested bytes: exactly, whatever the allocator's cache holds;
* allocated bytes of requests up to 1 MiB (``kSmallSize``): exactly. They come from the
  small pool, whose blocks are always split to the 512-byte-rounded size (``round_size``,
  ``should_split``: ``remaining >= kMinBlockSize``);
* allocated bytes of larger requests: a lower bound. A large block is split only when more
  than 1 MiB would remain (``should_split``: ``remaining > kSmallSize``), so a request can
  be counted with up to 1 MiB more, the whole block it got; which block depends on what the
  cache holds (new segments are 20 MiB, ``kLargeBuffer``, for requests under 10 MiB,
  ``kMinLargeAlloc``, else the request rounded up to 2 MiB, ``kRoundLarge``).
  ``cuda_allocated_range`` gives the bounds. ``expandable_segments`` splits every block,
  and ``roundup_power2_divisions`` rounds differently; the counter follows neither.
* not at all: reserved memory (segments, the cache, fragmentation), scratch memory inside
  ops, and cuBLAS's workspaces (``gpukit.warm_up``).

What it cannot see: scratch memory a C++ kernel allocates and frees inside one
op, memory of non-strided (sparse) tensors, and storages reachable only from C++
(other than autograd's saved tensors) that exist before a block and die in it.

The package, one job a module:

* ``sizes``: the bytes the CUDA allocator counts for a request (``allocated_size``, ``round_up``).
* ``interrupts``: Ctrl-C held back while gpukit changes its own state (``INTERRUPTS``).
* ``records``: what the ledger keeps of a block (``Tally``) and of a storage (its weak reference and state).
* ``mode``: the dispatch mode that sees every op a thread runs inside a block, and hands its outputs on (and warns
  when ``torch.compile`` ran eagerly under it: ``CompileRanEagerWarning``).
* ``limits``: refusing an op that would pass a budget: its request, known before it runs, and the error.
* ``scan``: finding the storages that existed before a block (``gc``, gradients, autograd's saved tensors).
* ``ledger``: the books themselves: every live storage, settled in order, each block's level and peak,
  the counter switched on and off (``Ledger``, ``LEDGER``, ``FAKE_LEDGER``).
"""

from .interrupts import INTERRUPTS
from .ledger import FAKE_LEDGER, LEDGER, ONE_PREDICTION, Ledger, refuse_inside_a_fake_run
from .mode import CompileRanEagerWarning, user_stacklevel, warn_compile_ran_eagerly
from .records import Tally
from .scan import gc_paused, saved_tensors
from .sizes import ALIGNMENT, SMALL_REQUEST, allocated_size, allocated_size_range, cuda_allocated_range, round_up

__all__ = ["ALIGNMENT", "CompileRanEagerWarning", "FAKE_LEDGER", "INTERRUPTS", "LEDGER", "Ledger", "ONE_PREDICTION",
           "SMALL_REQUEST", "Tally", "allocated_size", "allocated_size_range", "cuda_allocated_range", "gc_paused",
           "refuse_inside_a_fake_run", "round_up", "saved_tensors", "user_stacklevel", "warn_compile_ran_eagerly"]
