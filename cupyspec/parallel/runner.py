"""The engine's runner over a tensor-parallel group: every rank's ModelRunner runs every step.

Each rank launches the step on its shard, the ranks at once on their threads (ranks.py), meeting
at the collectives inside the forward pass (queued on their streams, captured in their CUDA
graphs). The logits are gathered whole on every rank before sampling, verification, logprobs and
an MTP head's drafting, which read the same inputs and seeds on every rank: so every rank emits the
same tokens and drafts into its own device buffers, and the first rank's results are the step's.
The other ranks' copies to the host are only waited for.
"""

from __future__ import annotations

from typing import Any

from cupyspec.engine.runner import LaunchedStep, ModelRunner
from cupyspec.engine.step_inputs import StepInputs
from cupyspec.engine.step_outputs import SeqStepOutput
from cupyspec.parallel.ranks import RankThreads


class ParallelRunner:
    """ModelRunner's interface over the ranks' runners; what it does not define is the first
    rank's (`leader`): inputs, placeholders and the MTP proposer are host-side and shared."""

    def __init__(self, runners: list[ModelRunner], threads: RankThreads) -> None:
        self.runners, self.threads, self.leader = runners, threads, runners[0]
        self._others: dict[int, list[LaunchedStep]] = {}  # the other ranks' steps, by id of the leader's

    def __getattr__(self, name: str) -> Any:
        return getattr(self.leader, name)

    def launch(self, inputs: StepInputs) -> LaunchedStep:
        """The step queued on every rank; the first rank's LaunchedStep."""
        leader, *others = self.threads.map(lambda rank: self.runners[rank].launch(inputs))
        self._others[id(leader)] = others
        return leader

    def collect(self, step: LaunchedStep, logprobs: bool = True) -> list[SeqStepOutput]:
        """The first rank's outputs (ModelRunner.collect), once the other ranks' copies are done too."""
        outputs = self.leader.collect(step, logprobs)
        for other in self._others.pop(id(step)):
            other.wait_copies()
        return outputs

    def close(self) -> None:
        """Every rank's CUDA graphs destroyed, then the communicators (NCCL frees them only once no
        graph holds their collectives), then the ranks' threads ended."""
        self.threads.map(lambda rank: self.runners[rank].close())
        self.threads.close()
