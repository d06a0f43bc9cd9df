"""The tokens a step leaves on the device for the next one, which may name them before the host has them.

Each sampling sequence s of a step owns WIDTH = 1 + num_model_steps slots: the token the step emitted
for it (slot s * WIDTH) and, with an MTP head, the head's drafts after it (slots s * WIDTH + 1 + j).
The next step's input ids may be placeholders ~slot (= -slot - 1) for them (embedding reads the
slot), and its positions may be short of the drafts that step accepted, which `accepted[s]` holds
and the step adds on the device (cupyspec/model/positions.py): so a step can be formed and launched
while the one before still runs (overlap scheduling).
"""

from __future__ import annotations

from typing import Any

import numpy as np


class DeviceTokens:
    """The slots and the accepted draft counts of the last step's sampling sequences."""

    def __init__(self, xp: Any, max_num_seqs: int, num_model_steps: int = 0) -> None:
        """Room for `capacity(max_num_seqs)` sequences: a drafting graph's padding entries write too."""
        count = self.capacity(max_num_seqs)
        self.width = 1 + num_model_steps
        self.slots = xp.zeros(count * self.width, dtype=np.int32)  # [count * WIDTH]
        self.by_seq = self.slots.reshape(count, self.width)  # [count, WIDTH], a view
        self.accepted = xp.zeros(count, dtype=np.int32)  # [count]

    @staticmethod
    def capacity(max_num_seqs: int) -> int:
        """max_num_seqs rounded up to a multiple of 16: a CUDA-graph bucket of sequences holds it."""
        return -(-max_num_seqs // 16) * 16

    def emitted(self, s: int) -> int:
        """The placeholder id of the token sampling sequence s emits in the step."""
        return ~(s * self.width)

    def drafts(self, num_seqs: int) -> np.ndarray:
        """[num_seqs, WIDTH - 1] int32: the placeholder ids of the drafts the head makes in the step
        for each of the first num_seqs sampling sequences."""
        slots = np.arange(num_seqs, dtype=np.int32)[:, None] * self.width + np.arange(1, self.width, dtype=np.int32)
        return ~slots

    def sequence_of(self, placeholder: int) -> int:
        """The sampling sequence whose slot a placeholder id names."""
        return ~placeholder // self.width

    def put_sampled(self, tokens: Any) -> None:
        """A plain step's tokens [S]: no drafts accepted (which only a step with drafts reads)."""
        count = len(tokens)
        self.by_seq[:count, 0] = tokens
        if self.width > 1:
            self.accepted[:count] = 0

    def put_verdict(self, runs: Any) -> None:
        """A verifying step's runs [2, S]: the accepted drafts and the emitted token of each sequence."""
        count = runs.shape[1]
        self.by_seq[:count, 0] = runs[1]
        self.accepted[:count] = runs[0]

    def put_drafts(self, drafts: Any) -> None:
        """The MTP head's drafts [S, num_model_steps] for the next step."""
        self.by_seq[:len(drafts), 1:] = drafts
