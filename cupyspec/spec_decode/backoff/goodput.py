"""Whether drafting pays at the present load, measured on what the engine emits: the back-off rule's
guarantee (speculation never below no speculation, at any load) checked rather than predicted.

The cost fits (step_cost.py) price each step from its shape, one turn of the loop at a time. Where a
step's cost shows in another turn's wall time they misprice drafting: an MTP head drafts on the
device in one step for the next, while the host works on the turn after, and where the host bounds
the step its extra work on drafted tokens lands wherever it is done. So the turns are also taken in
windows of WINDOW_TURNS per load band, each window in one mode, drafting (the rule decides) or off
(nobody drafts). A window of the mode that does not lead, a trial, is compared on tokens emitted per
second with the leading mode's windows on either side of it, whose mean cancels what drifts over
seconds (a pause of the host, a burst of prompts, the load rising or draining). Windows are noisy
still (at few sequences the text of one request), so every verdict is checked once more: a trial
that emits more takes the lead, and the mode it took it from is tried again after one window; a
trial that emits less is also tried again after one window, and only a mode that lost twice in a
row waits long, in proportion to what it lost: a share d, d / TRIAL_SHARE windows (at most MAX_WAIT,
so that a change of load is noticed within seconds). Its two trials then cost at most about
2 * TRIAL_SHARE of the time.
"""

from __future__ import annotations

from dataclasses import dataclass

WINDOW_TURNS = 32  # turns of a window; a load band changes little within it
SETTLE_TURNS = 2  # a window's first turns, not counted: they finish the steps of the mode before
TRIAL_SHARE = 0.005  # of the time, at most, spent on each trial of the mode that emitted less
MAX_WAIT = 64  # windows, at most, before the mode that emitted less is tried again


@dataclass
class _Band:
    """One load band's modes: the one leading, the one measured now, and the trial awaiting its verdict."""

    leading: bool = True  # drafting leads (else off)
    drafting: bool = True  # the mode of the window being measured: the leading one, or a trial of the other
    wait: int = 1  # windows of the leading mode still to run before the other is tried
    losses: int = 0  # trials in a row that the other mode lost
    turns: int = 0  # turns of the window so far
    tokens: int = 0  # tokens emitted in its counted turns
    seconds: float = 0.0  # their wall time
    before: float = 0.0  # tokens per second of the leading mode's last window
    trial: float | None = None  # tokens per second of the trial just measured, judged after the next window


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
        """End a window and choose the next one's mode. A trial's verdict waits for the leading mode's
        next window (module docstring); the leading mode runs on, or the other is tried once its wait
        is over."""
        rate = state.tokens / max(state.seconds, 1e-9)
        state.turns, state.tokens, state.seconds = 0, 0, 0.0
        if state.drafting != state.leading:
            state.trial, state.drafting = rate, state.leading
            return
        trial, state.trial = state.trial, None
        if trial is not None and GoodputCheck._judge(state, trial / max(0.5 * (state.before + rate), 1e-9)):
            return  # the new leader runs a window before the old one is tried again
        state.before = rate
        state.wait -= 1
        if state.wait <= 0:
            state.drafting = not state.leading

    @staticmethod
    def _judge(state: _Band, ratio: float) -> bool:
        """A trial's verdict, from what it emitted per second over the leading mode's windows either
        side of it; whether it takes the lead. The wait set here counts the window that closed."""
        if ratio > 1.0:
            state.leading = state.drafting = not state.leading
            state.losses, state.wait = 0, 1
            return True
        state.losses += 1
        state.wait = 1 if state.losses < 2 else min(MAX_WAIT, max(1, round((1.0 - ratio) / TRIAL_SHARE)))
        return False
