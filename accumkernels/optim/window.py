"""The accumulation window: what has been summed since the last real step.

It owns its counters, its reset and its piece of the checkpoint; nothing else lists them.
"""

from __future__ import annotations

from accumkernels.optim.config import Config

_KEYS = ("micro_steps", "kept", "touched", "weights", "dropped", "divisor", "boundary_only")


class Window:
    """Counts and normalisation of the current window.

    * ``micro_steps``: micro-batches in the window (dropped ones included);
    * ``kept``: those whose gradients were kept (``nonfinite="skip_microbatch"`` drops some);
    * ``touched``: ``id()`` of the params whose fp32 view holds data of this window. The first
      write of a window overwrites a view (no zeroing pass), so only these views are valid;
    * ``weights``: what ``add_weight`` reported, in order; ``dropped``: indices of dropped
      micro-batches (their weights do not count);
    * ``divisor``: the buffer holds ``sum(g) / divisor`` (1/N is fused up front for
      ``reduction="mean"`` with a known N);
    * ``boundary_only``: learned from the ``step()`` calls the wrapper receives, kept across
      windows: None until the first ``step()`` on a non-empty window; True if that one came
      on a complete window (Trainer-style caller: it also ends a short last window with
      ``step()``); False for good once a ``step()`` comes on an incomplete window without
      ending it (the caller steps every micro-batch).
    """

    def __init__(self, config: Config):
        self._n = config.accumulation_steps
        self._mean = config.reduction == "mean"
        self.boundary_only: bool | None = None
        self.reset()

    def reset(self) -> None:
        self.micro_steps = 0
        self.kept = 0
        self.touched: set[int] = set()
        self.weights: list[float] = []
        self.dropped: set[int] = set()
        self.divisor = float(self._n) if (self._mean and self._n) else 1.0

    @property
    def empty(self) -> bool:
        return self.micro_steps == 0 and not self.touched

    @property
    def complete(self) -> bool:
        """N micro-batches (or more) are in the window."""
        return self._n is not None and self.micro_steps >= self._n

    def add_microbatch(self, kept: bool) -> None:
        if kept:
            self.kept += 1
        else:
            self.dropped.add(self.micro_steps)
        self.micro_steps += 1

    def local_weight(self) -> float:
        return sum(w for i, w in enumerate(self.weights) if i not in self.dropped)

    # -- checkpoint ----------------------------------------------------------------------------
    def state_dict(self, params: list) -> dict:
        return {
            "micro_steps": self.micro_steps,
            "kept": self.kept,
            "touched": [i for i, p in enumerate(params) if id(p) in self.touched],
            "weights": list(self.weights),
            "dropped": sorted(self.dropped),
            "divisor": self.divisor,
            "boundary_only": self.boundary_only,
        }

    @staticmethod
    def parse(state: object, params: list) -> dict:
        """Check a saved window (raises ValueError) and return it in loadable form."""
        if not isinstance(state, dict):
            raise ValueError("load_state_dict: 'window' must be a dict")
        missing = [k for k in _KEYS if k not in state]
        if missing:
            raise ValueError(f"load_state_dict: the saved window lacks {missing}")
        try:
            touched = [int(i) for i in state["touched"]]
            parsed = {
                "micro_steps": int(state["micro_steps"]), "kept": int(state["kept"]),
                "weights": [float(w) for w in state["weights"]],
                "dropped": {int(i) for i in state["dropped"]},
                "divisor": float(state["divisor"]),
                "boundary_only": None if state["boundary_only"] is None
                else bool(state["boundary_only"]),
            }
        except (TypeError, ValueError) as exc:
            raise ValueError(f"load_state_dict: malformed window ({exc})") from None
        if any(not 0 <= i < len(params) for i in touched):
            raise ValueError("load_state_dict: the saved window names params this optimizer lacks")
        if not 0 <= parsed["kept"] <= parsed["micro_steps"] or not parsed["divisor"] > 0:
            raise ValueError("load_state_dict: inconsistent window counts")
        parsed["touched"] = {id(params[i]) for i in touched}
        return parsed

    def load(self, parsed: dict) -> None:
        for key, value in parsed.items():
            setattr(self, key, value)
