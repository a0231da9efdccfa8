"""Bounds of a candidate's need, found without predicting the candidate: its optimizer's state and step alone
(the floor), a prefix of its step, and its configuration's phases as the step of another optimizer allocated them
(how the search orders candidates and prunes with these: gpukit.plan.search)."""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace

from .._torch import FakeTensorMode
from ..cudarules import CudaRules, use_cuda_optimizer_defaults
from ..estimate import predict, state_bytes
from ..factories import ValuesWhileBuilding
from .candidates import WEIGHTS, Candidate
from . import host as host_steps  # not `host`: plan's host=, a Host, shares that name
from .steps import (
    StateAlone,
    model_maker,
    optimizer_only_step,
    prefix_residual,
    prefix_step,
    slice_batch,
    state_by_foreach,
    stateless,
)

# A configuration's allocated peak by the end of its forward as a step that starts without gradients allocates it:
# an optimizer stepped in backward, or one that frees each gradient once copied to the host, frees them all there,
# where another optimizer's step starts with the last step's gradients (zero_grad frees them first).
FREED = "forward, gradients freed"


class Bounds:
    """Lower bounds of a candidate's need, and what they are made from (floors, optimizer states, phases of
    configurations). Mixed into ``gpukit.plan.search.PlanSearch``, whose attributes it reads and fills: the
    budget (``limit``, ``allowance``), the optimizers, the model's facts and the tables of bounds found so far
    (``floors``, ``states``, ``phases``, ``every_grad``, ``prefixed``, ``saved``)."""

    def floor(self, c: Candidate) -> dict:
        """Model state and the optimizer step alone, for this optimizer and parameter type."""
        key = (c.optimizer, WEIGHTS[c.precision], c.lora, c.qlora)
        if c.optimizer in self.host:  # not predicted: torchao's optimizer runs only in predict_offload
            return self.state_info(c)
        if key not in self.floors:
            info: dict = {}
            p = predict(model_maker(self.make_model, c.precision, lora=c.lora, qlora=c.qlora),
                        self.optimizers[c.optimizer][0], lambda: (),
                        step=optimizer_only_step(info), device=self.device, card=self.card, breakdown=False)
            self.predictions += 1
            info["peak"] = p.peak
            self.floors[key] = info
        return self.floors[key]

    def state_info(self, c: Candidate) -> dict:
        """The floor's figures but its peak (parameters, gradients, optimizer state, and "before": what its step
        starts with), from one optimizer step under fake tensors outside ``predict``: no warm-up step, no ledger,
        no simulated allocator. The same bytes as the floor's (tests/test_plan_bounds.py)."""
        key = (c.optimizer, WEIGHTS[c.precision], c.lora, c.qlora)
        if key in self.floors:
            return self.floors[key]
        if c.optimizer in self.same_state:  # (its floor's peak is its own; its state is the other's)
            key = (self.same_state[c.optimizer], WEIGHTS[c.precision], c.lora, c.qlora)
            c = replace(c, optimizer=self.same_state[c.optimizer])
        if key not in self.states and c.optimizer in self.host:
            self.states[key] = host_steps.state_info(self, c)
        if key not in self.states:
            info: dict = {}
            rules = CudaRules(self.card.compute_capability) if self.card is not None else CudaRules()
            on_cuda = rules if self.device == "cuda" else contextlib.nullcontext()
            with FakeTensorMode(allow_non_fake_inputs=True), on_cuda:
                model = model_maker(self.make_model, c.precision, lora=c.lora, qlora=c.qlora)()
                with ValuesWhileBuilding():
                    optimizer = self.optimizers[c.optimizer][0](model.parameters())
                if self.device == "cuda":
                    use_cuda_optimizer_defaults(optimizer)
                with state_by_foreach(optimizer), StateAlone():
                    optimizer_only_step(info)(model, optimizer, ())
                info["before"] = state_bytes(model, optimizer)[0]
            self.states[key] = info
        return self.states[key]

    def state_change(self, c: Candidate) -> int:
        """Bytes a rank holds more (+) or less (-) than one process training alone, by the sharding formulas
        (the stages of the ZeRO paper; DDP's gradient buckets are a second copy of the gradients)."""
        if c.strategy == "single GPU":
            return 0
        f, n = self.state_info(c), self.gpus
        p, g, o = f["params"], f["grads"], f["optimizer_state"]
        if c.strategy == "DDP":
            return g
        if c.strategy == "ZeRO-1":
            return g - o + math.ceil(o / n)
        unit = self.facts.largest_block_bytes // (2 if c.precision == "half" else 1)
        return -(p + g + o) + math.ceil((p + g + o) / n) + 2 * unit + unit  # two gathered units and one's grads

    def state_bound(self, c: Candidate, known: bool = False) -> int | None:
        """What the candidate's step starts with (parameters, gradients, optimizer state: ``state_info``, no
        prediction), or its floor's peak where that was predicted, with its sharding formula and the context
        allowance: ``lower_bound`` without predicting a floor. ``known``: only where that state was read already
        (else None)."""
        key = (c.optimizer, WEIGHTS[c.precision], c.lora, c.qlora)
        if known:
            same = (self.same_state.get(c.optimizer, c.optimizer), *key[1:])
            if key not in self.floors and key not in self.states and same not in self.states:
                return None
        state = self.floors[key]["peak"] if key in self.floors else self.state_info(c)["before"]
        return state + self.state_change(c) + self.allowance

    def lower_bound(self, c: Candidate) -> int:
        """Model state and the optimizer step alone: the floor's peak where it was predicted, or is worth
        predicting (what the step starts with, and twice the gradients for the optimizer step's temporaries, would be
        over the budget: an optimizer steps only what has a gradient, so a frozen base, LoRA's or QLoRA's, adds
        none), else what the floor's step starts with."""
        state = self.state_bound(c)  # (the floor's peak where it was predicted)
        key = (c.optimizer, WEIGHTS[c.precision], c.lora, c.qlora)
        if key not in self.floors and state <= self.limit < state + 2 * self.state_info(c)["grads"]:
            return self.floor(c)["peak"] + self.state_change(c) + self.allowance
        return state

    def held(self, c: Candidate) -> int:
        """What the predicted step's batch leaves out of the whole batch held (accumulation's 2 micro-batches)."""
        n = self.rank_batch // c.accumulate * (1 if c.accumulate == 1 else 2)
        return self.facts.batch_bytes(self.facts.batch_size) - self.facts.batch_bytes(n)

    def phase_bound(self, c: Candidate, floor: bool = True) -> int | None:
        """A lower bound of the candidate's need from a prediction of its configuration with another optimizer
        (None: none yet): that step's allocated peak before its optimizer step (before its first backward, and
        without the gradients that step started with, for an optimizer stepped in backward or one that frees each
        gradient once copied to the host: ``FREED``), less its optimizer's state, plus this optimizer's state (its
        floor's; 0 with ``floor=False``, where a sharding formula cannot add less than nothing). Reserved memory is
        never below allocated, so the bound holds for the reserved need too."""
        in_backward = self.one_micro_batch(c.optimizer)
        known = self.phases.get(self.configuration(c), {}).get(FREED if in_backward else "backward")
        if known is None or not (floor or c.strategy in ("single GPU", "DDP")) or \
                (floor and self.configuration(c) not in self.every_grad):
            return None
        state, change = (self.state_info(c)["state"], self.state_change(c)) if floor else (0, 0)
        return known + state + self.held(c) + change + self.allowance

    @staticmethod
    def configuration(c: Candidate) -> tuple:
        """What a prediction depends on but for the optimizer and the parallelism (a rank's step is the same)."""
        return c.precision, c.accumulate, c.checkpointed, c.offload, c.lora, c.chunked_loss, c.qlora

    def learn_phases(self, c: Candidate, p, phases: dict) -> None:
        """Keep a predicted step's phases for its configuration, where they hold for another optimizer: its
        optimizer is not stepped in backward, and every trained parameter had a gradient (so every optimizer has
        state for each, as its floor has)."""
        if c.optimizer.endswith(", in backward") or not phases.get("every_grad") or "backward" not in phases:
            return
        known = self.phases.setdefault(self.configuration(c), {})
        self.every_grad.add(self.configuration(c))
        for phase in ("forward", "backward"):
            if phase in phases:
                value = p.before_step + phases[phase] - phases["state"]
                known[phase] = max(known.get(phase, value), value)
        if "forward" in phases:  # for an optimizer that frees every gradient in backward: it starts without them
            value = p.before_step + phases["forward"] - phases["state"] - phases["grads"]
            known[FREED] = max(known.get(FREED, value), value)

    def prefix(self, c: Candidate) -> None:
        """Once per configuration that nothing has bounded yet: its step up to its optimizer step, predicted without
        the warm-up and stopped as soon as its allocated bytes put every candidate of the configuration over the
        budget (``steps.prefix_step``), or at the end of the forward where they, with the gradients and optimizer
        state of the candidate it is run for, are under ``hopeless`` (half) of it (the rest of the step is unlikely
        to get there). Its phases join those predictions learn (``phase_bound``)."""
        key = self.configuration(c)
        if key in self.prefixed or key in self.phases:
            return
        self.prefixed.add(key)
        proxy_k = 1 if c.accumulate == 1 else 2
        margin = self.held(c) + self.allowance
        # (a forward far below the budget can still bound an optimizer with a large state: AdamW's is twice the
        # model, and the bound adds it)
        info = self.state_info(c)
        later = info["grads"] + info["state"]

        def enough(allocated: int, forward: bool) -> bool:
            return allocated + margin > self.limit or (
                forward and allocated + margin + later <= self.limit * self.hopeless)

        for last_only in (True, False):  # accumulation: its last micro-batch alone, unless that cannot tell
            found = {}
            p = predict(model_maker(self.make_model, c.precision, lora=c.lora, qlora=c.qlora), stateless,
                        slice_batch(self.make_batch, self.rank_batch // c.accumulate * proxy_k, self.facts.batch_size),
                        step=prefix_step(c, proxy_k, self.loss, found, enough, last_only), warmup_steps=0,
                        device=self.device, card=self.card, breakdown=False)
            self.predictions += 1
            if "shared" not in found:
                break
        # The CUDA workspaces of the matrix products it ran: a real step, its warm-up's included, runs them too.
        base = found["base"] + p.workspaces - prefix_residual(found)
        known = self.phases.setdefault(key, {})
        for phase in ("forward", "backward"):
            if phase in found:
                value = base + found[phase]
                known[phase] = max(known.get(phase, value), value)
        if "forward" in found:  # (no warm-up: no gradients when it starts)
            value = base + found["forward"]
            known[FREED] = max(known.get(FREED, value), value)
        if found.get("every_grad"):
            self.every_grad.add(key)
        if "saved" in found:
            self.saved[key] = found["saved"]

    def over(self, c: Candidate) -> int | None:
        """A lower bound of the candidate's need over the budget, without predicting it (its floor and the phases
        of its configuration), or None."""
        self.prefix(c)
        for bound in (self.phase_bound(c, floor=False), self.lower_bound(c), self.phase_bound(c)):
            if bound is not None and bound > self.limit:
                return bound
        return None

    def amp_bound(self, c: Candidate) -> int:
        """A lower bound for autocast candidates: autocast keeps the float32 state and at best halves what the
        step needs above it, so it needs at least the state plus half of what the float32 group's most saving
        candidate needs above it (where float32 is a precision tried, and that candidate was predicted, or its
        configuration with another optimizer: ``phase_bound``); else nothing."""
        if c.precision not in ("bf16", "fp16") or "float32" not in self.precisions:
            return 0
        ref = self.most_saving(replace(c, precision="float32"))
        floor = self.lower_bound(ref)
        if floor > self.limit:
            return floor
        known = self.rows[ref].need if ref in self.rows and self.rows[ref].need is not None else self.phase_bound(ref)
        return floor + max(known - floor, 0) // 2 if known is not None else 0

    def copies_at_least(self, c: Candidate) -> int | None:
        """A lower bound of ``copy_bytes(c)`` from the prefix of its configuration without offload, where it ran
        the same forward and read what it saved (``steps.saved_bytes``; so far, where it stopped in the forward);
        else None."""
        saved = self.saved.get(self.configuration(replace(c, offload=False)))
        return None if saved is None else 2 * saved * c.accumulate
