"""How plan() ranks its candidates: each one's numerics (how its training differs from the plain step's), its
estimated cost, the libraries it needs, and the order a practitioner would choose among the fitting ones."""

from __future__ import annotations

from ..report import format_bytes
from . import host as host_steps  # not `host`: plan's host=, a Host, shares that name
from .candidates import (
    DIFFERENT_MODEL,
    LOST_UPDATES,
    PRECISIONS,
    ROUNDING,
    SAME,
    STATISTICS,
    STRATEGIES,
    TRAINING,
    UNIT_ROUNDOFF,
    Candidate,
    Row,
)

# How fitting recipes are ranked (``PlanSearch.rank_fitting``), with the reasons for each figure:
#
# TIE: two costs within 5% of each other are one cost. The estimate's own resolution is coarser than that: it
# counts FLOPs and bytes at a card's data-sheet rates, leaves out AMP's speed-up, kernel launches and the optimizer's
# own step, and accumulation's extra passes over the weights come to a few percent of a step at a few thousand
# tokens (a BERT on a T4 with and without accumulation: 1.00x and 1.01x). A measured cost, the median of three
# steps, varies by a few percent from run to run too. Within a tie, what a practitioner would choose decides:
# PyTorch alone before a recipe that needs another library, then float16 before bfloat16 on a card without bfloat16
# tensor cores, then the cheaper, then the numerics closer to the plain step's.
TIE = 0.05
# SLOW: a recipe more than 3 times as costly as the fastest fitting one (and than the plain step: a LoRA step's
# saving, no gradient of the frozen weights, is training less, not a faster way to train) ranks after every one that
# is not: 3x turns a day of training into three, well past the estimate's error (percent, not a factor). Optimizer
# state on the host is such a recipe wherever the GPU's step is short beside copying every weight and gradient over
# PCIe and stepping on the CPU (an 8B model at 1,024 tokens a step: estimated at about 10x).
SLOW = 3.0
# A recipe whose host memory need is over the host's ranks after every one that is not, with the reason in its row.
# The host's memory: plan(host=Host(memory=...)) where given (a recipe over it does not fit at all), else Colab's
# standard runtime, the smallest host a learner's GPU comes with (12.7 GB of system RAM in its resources panel, as
# bench/rehearse.py records it).
TYPICAL_HOST_MEMORY = int(12.7e9)


