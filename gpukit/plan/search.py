"""The search: which candidates to predict, in which order, which are dominated or pruned (their bounds:
gpukit.plan.bounds; how they are ranked and costed: gpukit.plan.ranking)."""

from __future__ import annotations

import copy
import heapq
from dataclasses import replace
from typing import Callable

from .._torch import FakeTensorMode
from ..cudadevice import CudaDevices
from ..estimate import CONTEXT_ALLOWANCE, predict
from ..factories import TensorsFromFakeLists, this_threads_warnings
from ..report import format_bytes
from ..step import micro_loss
from .candidates import (
    ROUNDING,
    SAME,
    STRATEGIES,
    TRAINING,
    WEIGHTS,
    Candidate,
    Row,
)
from . import host as host_steps  # not `host`: plan's host=, a Host, shares that name
from . import ranking
from .bounds import Bounds
from .host import host_variants
from .params import DEFAULT_CARD, Host, Techniques, named, resolve_card
from .facts import (QLORA_PRECISIONS, eight_bit_optimizer, is_adam_like, model_facts, optimizer_name,
                    other_implementations, quantization_state_bytes, stepped_in_backward)
from .steps import (
    CHECKED_BY_SOURCE,
    CHUNK_TOKENS,
    candidate_loss,
    fake_save_on_cpu,
    model_maker,
    slice_batch,
    step_for,
)
from .ranking import Ranking

# -- the plan ----------------------------------------------------------------------------------------------------


