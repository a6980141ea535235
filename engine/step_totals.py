"""Running totals of the engine's steps, split by whether a step carried prefill tokens.

They answer what an operator of a colocated site asks: how much of the engine's time goes to
prefill, how long a plain decode step takes against one that carries a prefill chunk, and what
share of decoded tokens waited on a chunk (each decoded token is one inter-token gap of its
stream, so that share is the share of gaps a chunk stretched). Monotonic, like counters: a reader
takes differences between two snapshots.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class StepTotals:
    num_decode_steps: int = 0             # steps with decode tokens only
    num_prefill_steps: int = 0            # steps with at least one prefill token (a chunk or a whole prompt)
    decode_step_seconds: float = 0.0      # time in the model and sampler, by kind of step
    prefill_step_seconds: float = 0.0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0            # one per decoding sequence per step
    num_decode_tokens_in_prefill_steps: int = 0

    def add(self, num_prefill_tokens: int, num_decode_tokens: int, seconds: float) -> None:
        if num_prefill_tokens:
            self.num_prefill_steps += 1
            self.prefill_step_seconds += seconds
            self.num_prefill_tokens += num_prefill_tokens
            self.num_decode_tokens_in_prefill_steps += num_decode_tokens
        else:
            self.num_decode_steps += 1
            self.decode_step_seconds += seconds
        self.num_decode_tokens += num_decode_tokens

    def copy(self) -> StepTotals:
        return StepTotals(self.num_decode_steps, self.num_prefill_steps, self.decode_step_seconds,
                          self.prefill_step_seconds, self.num_prefill_tokens, self.num_decode_tokens,
                          self.num_decode_tokens_in_prefill_steps)


@dataclass(slots=True)
class StepPhases:
    """Seconds the engine's steps spent in each phase, summed since start (monotonic, like StepTotals).

    Everything but `forward` is host overhead: Python deciding what runs, building inputs, drawing
    tokens and recording results. On a CPU it is time not spent on model math; on a GPU it is time
    the device may sit idle. (On a GPU `forward` is only the launch: the device time shows up in
    `sample`, which reads the logits first.)
    """

    num_steps: int = 0
    schedule: float = 0.0    # expiring handles, choosing the batch, growing block tables
    prepare: float = 0.0     # token ids, positions, slots and block tables as tensors
    forward: float = 0.0     # the model, including the logits of the sampled rows
    sample: float = 0.0      # grammar masks, logit processing and the draw
    output: float = 0.0      # progress, prefix-cache registration, stop checks, step outputs

    @property
    def host(self) -> float:
        return self.schedule + self.prepare + self.sample + self.output

    @property
    def total(self) -> float:
        return self.host + self.forward

    def minus(self, earlier: StepPhases) -> StepPhases:
        return StepPhases(*(getattr(self, name) - getattr(earlier, name) for name in self.__slots__))

    def copy(self) -> StepPhases:
        return self.minus(StepPhases())
