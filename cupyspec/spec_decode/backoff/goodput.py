"""Whether drafting pays at the present load, measured on what the engine emits: the back-off rule's
guarantee (speculation never below no speculation, at any load) checked rather than predicted.

The cost fits (step_cost.py) price each step from its shape, one turn of the loop at a time. Where a
step's cost shows in another turn's wall time they misprice drafting: an MTP head drafts on the
device in one step for the next, while the host works on the turn after, and where the host bounds
the step its extra work on drafted tokens lands wherever it is done. So the turns are also taken in
windows of WINDOW_TURNS per load band, each window in one mode, drafting (the rule decides) or off
(nobody drafts). A window of the mode that does not lead, a trial, is compared on tokens emitted per
second with the leading mode's windows since the trial before. Windows are noisy (a burst of
prompts, a pause of the host, at few sequences the text of one request), so every verdict is
checked once more: a trial that emits more takes the lead, and the mode it took it from is tried
again after one window; a trial that emits less is also tried again after one window, and only a
mode that lost twice in a row waits long, in proportion to what it lost: a share d, d / TRIAL_SHARE
windows (at most MAX_WAIT, so that a change of load is noticed within seconds). Its two trials then
cost at most about 2 * TRIAL_SHARE of the time.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_TURNS = 32  # turns of a window; a load band changes little within it
SETTLE_TURNS = 2  # a window's first turns, not counted: they finish the steps of the mode before
TRIAL_SHARE = 0.005  # of the time, at most, spent on each trial of the mode that emitted less
MAX_WAIT = 64  # windows, at most, before the mode that emitted less is tried again


@dataclass
class _Band:
    """One load band's modes: the one leading, the one measured now, and what the leading one emitted
    since the last trial."""

    leading: bool = True  # drafting leads (else off)
    drafting: bool = True  # the mode of the window being measured: the leading one, or a trial of the other
    wait: int = 1  # windows of the leading mode still to run before the other is tried
    losses: int = 0  # trials in a row that the other mode lost
    turns: int = 0  # turns of the window so far
    tokens: int = 0  # tokens emitted in its counted turns
    seconds: float = 0.0  # their wall time
    lead_tokens: int = 0  # tokens emitted in the leading mode's counted turns since the last trial
    lead_seconds: float = 0.0  # their wall time


class GoodputCheck:
    """Per load band, whether the rule may draft; fed each turn's emitted tokens and wall time."""

    def __init__(self) -> None:
        self._bands: dict[int, _Band] = {}

    def drafting(self, band: int) -> bool:
        """Whether the rule may draft in a step of this load band."""
        return self._bands.setdefault(band, _Band()).drafting

    def observe(self, band: int, tokens: int, seconds: float) -> None:
        """One turn of the load band: the tokens it emitted and its wall time."""
        state = self._bands.setdefault(band, _Band())
        state.turns += 1
        if state.turns > SETTLE_TURNS:
            state.tokens += tokens
            state.seconds += seconds
        if state.turns == WINDOW_TURNS:
            self._close(state)

    @staticmethod
    def _close(state: _Band) -> None:
        """End a window and choose the next one's mode. The leading mode's window adds to its tally,
        then it runs on, or the other is tried once its wait is over. A trial is compared with that
        tally (module docstring)."""
        tokens, seconds = state.tokens, max(state.seconds, 1e-9)
        state.turns, state.tokens, state.seconds = 0, 0, 0.0
        if state.drafting == state.leading:
            state.lead_tokens += tokens
            state.lead_seconds += seconds
            state.wait -= 1
            if state.wait <= 0:
                state.drafting = not state.leading
            return
        trial, leader = tokens / seconds, state.lead_tokens / max(state.lead_seconds, 1e-9)
        if trial > leader:
            state.leading, state.losses = state.drafting, 0
        else:
            state.losses += 1
        loss = 1.0 - trial / max(leader, 1e-9)
        state.wait = 1 if state.losses < 2 else min(MAX_WAIT, max(1, round(loss / TRIAL_SHARE)))
        state.lead_tokens, state.lead_seconds = 0, 0.0
        state.drafting = state.leading