class PlanSearch(Bounds, Ranking):
    """One search of ``plan()``: the candidates, their predictions and bounds, and the fitting ones ranked."""

    def __init__(self, make_model, make_optimizer, make_batch, limit, *, device, gpus=1, card=None, host=None,
                 techniques=None, alternatives=0, loss=None):
        """As ``plan()`` takes them: ``card`` a ``gpukit.cards.Card``, its name or None (``DEFAULT_CARD``),
        ``host`` a ``Host`` and ``techniques`` a ``Techniques`` (None: their defaults); ``limit`` in bytes and
        ``loss`` resolved (``gpukit.step.resolve_loss``)."""
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device={device!r}: plan for 'cuda' (a GPU's code paths and reserved memory) or 'cpu'")
        if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
            raise ValueError(f"gpus={gpus!r}: a whole number of GPUs, 1 or more")
        card = resolve_card(card, device)
        host = host if host is not None else Host()
        techniques = techniques if techniques is not None else Techniques()
        if not isinstance(host, Host):
            raise TypeError(f"host={host!r}: a gpukit.plan.Host(memory=..., memory_bandwidth=..., link=...), or None")
        if not isinstance(techniques, Techniques):
            raise TypeError(f"techniques={techniques!r}: a gpukit.plan.Techniques(precisions=..., ...), or None")
        strategies = techniques.strategies
        if gpus == 1:
            if strategies not in (None, ("single GPU",)):
                raise ValueError("strategies apply to several GPUs: pass gpus=2 or more")
            strategies = ("single GPU",)
        else:
            strategies = strategies or STRATEGIES[1:]
            if any(s not in STRATEGIES[1:] for s in strategies):
                raise ValueError(f"strategies={strategies!r}: choose from {', '.join(STRATEGIES[1:])}")
        self.make_model, self.make_batch, self.loss = make_model, make_batch, loss
        self.gpu, self.host_machine, self.techniques = card, host, techniques
        self.limit, self.device, self.gpus = limit, device, gpus
        # memory beyond PyTorch's on the card (CUDA context, libraries), added to every need
        self.allowance = card.context_allowance if card.context_allowance is not None else \
            CONTEXT_ALLOWANCE if device == "cuda" else 0
        # the figures the time cost is estimated with, per second
        self.tflops, self.memory_bw, self.host_bw = card.fp32_tflops * 1e12, int(card.memory_bandwidth), host.link
        self.alternatives = alternatives
        self.host_memory, self.host_memory_bw = host.memory, host.memory_bandwidth
        self.host: dict[str, bool] = {}  # host-offload optimizers (gpukit.plan.host) -> offload_gradients
        # a card without bfloat16 tensor cores: bfloat16 after float16, cost for cost
        self.slow_bf16 = not card.bf16_tensor_cores
        # its attention kernels in every prediction (a T4's math one); None: Hopper's, DEFAULT_CARD's
        self.card = card if device == "cuda" and (named(card) or card.compute_capability !=
                                                   DEFAULT_CARD.compute_capability) else None
        optimizers, implementations = techniques.optimizers, techniques.implementations
        precisions, accumulate, lora = techniques.precisions, techniques.accumulate, techniques.lora
        checkpointing, offload = techniques.checkpointing, techniques.offload
        self.facts = model_facts(make_model, make_batch, loss)
        # Real steps (the verification, Plan.run) train what they build: a model that already exists is copied.
        self.make_real_model = (lambda: copy.deepcopy(make_model())) if self.facts.existing_model else make_model
        b = self.facts.batch_size
        if b % gpus:
            raise ValueError(f"the batch of {b} does not divide among {gpus} GPUs; make it a multiple of {gpus}")
        self.rank_batch = b // gpus
        user = optimizer_name(make_optimizer)
        self.optimizers: dict[str, tuple[Callable, str, int]] = {f"yours: {user}": (make_optimizer, "", SAME)}
        self.optimizer_libraries: dict[str, tuple[str, ...]] = {}  # an optimizer plan() adds -> its library
        self.same_state: dict[str, str] = {}  # an optimizer -> the one whose state_info is its own (for-loop step)
        self.state_above: dict[str, str] = {}  # an optimizer -> one whose state it holds at least (fused step)
        for name, make in (optimizers or {}).items():  # (each a function: Techniques checks)
            self.optimizers[name] = (make, f"{optimizer_name(make)} instead of {user}", TRAINING)
        if implementations:
            for name, (make, note, rank) in list(self.optimizers.items()):
                for vname, vmake, vnote, state in other_implementations(name, make, device):
                    self.optimizers[vname] = (vmake, "; ".join(filter(None, [note, vnote])),
                                              max(rank, ROUNDING if "fused" in vname else SAME))
                    (self.same_state if state == "same" else self.state_above)[vname] = name
            # Yours with 8-bit moments (bitsandbytes), and yours and that one stepped in backward.
            stepped = [f"yours: {user}"]
            eight = eight_bit_optimizer(make_optimizer)
            if eight is not None:
                self.optimizers[eight[0]] = (eight[1], eight[2], ROUNDING)
                self.optimizer_libraries[eight[0]] = ("bitsandbytes",)
                stepped.append(eight[0])
            for name in stepped:
                make, note, rank = self.optimizers[name]
                self.optimizers[f"{name}, in backward"] = (
                    stepped_in_backward(make), "; ".join(filter(None, [note, "stepped in backward: no clipping"])),
                    rank)
                if name in self.optimizer_libraries:  # (the hooks are PyTorch's: the recipe registers them)
                    self.optimizer_libraries[f"{name}, in backward"] = self.optimizer_libraries[name]
            # Yours with its state and step on the host (torchao), as fused as a fused=True step: rounding-level.
            for name, make, note, gradients in host_variants(make_optimizer, device, gpus):
                self.optimizers[name] = (make, note, ROUNDING)
                self.optimizer_libraries[name] = ("torchao",)
                self.host[name] = gradients
        # (a host-offload optimizer is not built to ask: torchao asks for CUDA; it is an Adam or AdamW)
        self.adam_like = {name: name in self.host or is_adam_like(make)
                          for name, (make, _, _) in self.optimizers.items()}
        ks = accumulate if accumulate is not None else [k for k in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                                                        if self.rank_batch % k == 0]
        bad = [k for k in ks if not isinstance(k, int) or k < 1 or self.rank_batch % k]
        if bad or not ks:
            raise ValueError(f"accumulate={accumulate!r}: each k must divide the batch per GPU "
                             f"({self.rank_batch}) into equal micro-batches")
        self.ks = sorted(set(ks) | {1})
        self.ckpt = [False, True] if checkpointing else [False]
        self.offl = [False, True] if offload and device == "cuda" else [False]
        self.precisions = precisions
        self.strategies = strategies
        # (LoRA, QLoRA) pairs: QLoRA where LoRA is tried and the model has layers bitsandbytes quantizes
        # (facts.qlora_shapes: a transformers model, bitsandbytes and peft installed)
        self.loras = [(False, False)]
        if lora and self.facts.lora_targets and gpus == 1:
            self.loras += [(True, False)] + ([(True, True)] if self.facts.qlora_shapes else [])
        self.host_limit = self.host_memory if self.host_memory is not None else ranking.TYPICAL_HOST_MEMORY
        self.chunks = [False, True] if self.facts.head_flops else [False]
        self.predictions = 0
        self.floors: dict[tuple[str, str], dict] = {}
        self.states: dict[tuple[str, str], dict] = {}  # the floors' figures but for its peak (``state_info``)
        # Per configuration (precision, micro-batches, checkpointing, offload, LoRA, chunked loss): the most allocated
        # by the end of the forward, and by the optimizer step, less the optimizer's state (``_Phases``, and a
        # prefix of its step: ``prefix``); and those where every trained parameter gets a gradient.
        self.phases: dict[tuple, dict[str, int]] = {}
        self.every_grad: set[tuple] = set()
        self.prefixed: set[tuple] = set()
        self.hopeless = 0.5  # a prefix whose forward needs less than this share of the budget ends there
        self.rows: dict[Candidate, Row] = {}
        self.copies: dict[tuple, int] = {}
        self.saved: dict[tuple, int] = {}  # a configuration -> its prefix's saved_bytes (a micro-batch's forward)
        self.found: list[Candidate] = []
        self.progress = None  # a gpukit.progress.Progress told of each candidate as it is decided (plan() sets it)

    def candidates(self) -> list[Candidate]:
        found = []
        for opt in self.optimizers:
            in_backward = self.one_micro_batch(opt)  # (or frees each gradient in backward: no accumulation either)
            for precision in self.precisions:
                if precision == "half" and self.adam_like[opt]:
                    continue  # eps (1e-8) is 0 in float16 and the second moment underflows: not safe
                if opt in self.host and precision not in host_steps.HOST_PRECISIONS:
                    continue  # no autocast on the simulated GPU; fp16's GradScaler and half() not with torchao
                if in_backward and precision == "fp16":
                    continue  # a GradScaler unscales and checks every gradient before any step
                for strategy in self.strategies:
                    if in_backward and strategy != "single GPU":
                        continue
                    for k in self.ks:
                        if in_backward and k > 1:
                            continue  # each micro-batch's gradient would step the parameter
                        for ck in self.ckpt:
                            for off in self.offl:
                                for lora, qlora in self.loras:
                                    if lora and opt in self.host:
                                        continue  # the adapters' state is small: nothing to send to the host
                                    if qlora and precision not in QLORA_PRECISIONS:
                                        continue  # peft's prepare_model_for_kbit_training makes the rest float32
                                    for chunked in self.chunks:
                                        if chunked and not self.chunkable(k):
                                            continue
                                        found.append(Candidate(opt, precision, k, ck, off, strategy, lora, chunked,
                                                               qlora))
        return found

    def one_micro_batch(self, optimizer: str) -> bool:
        """An optimizer that steps or frees each gradient in backward: no accumulation (and, for its bounds, the
        step before its first backward allocates as another optimizer's does, not up to its optimizer step)."""
        return optimizer.endswith(", in backward") or self.host.get(optimizer, False)

    def host_copies(self, c: Candidate) -> int:
        """Bytes a host-offload optimizer copies in one step (gradients to the host, weights back); 0 for others."""
        return host_steps.copy_bytes(self, c) if c.optimizer in self.host else 0

    # predictions (their bounds: Bounds) ----------------------------------------------------------------------

    def evaluate(self, c: Candidate) -> Row:
        """The candidate predicted: its row. What torch, a library or the model warned while its step was predicted
        goes into the row's ``how`` (each message once), not to the user's output: a recipe the user did not write,
        and may never run, warned (torchtune's RMSNorm in bfloat16 weights: torch's "Mismatch dtype between input
        and weight")."""
        if c in self.rows and self.rows[c].need is not None:
            return self.rows[c]
        with this_threads_warnings() as warned:
            row = host_steps.evaluate(self, c) if c.optimizer in self.host else self.predicted(c)
        said = list(dict.fromkeys(f"{w.category.__name__}: {w.message}" for w in warned))
        if said:
            row.how = "; ".join(filter(None, [row.how, "warned while predicted: " + " | ".join(said)]))
        return row

    def predicted(self, c: Candidate) -> Row:
        """``evaluate``'s prediction of a candidate whose optimizer runs on the GPU."""
        rank, note, tol = self.numerics(c)
        micro = self.rank_batch // c.accumulate
        proxy_k = 1 if c.accumulate == 1 else 2
        n = micro * proxy_k
        copies = [0]
        phases: dict = {}
        p = predict(model_maker(self.make_model, c.precision, lora=c.lora, qlora=c.qlora),
                    self.optimizers[c.optimizer][0], slice_batch(self.make_batch, n, self.facts.batch_size),
                    step=step_for(c, proxy_k, copies, self.loss, phases),
                    device=self.device, card=self.card, breakdown=False)  # (a row is bytes: no roles read)
        self.predictions += 1
        self.learn_phases(c, p, phases)
        held = self.held(c)  # the full batch held
        how = ["predicted"]
        if proxy_k != c.accumulate:
            how.append(f"as 2 micro-batches of {micro} with the batch of {self.facts.batch_size} held")
        peak = p.peak + held
        reserved = None if p.reserved_peak is None else p.reserved_peak + held
        lower = p.lower_bound
        if c.qlora:
            # The quantization state (absmax, code) is held by bitsandbytes' QuantState, no parameter or buffer:
            # counted apart, from the layers' shapes (the simulated allocator placed it: reserved holds it).
            state = quantization_state_bytes(self.facts.qlora_shapes)
            peak += state
            how.append(f"the base's Linear weights quantized by bitsandbytes' own quantize_4bit under fake tensors, "
                       f"each quantized layer's forward as bitsandbytes' dequantize-then-matmul kernel runs it; "
                       f"+ {format_bytes(state)} of their quantization state (absmax, code: not parameters, counted "
                       "from the layers' shapes)")
            if self.device == "cuda":
                how.append("reserved after the cache is emptied as peft's prepare_model_for_kbit_training does, the "
                           "weights built in float32 and quantized one by one on the simulated GPU (from_pretrained "
                           "loads each before quantizing it: the blocks it leaves split may differ); at 1,536 tokens "
                           "a micro-batch or fewer, CUDA may run bitsandbytes' own kernel, which makes no "
                           "dequantized copy (then up to one layer's bfloat16 weight less)")
            lower = any(op not in CHECKED_BY_SOURCE for op in p.unverified_ops) or (
                self.device == "cpu" and self.facts.qlora_odd_inputs)  # (CHECKED_BY_SOURCE: even inputs only)
        base = reserved if self.device == "cuda" and reserved is not None else peak
        change = self.state_change(c)
        if change:
            how.append(f"{c.strategy} per rank: {'+' if change > 0 else ''}{format_bytes(change)} by the sharding "
                       "formula, not predicted")
        need = base + change + self.allowance
        copy_bytes = copies[0] * (c.accumulate // proxy_k)
        row = Row(c, "fits" if need <= self.limit else "does not fit", need <= self.limit, peak=peak,
                  reserved=reserved, need=need, how="; ".join(how), slowdown=self.slowdown(c, copy_bytes),
                  numerics=rank, numerics_note=note, tolerance=tol, copy_bytes=copy_bytes,
                  lower_bound=lower, prediction=p, libraries=self.libraries(c))
        self.rows[c] = row
        return row

    def pruned(self, c: Candidate, why: str, fits: bool | None = False, bound: int | None = None) -> None:
        rank, note, tol = self.numerics(c)
        self.rows.setdefault(c, Row(c, f"pruned: {why}", fits, slowdown=self.slowdown(c, self.host_copies(c)),
                                    numerics=rank, numerics_note=note, tolerance=tol, bound=bound,
                                    libraries=self.libraries(c)))

    def need_at_least(self, c: Candidate) -> int:
        """The candidate's need, or a lower bound of it over the budget (then it is not predicted)."""
        bound = self.over(c)
        return bound if bound is not None else self.evaluate(c).need

    # the search ------------------------------------------------------------------------------------------------

    def run(self) -> list[Row]:
        """The search; what its bounds' predictions warned is dropped (a candidate predicted keeps its own in its
        row: ``evaluate``), what the user's other threads warn meanwhile is not."""
        with this_threads_warnings():
            return self.searched()

    def searched(self) -> list[Row]:
        todo = self.candidates()
        # Offload's copies: unknown (costed as none), at least a bound (copies_at_least), or exact (copy_bytes).
        heap = [(self.key(c, None if c.offload else 0), i, c, "unknown" if c.offload else "exact")
                for i, c in enumerate(todo)]
        heapq.heapify(heap)
        probed: dict[tuple, bool] = {}
        fitting: list[Candidate] = []
        while heap:
            key, i, c, copies = heapq.heappop(heap)
            if self.progress is not None:
                self.progress.update(min(len(self.rows), len(todo)),
                                     f"{self.predictions} predictions; {c.label} [{c.optimizer}]")
            if len(fitting) > self.alternatives and not self.could_rank_among(c, key[1], fitting):
                self.pruned(c, "ranks after the recipes found", None)
                continue
            dominated = next((f for f in fitting if c.saves_at_least(f)), None)
            if dominated is not None:
                self.pruned(c, f"adds techniques to {dominated.label}, which fits", True)
                continue
            bound = self.phase_bound(c, floor=False)
            if bound is not None and bound > self.limit:
                self.pruned(c, f"its forward and backward alone need {format_bytes(bound)}", bound=bound)
                continue
            state = self.state_bound(c, known=True)  # (where read already: before its copies are counted)
            if state is not None and state > self.limit:
                self.pruned(c, f"model state alone need {format_bytes(state)}", bound=state)
                continue
            if copies != "exact":  # offload: its copies counted (a forward under fake tensors), queued at its cost
                low = self.copies_at_least(c) if copies == "unknown" else None
                if low is not None:  # queued at a cost it has at least, counted if it comes back before a recipe
                    heapq.heappush(heap, (self.key(c, low), i, c, "bound"))
                else:
                    heapq.heappush(heap, (self.key(c, self.copy_bytes(c)), i, c, "exact"))
                continue
            on_host = host_steps.host_bound(self, c) if self.host_memory is not None else 0
            if self.host_memory is not None and on_host > self.host_memory:
                self.pruned(c, f"its copies on the host alone need {format_bytes(on_host)}, more "
                               f"than the host's memory {format_bytes(self.host_memory)}")
                continue
            state = self.state_bound(c)
            if state > self.limit:  # (before a prefix of its configuration is predicted: the state costs none)
                self.pruned(c, f"model state alone need {format_bytes(state)}", bound=state)
                continue
            if self.configuration(c) not in self.phases:
                self.prefix(c)
                bound = self.phase_bound(c, floor=False)
                if bound is not None and bound > self.limit:
                    self.pruned(c, f"its forward and backward alone need {format_bytes(bound)}", bound=bound)
                    continue
            below = self.state_above.get(c.optimizer)
            if below is not None and c.strategy in ("single GPU", "DDP"):
                # With the state of an optimizer whose state it holds at least, before its own is made (its floor's
                # peak is its own: a fused step's temporaries are not the foreach step's).
                bound = self.phase_bound(replace(c, optimizer=below))
                if bound is not None and bound > self.limit:
                    self.pruned(c, f"its forward and backward with its optimizer's state need at least "
                                   f"{format_bytes(bound)}", bound=bound)
                    continue
            lower = self.lower_bound(c)
            if lower > self.limit:
                alone = "model state and optimizer step" if (c.optimizer, WEIGHTS[c.precision], c.lora,
                                                             c.qlora) in self.floors \
                    else "model state"
                self.pruned(c, f"{alone} alone need {format_bytes(lower)}", bound=lower)
                continue
            bound = self.phase_bound(c)
            if bound is not None and bound > self.limit:
                self.pruned(c, f"its forward and backward with its optimizer's state need {format_bytes(bound)}",
                            bound=bound)
                continue
            amp = self.amp_bound(c)
            if amp > self.limit:
                self.pruned(c, f"autocast at best halves what float32 needs above the model state: at least "
                               f"{format_bytes(amp)} need")
                continue
            failed = next((r.candidate for r in self.rows.values() if r.fits is False
                           and (r.need is not None or r.bound is not None) and r.candidate.saves_at_least(c)), None)
            if failed is not None:
                if c not in self.rows:
                    self.pruned(c, f"saves no more than {failed.label}, which does not fit")
                continue
            # The group's most saving candidate is predicted once two of the group were predicted not to fit (the
            # phases of the first ones' configurations often bound the group's others without it).
            if c.group not in probed and sum(r.fits is False and r.need is not None and r.candidate.group == c.group
                                             for r in self.rows.values()) >= 2:
                probed[c.group] = self.need_at_least(self.most_saving(c)) <= self.limit
            if not probed.get(c.group, True):
                if c not in self.rows:
                    self.pruned(c, "does not fit even with the most micro-batches, checkpointing and offload")
                continue
            row = self.evaluate(c)
            if row.fits:
                fitting.append(c)
        self.found = fitting
        return self.ordered()

    def most_saving(self, c: Candidate) -> Candidate:
        ks = [k for k in self.ks if k == 1 or not self.one_micro_batch(c.optimizer)]
        k = max(ks)
        return Candidate(c.optimizer, c.precision, k, max(self.ckpt), max(self.offl), c.strategy, c.lora,
                         max(self.chunks) and self.chunkable(k), c.qlora)

    def chunkable(self, k: int) -> bool:
        """Whether a micro-batch of k has more tokens than one chunk of the chunked loss (else it saves nothing)."""
        return self.facts.tokens // self.gpus // k > CHUNK_TOKENS

    def copy_bytes(self, c: Candidate) -> int:
        """Bytes ``save_on_cpu`` sends to the host and back in one step of this candidate (fake forwards)."""
        key = (c.precision, c.accumulate, c.checkpointed, c.lora, c.chunked_loss, c.qlora)  # (not the optimizer)
        if key not in self.copies:
            micro = self.rank_batch // c.accumulate
            copies = [0]
            with FakeTensorMode(allow_non_fake_inputs=True), CudaDevices("cpu"), TensorsFromFakeLists():
                model = model_maker(self.make_model, c.precision, lora=c.lora, qlora=c.qlora)()
                batch = slice_batch(self.make_batch, micro, self.facts.batch_size)()
                # The forward and the loss, as the step runs them under save_on_cpu, whose place fake_save_on_cpu takes.
                with fake_save_on_cpu(copies):
                    micro_loss(model, batch, replace(c.technique(1), offload=False), candidate_loss(c, self.loss))
            self.copies[key] = copies[0] * c.accumulate
        return self.copies[key]