class Ranking:
    """The figures a search ranks by and its order. Mixed into ``gpukit.plan.search.PlanSearch``, whose attributes
    it reads: the card's figures (``tflops``, ``memory_bw``, ``host_bw``, ``slow_bf16``), the optimizers tried and the
    libraries they need, the model's facts, the rows found so far and the host's memory (``host_limit``)."""

    def numerics(self, c: Candidate) -> tuple[int, str, float | None]:
        rank, notes = SAME, []
        opt_note, opt_rank = self.optimizers[c.optimizer][1:]
        if opt_note:
            rank = max(rank, opt_rank)
            notes.append(opt_note)
        if c.precision in ("bf16", "fp16"):
            rank = max(rank, ROUNDING)
            notes.append(f"{'bfloat16' if c.precision == 'bf16' else 'float16'} arithmetic")
        if self.slow_bf16 and c.precision in ("bf16", "bf16 weights"):
            notes.append("no bfloat16 tensor cores on this card: slower than float16")
        if c.precision == "half":
            rank = max(rank, LOST_UPDATES)
            notes.append("float16 weights, gradients and updates, no float32 copy: an update below 2^-11 of its "
                         "weight is lost (float16 has 11 significant bits); remedy: float32 master weights under "
                         "autocast (AMP fp16 + GradScaler)")
        if c.precision == "bf16 weights":
            rank = max(rank, LOST_UPDATES)
            notes.append("bfloat16 weights, gradients and optimizer state, no float32 copy: an update below 2^-8 of "
                         "its weight is lost (bfloat16 has 8 significant bits); remedies: float32 master weights "
                         "under autocast (AMP bf16), or the update rounded stochastically as torchao's optimizers "
                         "offer (torchao.optim.AdamW8bit(..., bf16_stochastic_round=True); its full-precision AdamW "
                         "is torchao.optim._AdamW in torchao 0.18)")
        if c.chunked_loss:
            rank = max(rank, ROUNDING)
            notes.append("the loss summed chunk by chunk (another order)")
        if c.qlora:
            rank = max(rank, DIFFERENT_MODEL)
            notes.append("4-bit frozen base, trained adapters (NF4 weights, bitsandbytes; peft LoRA)")
            if self.slow_bf16:
                notes.append("its bfloat16 compute dtype has no tensor cores on this card")
        elif c.lora:
            rank = max(rank, DIFFERENT_MODEL)
            notes.append("the weights frozen, low-rank adapters trained (peft LoRA)")
        if c.accumulate > 1 or c.strategy != "single GPU":
            rank = max(rank, ROUNDING)
            notes.append("sums in another order")
            if self.facts.has_batchnorm:
                rank = max(rank, STATISTICS)
                notes.append(f"BatchNorm normalises each micro-batch of {self.rank_batch // c.accumulate}")
        if c.checkpointed and self.facts.has_batchnorm:
            rank = max(rank, STATISTICS)
            notes.append("BatchNorm running statistics updated again by the recomputation")
        tolerance = None
        if c.lora:
            return rank, "; ".join(notes), None  # other parameters are trained: no gradient to compare
        if rank <= ROUNDING or (rank in (LOST_UPDATES, TRAINING) and not self.facts.has_batchnorm):
            tolerance = 16 * UNIT_ROUNDOFF[c.precision] if (c.precision != "float32" or rank > SAME) else 1e-6
            if c.precision == "float32" and rank > SAME:
                tolerance = 1e-5  # float32 sums reordered: a few units of roundoff per layer
        return rank, "; ".join(notes), tolerance

    def slowdown(self, c: Candidate, copy_bytes: int = 0) -> float:
        step_seconds = 3 * self.facts.forward_flops / self.tflops
        if step_seconds <= 0:
            return 1.0
        # LoRA: backward computes no gradient of the frozen weights, a forward's worth of the three (the
        # adapters' own arithmetic, rank 16 against the layers' widths, is not counted).
        extra = -self.facts.forward_flops / self.tflops if c.lora else 0.0
        if c.checkpointed:
            extra += self.facts.recompute_flops / self.tflops
        if c.accumulate > 1:
            weight_bytes = self.facts.parameters * (2 if c.precision == "half" else 4)
            extra += (c.accumulate - 1) * 4 * weight_bytes / self.memory_bw  # weights read twice, grads read+written
        if c.chunked_loss:  # each chunk's logits are computed again in backward
            extra += self.facts.head_flops / self.gpus / self.tflops
        if c.qlora:
            # Bytes read and written per quantized weight element in a micro-batch (bitsandbytes 0.50,
            # autograd/_functions.py MatMul4Bit): the forward dequantizes the packed weight (half a byte an element,
            # read) to the bfloat16 compute dtype (2 written) before its matrix product, again where checkpointed;
            # the backward dequantizes it to the weight's dtype as quantized (half a byte read, its element size
            # written) and casts that to bfloat16 (read, 2 written): 13 bytes for float32 weights.
            per_element = 5 + 2 * self.facts.qlora_element_size + (2.5 if c.checkpointed else 0)
            extra += c.accumulate * per_element * sum(self.facts.qlora_shapes) / self.memory_bw
        extra += copy_bytes / self.host_bw
        if c.optimizer in self.host:  # the optimizer step on the host (the GPU's own optimizer step is not counted)
            extra += host_steps.step_seconds(self, c)
        return 1.0 + extra / step_seconds

    def key(self, c: Candidate, copy_bytes: int | None) -> tuple:
        """The order candidates are predicted in: by tier (``tier``), then estimated cost (``copy_bytes``, the
        saved tensors offload copies: None where not yet known, costed as none), PyTorch alone first, and so on."""
        rank = self.numerics(c)[0]
        slowdown = self.slowdown(c, (copy_bytes or 0) + self.host_copies(c))
        return (self.tier(rank), round(slowdown, 4), bool(self.libraries(c)), self.slow_dtype(c), rank,
                c.accumulate, c.checkpointed,
                c.offload, c.chunked_loss, c.lora, c.qlora,
                list(self.optimizers).index(c.optimizer), PRECISIONS.index(c.precision),
                STRATEGIES.index(c.strategy))

    @staticmethod
    def tier(rank: int) -> int:
        """0: the model trained with every update kept (rounding and batch statistics aside); 1: the whole model
        trained, its training changed (small updates lost in 16-bit weights, another optimizer); 2: a different
        model trained (adapters). Fitting recipes rank tier by tier (``rank_fitting``)."""
        return 0 if rank <= STATISTICS else 1 if rank in (LOST_UPDATES, TRAINING) else 2

    def libraries(self, c: Candidate) -> tuple[str, ...]:
        """What the candidate's recipe needs besides PyTorch (torch.optim, autocast, checkpoint, accumulation,
        save_on_cpu, gradient hooks): bitsandbytes (8-bit optimizer state, 4-bit weights), torchao (optimizer state
        on the host), peft (adapters), gpukit (the chunked loss). The user's own optimizer needs nothing new."""
        found = set(self.optimizer_libraries.get(c.optimizer, ()))
        if c.lora:
            found.add("peft")
        if c.qlora:
            found.add("bitsandbytes")
        if c.chunked_loss:
            found.add("gpukit")
        return tuple(sorted(found))

    def slow_dtype(self, c: Candidate) -> bool:
        """bfloat16 on a card without bfloat16 tensor cores: after float16 where the estimate counts them alike."""
        return self.slow_bf16 and c.precision in ("bf16", "bf16 weights")

    def cost(self, r: Row) -> float:
        """A row's step time over the plain step's: measured where its step was timed on the planned device, else
        estimated (a CPU's timings say nothing of a GPU's: a CUDA plan checked on a CPU keeps its estimates)."""
        if r.measured_slowdown is not None and r.measured_on == self.device:
            return r.measured_slowdown
        return r.slowdown

    def ordered(self) -> list[Row]:
        """Every row: the fitting ones predicted, as ``rank_fitting`` ranks them; then the dominated (they add
        techniques to one that fits, and cost more than it); then those predicted not to fit; then the pruned."""
        fitting = [r for r in self.rows.values() if r.fits and r.need is not None]

        def order(r: Row):
            group = 1 if r.fits else 2 if r.need is not None else 3
            return (group, self.tier(r.numerics), self.cost(r), self.slow_dtype(r.candidate), r.numerics,
                    r.need if r.need is not None else 0)

        rest = [r for r in self.rows.values() if not (r.fits and r.need is not None)]
        return self.rank_fitting(fitting) + sorted(rest, key=order)

    def rank_fitting(self, rows: list[Row], note: bool = True) -> list[Row]:
        """Fitting rows in the order a practitioner would choose among them (the first is the plan's choice):

        1. a recipe that is slow (more than ``SLOW`` times the fastest's cost and the plain step's) or hungry for
           host memory (its host peak over ``host_limit``) after every one that is neither;
        2. then by tier (``tier``): every update kept, then the whole model trained otherwise, then adapters;
        3. then by cost, where costs within ``TIE`` of the cheapest of a run of them are one cost, and among those
           PyTorch alone first, float16 before bfloat16 on a card without bfloat16 tensor cores, the cheaper, the
           numerics closer to the plain step's, the smaller need.

        ``note``: each row whose place cost alone would not give says why in ``ranking``."""
        if not rows:
            return []
        fastest = max(min(self.cost(r) for r in rows), 1.0)
        limit = self.host_limit

        def demoted(r: Row) -> str:
            why = []
            if self.cost(r) > SLOW * fastest:
                why.append(f"{self.cost(r) / fastest:.1f}x the fastest fitting recipe's cost (over {SLOW:g}x)")
            if r.host_peak is not None and r.host_peak > limit:
                where = "the host's memory" if self.host_memory is not None else \
                    "Colab's host, a typical one; plan(host=Host(memory=...)) says yours"
                why.append(f"its host needs {format_bytes(r.host_peak)}, over the {format_bytes(limit)} of {where}")
            return "; ".join(why)

        reasons = {id(r): demoted(r) for r in rows}
        ranked: list[Row] = []
        for slow in (False, True):
            for tier in (0, 1, 2):
                group = sorted((r for r in rows if bool(reasons[id(r)]) == slow and self.tier(r.numerics) == tier),
                               key=lambda r: (self.cost(r), r.numerics, r.need))
                while group:  # a run of costs within TIE of its cheapest: one cost
                    tie = [r for r in group if self.cost(r) <= self.cost(group[0]) * (1 + TIE)]
                    group = group[len(tie):]
                    chosen = sorted(tie, key=lambda r: (bool(r.libraries), self.slow_dtype(r.candidate), self.cost(r),
                                                        r.numerics, r.need))
                    if note:
                        for r in tie:
                            r.ranking = ""
                        first = tie[0]
                        if chosen[0] is not first:
                            why = ("PyTorch alone first" if bool(first.libraries) and not chosen[0].libraries
                                   else "float16 before bfloat16 on this card")
                            for r in chosen[:chosen.index(first)]:
                                r.ranking = (f"before {first.candidate.label} [{first.candidate.optimizer}], "
                                             f"whose cost is within {TIE:.0%}: {why}")
                    ranked += chosen
        if note:
            why_tier = {1: "the whole model trained, its training changed (16-bit weights without a float32 copy lose "
                           "small updates; another optimizer): after the recipes that keep every update",
                        2: "a different model trained (adapters on frozen weights): after every recipe that trains "
                           "the model itself"}
            for r in rows:
                tier = self.tier(r.numerics)
                ahead = [o for o in rows if not reasons[id(o)] and self.tier(o.numerics) < tier
                         and self.cost(o) >= self.cost(r)]
                if tier and not reasons[id(r)] and ahead and not r.ranking:
                    cheapest = min(ahead, key=self.cost)
                    r.ranking = (f"{why_tier[tier]}, such as {cheapest.candidate.label} "
                                 f"[{cheapest.candidate.optimizer}], whose cost is not lower")
                if reasons[id(r)]:
                    r.ranking = f"after every recipe that is not slow or hungry for host memory: {reasons[id(r)]}"
        return ranked

    def could_rank_among(self, c: Candidate, cost: float, fitting: list[Candidate]) -> bool:
        """Whether the candidate, were it to fit at ``cost`` (at least its cost: its key's) and need no host memory
        over the limit, would rank among the first ``alternatives + 1`` fitting recipes found (``rank_fitting``):
        if not, it is not predicted."""
        found = [self.rows[f] for f in fitting]
        rank, note, tol = self.numerics(c)
        probe = Row(c, "fits", True, need=0, slowdown=cost, numerics=rank, libraries=self.libraries(c))
        return any(r is probe for r in self.rank_fitting(found + [probe], note=False)[:self.alternatives + 1])
